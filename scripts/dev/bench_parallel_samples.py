"""Benchmark: n parallel samples of one prompt (``n: 8``) against n separate requests of it.

One request asking for --n samples is served by the engine (the prompt prefilled once, its
blocks shared by the samples, each block copied only when a sample writes into it), and so are
--n separate requests of the same prompt, seeded seed + i as sample i is, with prefix caching
on (full blocks of a prompt already computed are held, not computed again) and off. All three
in one run, side by side, on fresh engines of --n slots. Printed per way: the KV blocks held
once every prompt is prefilled, at the peak and on average over the steps, prompt tokens
computed in prefill, the wall seconds (fastest and median of --repeat runs), and whether sample
i got the tokens of separate request i (it must: the same seed, the same logits,
batch-invariant decoding).

What to expect: right after prefill the n samples hold the prompt's blocks once; separate
requests with prefix caching hold its full blocks once but each its own partly filled last
block, and without caching n copies of everything. Once decoding starts, every sample copies
the shared last block it writes into, so the peaks of the first two ways meet: what parallel
sampling saves over prefix caching is the prefill (one pass instead of n tails) and the last
block until the first token, not decode memory.
"""
import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: _common, _table

from _common import (
    Progress,
    add_engine_arguments,
    add_model_argument,
    add_threads_argument,
    add_timing_arguments,
    load_model,
    positive_int,
    timing_header,
)
from _table import Table

from minitransformer.measure.timing import time_together
from minitransformer.sampling import SamplingSettings
from minitransformer.serve.config import EngineConfig
from minitransformer.serve.engine import Engine
from minitransformer.serve.records import Request


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_argument(parser)
    parser.add_argument("--n", type=positive_int, default=8, help="samples (default: 8)")
    parser.add_argument("--prompt-len", type=positive_int, default=200,
                        help="prompt tokens (default: 200)")
    parser.add_argument("--new-tokens", type=positive_int, default=32,
                        help="tokens per sample (default: 32)")
    add_engine_arguments(parser, slots=None)
    add_timing_arguments(parser, repeat=3, runs="runs of each way, side by side,")
    add_threads_argument(parser)
    args = parser.parse_args(argv)

    ran_on = timing_header(args)
    model = load_model(args.model)
    if args.prompt_len + args.new_tokens > model.config.max_position_embeddings:
        parser.error(f"--prompt-len + --new-tokens exceed the model's "
                     f"{model.config.max_position_embeddings} positions")
    prompt = tuple(np.random.default_rng(args.seed).integers(
        0, model.config.vocab_size, args.prompt_len).tolist())
    warm = SamplingSettings(do_sample=True, temperature=1.0)
    together = [Request(prompt, args.new_tokens, sampling=warm, seed=args.seed, n=args.n,
                        eos_token_id=[])]
    apart = [Request(prompt, args.new_tokens, sampling=warm, seed=args.seed + i,
                     eos_token_id=[]) for i in range(args.n)]
    ways = [(f"one request, n: {args.n}", together, True),
            (f"{args.n} requests, prefix caching", apart, True),
            (f"{args.n} requests, no caching", apart, False)]

    progress, runs = Progress(len(ways) * (args.repeat + 1), "runs"), {}

    def serve(name, requests, share):
        def once():
            config = EngineConfig(max_num_seqs=args.n, block_size=args.block_size,
                                  enable_prefix_caching=share, batch_invariant=True)
            runs[name] = Engine(model, config, history=True).run(requests)  # its pool stats
            progress(name)
        return once

    timings = time_together([serve(*way) for way in ways], warmup=1, repeat=args.repeat)
    samples_table(ways, runs, timings, args, ran_on).show()
    reference = [r.tokens for r in runs[ways[1][0]].results]
    return 0 if all(r.tokens == ref for name, _, _ in ways
                    for r, ref in zip(runs[name].results, reference, strict=True)) else 1


def samples_table(ways, runs, timings, args, ran_on) -> Table:
    """Blocks held and time per way; tokens compared with the separate cached requests'."""
    table = Table(f"Benchmark: {args.n} parallel samples of one prompt vs {args.n} separate "
                  f"requests of it", columns=[
                      ("", ""), ("blocks after prefill", "d"), ("peak blocks", "d"),
                      ("mean blocks", ".1f"), ("prefill tokens", "d"), ("seconds", ".2f"),
                      ("median s", ".2f"), ("same tokens", "")])
    table.header(f"a {args.prompt_len}-token prompt, {args.new_tokens} new tokens per sample "
                 f"(sampled, temperature 1, seeds {args.seed}..{args.seed + args.n - 1}), "
                 f"blocks of {args.block_size} tokens, {args.n} slots; blocks are counted "
                 f"after each engine step; the fastest and the median of {args.repeat}+ runs "
                 f"of each way, side by side", ran_on)
    reference = [r.tokens for r in runs[ways[1][0]].results]
    held = {}
    for (name, _, _), t in zip(ways, timings, strict=True):
        run = runs[name]
        blocks = [m.blocks_held for m in run.memory]
        held[name] = blocks[0], max(blocks)
        same = sum(r.tokens == ref for r, ref in zip(run.results, reference, strict=True))
        table.row(name, blocks[0], max(blocks), float(np.mean(blocks)),
                  sum(tokens for tokens, _ in run.prefill_times), t.best, t.median,
                  f"{same}/{args.n}")
    (first, peak), (shared_first, shared_peak), (copied_first, copied_peak) = held.values()
    table.note(f"after prefill: {shared_first / first:.1f}x the blocks for separate requests "
               f"with prefix caching, {copied_first / first:.1f}x without; at the peak "
               f"{shared_peak / peak:.1f}x and {copied_peak / peak:.1f}x")
    return table


if __name__ == "__main__":
    from _common import run
    run(main)
