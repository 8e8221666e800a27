"""Benchmark: a serving step's decodes and prompt chunk in one forward pass, or in two.

With chunked prefill a step decodes the running sequences and computes a chunk of a waiting
prompt. Two passes read every weight twice; one pass over the flattened tokens (the engine's
ragged view, paged.RaggedView, as vLLM and Sarathi-Serve batch a step) reads it once. Timed side
by side, on the engine's own pool: the decodes alone, the chunk alone, the two one after the
other, and the one mixed pass (its head over the decodes' rows), each rolled back after.

--reads 256,1024 adds a table: the decode step of --decodes sequences at each of those contexts,
its attention reading the pool four ways on the same pool and books, side by side in CPU time:
before, the plain attention over each row's blocks gathered end to end (a whole-context copy a
layer: the engine's default until the decodes read in place, and still its batch-invariant
mode); after, the plain attention over the blocks where they lie (paged.InPlace read by
tiled.two_pass_attention, 256 slots a tile: the engine's default now); and the tiled one over
the gathered copy and in place (64-slot tiles, an online softmax).
--markdown FILE also writes the tables, headed by the kernel (docs/benchmarks/mixed-step-KERNEL.md
for each kernel, docs/benchmarks.md).
"""
import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: _common, _table

from _common import (
    add_model_argument,
    add_threads_argument,
    load_model,
    positive_int,
    positive_ints,
    timing_header,
)
from _table import Table
from bench_decode import write_markdown

from minitransformer.backend import to_device
from minitransformer.generate import last_logits
from minitransformer.measure.timing import blas_kernel, time_together, where_it_ran
from minitransformer.model import forward, head
from minitransformer.serve.paged import PagedCache, RaggedView


def pool(model, decodes, context, prompt_len, chunk_start, block_size, seed):
    """A pool holding `decodes` sequences of `context` tokens and a prompt's first
    `chunk_start` tokens -> (cache, the decodes' ids, the prompt's id, its tokens)."""
    rng = np.random.default_rng(seed)
    V, bs = model.config.vocab_size, block_size
    blocks = decodes * (context // bs + 2) + prompt_len // bs + 2
    cache = PagedCache.allocate(model.config, blocks, block_size)
    for s in range(decodes):
        tokens = rng.integers(0, V, context).tolist()
        cache.books.add(s, tokens)
        forward(model, np.array([tokens]), cache.view([s]))
    prompt = rng.integers(0, V, prompt_len).tolist()
    cache.books.add("prompt", prompt)
    if chunk_start:
        forward(model, np.array([prompt[:chunk_start]]), cache.view(["prompt"]))
    return cache, list(range(decodes)), "prompt", prompt


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_argument(parser, default="smollm2")
    parser.add_argument("--decodes", type=positive_int, default=4, help="sequences decoding")
    parser.add_argument("--context", type=positive_int, default=64,
                        help="tokens each decoding sequence holds (default: 64)")
    parser.add_argument("--prompt-len", type=positive_int, default=600)
    parser.add_argument("--chunk", type=positive_int, default=64,
                        help="prompt tokens a step: the budget less the decodes (default: 64)")
    parser.add_argument("--chunk-start", type=int, default=0,
                        help="the chunk's first position in the prompt (default: 0)")
    parser.add_argument("--block-size", type=positive_int, default=16)
    parser.add_argument("--repeat", type=positive_int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--reads", type=positive_ints, metavar="CONTEXTS",
                        help="also time the decode step at these contexts (e.g. 256,1024), its "
                             "pool read gathered and in place")
    parser.add_argument("--markdown", metavar="FILE", help="also write the tables as Markdown")
    add_threads_argument(parser)
    args = parser.parse_args(argv)
    if not 0 <= args.chunk_start <= args.prompt_len - args.chunk:
        parser.error(f"--chunk-start must be in [0, {args.prompt_len - args.chunk}]")

    ran_on = timing_header(args)
    model = load_model(args.model)
    cache, ids, p, prompt = pool(model, args.decodes, args.context, args.prompt_len,
                                 args.chunk_start, args.block_size, args.seed)
    first, n = args.chunk_start, args.chunk
    steps, undo = ways(model, cache, ids, p, np.array([prompt[first:first + n]]))
    timings = time_together(steps, warmup=1, repeat=args.repeat, after=undo)
    table = Table("Benchmark: a step's decodes and prompt chunk, one forward pass or two",
                  columns=[("step", ""), ("min ms", ".1f"), ("median ms", ".1f")])
    table.header(f"{args.decodes} sequences decoding at {args.context} tokens while a "
                 f"{args.prompt_len}-token prompt arrives: a chunk of {n} tokens from position "
                 f"{first} (a budget of slots + {n}); blocks of {args.block_size}; the fastest "
                 f"and the median of {args.repeat}+ rounds, side by side", ran_on,
                 where_it_ran())
    names = [f"{args.decodes} decodes alone", f"the {n}-token chunk alone",
             "both, two passes", "both, one pass (ragged)"]
    for name, t in zip(names, timings, strict=True):
        table.row(name, 1e3 * t.best, 1e3 * t.median)
    d, c, _, mixed = timings
    table.note(f"one pass / (decodes alone + chunk alone): {mixed.best / (d.best + c.best):.2f} "
               f"(fastest), {mixed.median / (d.median + c.median):.2f} (median); target <= 0.9")
    tables = [table.show()]
    if args.reads:
        tables.append(reads_table(model, args, ran_on).show())
    if args.markdown:
        write_markdown(args.markdown, tables, argv, script="bench_mixed_step.py",
                       title=f"A step's decodes and prompt chunk: OpenBLAS kernel {blas_kernel()}")
    return 0


READS = [("plain", False, "before: plain attention, blocks gathered"),
         ("plain", True, "after: plain attention, in place (the default)"),
         ("tiled", False, "tiled attention, blocks gathered"),
         ("tiled", True, "tiled attention, blocks in place")]


def reads_table(model, args, ran_on) -> Table:
    """The decode step of --decodes rows at each of --reads contexts, the pool read each of
    the READS ways, side by side (CPU time)."""
    table = Table("Benchmark: the decode step's attention over the paged pool, gathered or in "
                  "place", columns=[("context", ""), ("read", ""), ("min ms", ".1f"),
                                    ("median ms", ".1f"), ("/ before", ".2f")])
    table.header(f"{args.decodes} sequences decoding, each holding `context` tokens in blocks of "
                 f"{args.block_size}: one decode step (forward and head), the same pool and "
                 f"books read {len(READS)} ways; CPU time (time.process_time), the fastest and "
                 f"the median of {args.repeat}+ rounds, side by side", ran_on, where_it_ran())
    for context in args.reads:
        cache, ids = held_pool(model, args.decodes, context, args.block_size, args.seed)
        newest = np.array([[7]] * len(ids))                                  # (B, 1)

        def step(attention, in_place):
            def decode():
                cache.attention, cache.in_place = attention, in_place        # how it is read
                return last_logits(model, newest, cache.view(ids, cache.books.append(ids, 1)))
            return decode

        def undo():
            for s in ids:
                cache.books.trim(s, 1)
        timings = time_together([step(a, i) for a, i, _ in READS], warmup=1,
                                repeat=args.repeat, after=[undo] * len(READS),
                                clock=time.process_time)
        for (_, _, name), t in zip(READS, timings, strict=True):
            table.row(context, name, 1e3 * t.best, 1e3 * t.median, t.best / timings[0].best)
    table.note("/ before: fastest against the fastest of the plain attention over gathered "
               "blocks; the keys and values are random (a step's cost does not depend on them)")
    return table


def held_pool(model, rows, context, block_size, seed) -> tuple:
    """A pool of `rows` sequences of `context` tokens each, counted as written and their keys
    and values random (prefilling 8 x 1,024 tokens would take minutes) -> (cache, ids)."""
    rng = np.random.default_rng(seed)
    cache = PagedCache.allocate(model.config, rows * (context // block_size + 2), block_size)
    for s in range(rows):
        cache.books.add(s, [0] * context, reuse=False)
        cache.books.written([s], cache.books.append([s], context), context)  # length: context
    for pool in cache.k + cache.v:
        pool[...] = to_device(rng.standard_normal(pool.shape, dtype=np.float32))
    return cache, list(range(rows))


def ways(model, cache, ids, p, chunk) -> tuple:
    """The four ways timed (the decodes alone, the chunk (1, n) alone, both in two passes,
    both in one ragged pass) and, for each, what puts the cache back as it was."""
    newest = np.array([[7]] * len(ids))                                      # (B, 1)
    n = chunk.shape[1]

    def decodes():
        return last_logits(model, newest, cache.view(ids, cache.books.append(ids, 1)))

    def alone():
        return forward(model, chunk, cache.view([p], cache.books.append([p], n)))

    def two_passes():
        decodes()
        alone()

    def one_pass():
        starts = cache.books.append(ids, 1) + cache.books.append([p], n)
        view = RaggedView(cache, [(ids, starts[:-1], 1), ([p], starts[-1:], n)])
        tokens = np.concatenate([newest[:, 0], chunk[0]])[None]              # (1, B + n)
        hidden = forward(model, tokens, view)                                 # (1, B + n, D)
        return head(model, hidden[:, :len(ids)])                             # the decodes'

    def undo_decodes():
        for s in ids:
            cache.books.trim(s, 1)

    def undo_chunk():
        cache.books.trim(p, n)

    def undo_both():
        undo_decodes()
        undo_chunk()

    return [decodes, alone, two_passes, one_pass], [undo_decodes, undo_chunk, undo_both,
                                                    undo_both]


if __name__ == "__main__":
    from _common import run
    run(main)
