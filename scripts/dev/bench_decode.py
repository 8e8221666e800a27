"""Benchmark: float32 decode against the memory-bandwidth floor, and what batching buys.

Everything is timed side by side in one run (each round calls every step once, so a burst of
load elsewhere hits them alike), with BLAS threads fixed (--threads, default 1); the fastest
and the median of --repeat rounds are printed, ratios are built from the fastest.

  routes     one row times one large float32 matrix (--matrix-mb, Qwen2.5-0.5B's width) by
             every route NumPy offers, the library's own (minitransformer/kernels/blas.py measures
             them
             and takes the fastest for each weight) and others beside them, in GB/s of the
             matrix, against a dot product over the same bytes. Where no route the library
             takes streams at 90% of the dot product, the table says so, and the decode
             table states its target also at the best route's rate (the floor itself stays
             the faster probe).
  floor      a decode step at batch 1 must read every weight once (shape.decode_read_bytes:
             all of them, one embedding row, the tied head in full); floor = those bytes / the
             read bandwidth, the faster of two streaming reads of a 1 GiB buffer timed in the
             same rounds: a BLAS dot product, and a matrix-vector product (the read a decode
             step makes). Target: decode <= 1.25x the floor (SmolLM2: 1.4x).
  batching   one decode step of B = 1 and B = 16 rows over the same cache, in the default flat
             mode (each weight read once for all rows) and the batch-invariant mode (row by
             row, each row's bits as alone). Beside them the ceiling: a 16-row step cannot be
             faster than its reads (the floor) nor than its flops (2 per weight per row) at the
             rate this BLAS kernel reaches on a large product (a 1024^3 one, timed in the same
             rounds); without AVX-512 a 16-row step is compute-bound at one thread. Target:
             flat B = 16 >= 4x the tokens/s of B = 1, or within 10% of the ceiling's gain
             where that is lower. Beside it, in the same rounds, the 16-row step of the same
             model with every weight in the checkpoint's row-major layout (the library before
             kernels/blas.arrange laid each out as its products run fastest): what that buys.
  products   the step's weight products alone (each projection and the head times a vector,
             nothing else), in the same rounds: what BLAS itself reaches on these shapes, so the
             step's distance from the floor splits into BLAS's and the model's own work.
  threads    the step of 1, 8 and 16 rows at one thread and at N (--side-threads, default the
             cores this process may use: kernels/threads.py's setting, switched round by round),
             side by side, beside the read floor at each count (the weights' bytes over the
             buffer streamed by that many threads, one dot product each over its share).
             Targets: the 1-row step at N threads <= 0.6x its 1-thread time, or within 1.25x of
             the N-thread floor; 8 and 16 rows at N threads >= 1.8x the tokens/s at 1. A
             64-token prefill beside them, at N threads not slower than at 1 (within 5%). With
             the CPU time of the process's idle second after them (the pool's workers block).
  shares     where the step of 1 and 8 rows spends its time at 1 and N threads, side by side:
             its products alone, its attention alone, the rest (the step less those: norms,
             RoPE, SiLU, residual adds, cache writes, one thread by construction), its share,
             and the step were the rest split perfectly across the N threads: the most moving
             it into the threads could save; beside them a draw of each row's token
             (sampling.next_token, temperature 0.8, top-p 0.95; the rows side by side on the
             threads, as the engine draws them). Below it, what holding BLAS at one thread
             once per pass saves (threads.one_blas_thread, model.forward).
             --only-threads runs this table and the one before alone.
  reference  with the `reference` extra (torch, transformers) and a checkpoint directory: the
             same decode step in transformers (eager attention, float32, the same threads),
             timed in the same rounds, and the largest logit difference against ours.

Models (--model, repeatable): 'qwen' is a random Qwen2.5-0.5B-shaped checkpoint (bf16 on disk,
about 1 GB, made once in weights/qwen25-05b-random), 'smollm2' the real SmolLM2-135M-Instruct
(fetched and imported on first use where the importer is installed); or a path. Default: both.
This is a benchmark, never a test: its targets are printed, not asserted. Every table says where
it ran (CPU, AVX-512, BLAS library, version, kernel, threads): the figures belong to that
kernel. --markdown FILE also writes the tables as Markdown, headed by the kernel, for
docs/benchmarks/ (docs/benchmarks.md: how to run it under each kernel).
"""
import argparse
import inspect
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: _common, _table

from _common import (
    add_threads_argument,
    add_timing_arguments,
    load_model,
    positive_int,
    say,
    timing_header,
)
from _table import Table

from minitransformer.backend import to_numpy, xp
from minitransformer.checkpoints import real_model
from minitransformer.checkpoints.synth import make_checkpoint, qwen25_05b_config, weights_dir
from minitransformer.kernels import blas, threads
from minitransformer.kvcache import KVCache
from minitransformer.linear import linear
from minitransformer.measure.timing import (
    blas_kernel,
    step_with_rollback,
    time_together,
    where_it_ran,
)
from minitransformer.model import Model, forward, head, prepare
from minitransformer.sampling import SamplingSettings, next_token
from minitransformer.shape import decode_read_bytes

FLOOR_TARGET, BATCH_TARGET, CEILING_SLACK, BATCH = 1.25, 4.0, 1.1, 16
FLOOR_TARGETS = {"smollm2": 1.4}  # 135M weights: the work beside the products weighs more
ROUTE_COLUMNS, NEAR_DOT = 896, 0.9  # the routes' matrix: Qwen2.5-0.5B's width; "near": 90%
ROUTE_ROUNDS = 4                    # the routes are timed in 4 x --repeat rounds
THREADS_ROWS = (1, 8, 16)            # the steps timed at 1 and N threads
ONE_ROW_TARGET, STREAMS_TARGET = 0.6, 1.8  # N threads: 1 row <= 0.6x the time; 8, 16 >= 1.8x
PREFILL_TOKENS = 64                  # the prompt of the threads table's prefill
NO_SLOWER = 1.05                     # a prefill at N threads "not slower": within 5% of at 1
SHARE_ROWS = (1, 8)                  # the steps whose time is taken apart at 1 and N threads
SAMPLED = SamplingSettings(do_sample=True, temperature=0.8, top_p=0.95)  # the sampling timed


def checkpoint(spec):
    """--model value -> a checkpoint path (real_model.checkpoint's, or 'qwen': a random
    Qwen2.5-0.5B-shaped one), or None (with a note) when SmolLM2 cannot be fetched: its rows
    are left out, the others still mean something."""
    if spec == "qwen":
        path = weights_dir() / "qwen25-05b-random"
        if not (path / "model.safetensors").is_file():
            say(f"writing a random Qwen2.5-0.5B-shaped checkpoint to {path} (once) ...")
            make_checkpoint(path, qwen25_05b_config(), seed=0, dtype="bfloat16")
        return path
    if spec == "smollm2":
        try:
            return real_model.smollm2()
        except real_model.FetchError as e:
            say(f"note: SmolLM2-135M-Instruct unavailable ({e}); its rows are left out")
            return None
    return real_model.checkpoint(spec, say)


def read_steps(nbytes=1 << 30):
    """Two functions that stream a buffer of nbytes float32 once each -> (dot, matvec)."""
    a = xp.ones(nbytes // 4, dtype=xp.float32)
    rows = a.reshape(-1, 1024)                                   # (nbytes / 4096, 1024)
    x = xp.ones(1024, dtype=xp.float32)
    return (lambda: xp.dot(a, a)), (lambda: rows @ x)           # a . a reads a once


def product_routes(nbytes, cols=ROUTE_COLUMNS):
    """One float32 matrix W (N, cols) of about nbytes and one row x -> [(product, the library's
    route or "", function)]: the dot-product probe over W's bytes first, then every route one row
    can multiply W, the library's own (blas.py, on this very W) and others beside them."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((max(1, nbytes // (4 * cols)), cols), dtype=np.float32)  # (N, K)
    x, out = rng.standard_normal((1, cols), dtype=np.float32), np.empty((1, len(w)), np.float32)
    wt, two = np.ascontiguousarray(w.T), np.ones((cols, 2), np.float32)  # (K, N), (K, 2)
    flat, block = w.reshape(-1), blas.slice_rows(1, cols)

    def blocks(rows):
        for r0 in range(0, len(w), rows):
            np.matmul(w[r0:r0 + rows], x[0], out=out[0, r0:r0 + rows])
    return [("dot product over the same bytes (the probe)", "", lambda: np.dot(flat, flat)),
            ("W @ x, W (N, K) row-major: the matrix-vector product", "flat",
             lambda: blas.flat(x, w, out)),
            ("x @ W.T", "", lambda: x @ w.T),
            (f"row blocks of {block}, x @ block.T", "slices", lambda: blas.slices(x, w, out)),
            ("row blocks of 512, block @ x", "", lambda: blocks(512)),
            ("one dot product per row of W", "dots", lambda: blas.dots(x, w, out)),
            ("x @ Wt, Wt (K, N) row-major: a second layout, timed here only", "",
             lambda: x @ wt),
            ("W @ X, X two columns", "", lambda: w @ two)], (x, w)


def routes_table(args, ran_on):
    """The table of one-row product routes -> (Table, the best library route's GB/s, the dot
    product's GB/s). Timed side by side, like everything here."""
    routes, (x, w) = product_routes(args.matrix_mb << 20)
    chosen = blas.route_for(x, w)        # measured here as for any weight (or MT_PRODUCTS)
    repeat = ROUTE_ROUNDS * args.repeat                  # each round is milliseconds: many
    timings = time_together([fn for _, _, fn in routes], warmup=1, repeat=repeat)
    rates = [w.nbytes / t.best for t in timings]
    dot = rates[0]
    table = Table("Product routes: one row times one large float32 matrix",
                  columns=[("product", ""), ("library route", ""), ("GB/s", ".1f"),
                           ("median GB/s", ".1f"), ("/ dot product", ".2f")])
    table.header(f"W ({len(w)}, {w.shape[1]}) float32, {w.nbytes / 1e6:.0f} MB; GB/s: W's bytes "
                 f"/ the fastest of {repeat}+ rounds after 1 warm-up, side by side", *ran_on)
    for (name, route, _), rate, t in zip(routes, rates, timings, strict=True):
        table.row(name, route, rate / 1e9, w.nbytes / t.median / 1e9, rate / dot)
    library = {route: rate for (_, route, _), rate in zip(routes, rates, strict=True) if route}
    best = max(library, key=library.get)
    fastest = max(range(1, len(routes)), key=rates.__getitem__)
    pinned = " (pinned by MT_PRODUCTS)" if blas.FIXED else ", measured on this W"
    table.note(f"blas.py takes {chosen} for one row of this shape{pinned}; its routes: "
               f"{', '.join(blas.ONE_ROW)}",
               f"fastest of all: {routes[fastest][0]} ({rates[fastest] / dot:.2f} of the dot "
               f"product); best library route: {best}, {library[best] / 1e9:.1f} GB/s "
               f"({library[best] / dot:.2f})")
    if library[best] < NEAR_DOT * dot:
        table.note(f"no route the library takes streams at {NEAR_DOT:.0%} of the dot product "
                   f"here ({library[best] / 1e9:.1f} against {dot / 1e9:.1f} GB/s): the "
                   "decode target is also given at the best route's rate")
    return table, library[best], dot


def step_matrices(model) -> list:
    """The weight matrices one decode step multiplies, in its order: every layer's
    projections, then the head."""
    c = model.config
    head = model.weights["model.embed_tokens.weight" if c.tie_word_embeddings else
                         "lm_head.weight"]
    return [w for layer in model.layers for w in (layer.qkv, layer.o, layer.gate_up,
                                                   layer.down)] + [head]


def products_only(model, rows=1):
    """-> a function making the weight products of one decode step of `rows` rows (every
    projection and the head times a (rows, in) matrix, as linear makes them), nothing else."""
    matrices = step_matrices(model)
    vectors = [xp.ones((rows, w.shape[1]), dtype=xp.float32) for w in matrices]
    return lambda: [linear(x, w) for x, w in zip(vectors, matrices, strict=True)]


def product_weights(model) -> int:
    """Weights a float decode step multiplies per row: every projection and the head."""
    return sum(int(w.shape[0]) * int(w.shape[1]) for w in step_matrices(model))


def decode_steps(model, batch, context, seed=0, batch_invariant=False):
    """A cache of `batch` rows holding the same `context` random tokens (one prefill, copied)
    -> (step() -> logits (B, 1, V), its rollback (measure.timing.step_with_rollback), the
    prompt and the token). The same seed gives the same cache."""
    cache, prompt, token = decode_cache(model, batch, context, seed)
    return (*step_with_rollback(model, cache, token, batch_invariant), prompt, token[:1])


def decode_cache(model, batch, context, seed=0, lengths=None):
    """A cache of `batch` rows holding the same `context` random tokens (one prefill, copied),
    or row b only the first lengths[b] of them -> (cache, the prompt (1, context), the next
    token of every row (B, 1))."""
    c = model.config
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, c.vocab_size, (1, context))
    one = KVCache.allocate(c, 1, context + 1)
    forward(model, prompt, one)                                                 # prefill
    cache = KVCache.allocate(c, batch, context + 1)
    for layer in range(c.num_hidden_layers):
        cache.k[layer][:], cache.v[layer][:] = one.k[layer][0], one.v[layer][0]
    cache.lengths[:] = context if lengths is None else lengths
    return cache, prompt, np.full((batch, 1), int(rng.integers(0, c.vocab_size)))


def transformers_step(path, prompt, token, threads):
    """The same decode step in transformers (its own prefill of the same prompt) -> (step ->
    logits (V,), rollback), or None without the reference extra or a checkpoint directory."""
    try:
        import torch
        from transformers import AutoModelForCausalLM
    except ImportError:
        return None
    if not (Path(path) / "config.json").is_file():
        return None
    torch.set_num_threads(max(threads, 1))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                              attn_implementation="eager").eval()
    # transformers 5 renamed past_key_values to cache; crop(-1) drops one token in both
    name = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
    with torch.no_grad():
        cache = getattr(hf(torch.from_numpy(prompt), use_cache=True), name)
    ids = torch.from_numpy(token)

    @torch.no_grad()
    def step():
        return hf(ids, use_cache=True, **{name: cache}).logits[0, -1].numpy()
    return step, lambda: cache.crop(-1)


def parser_of() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", action="append", metavar="PATH|qwen|smollm2",
                        help="a checkpoint to benchmark (repeatable; default: qwen and smollm2)")
    parser.add_argument("--context", type=positive_int, default=32, help="tokens cached per row")
    add_timing_arguments(parser, repeat=5, runs="rounds")
    parser.add_argument("--buffer-mb", type=positive_int, default=1024,
                        help="MiB streamed to measure read bandwidth; keep it far above the "
                             "caches (default: %(default)s)")
    parser.add_argument("--matrix-mb", type=positive_int, default=139,
                        help="MiB of the float32 matrix the one-row product routes are timed "
                             "over; keep it far above the caches (default: %(default)s)")
    parser.add_argument("--no-quant", action="store_true",
                        help="skip the quantized steps and speculative decoding")
    parser.add_argument("--no-reference", action="store_true",
                        help="skip transformers even when it is installed")
    parser.add_argument("--markdown", metavar="FILE",
                        help="also write the tables as Markdown to FILE, headed by the BLAS "
                             "kernel (e.g. docs/benchmarks/decode-SkylakeX.md)")
    parser.add_argument("--side-threads", type=positive_int, default=None, metavar="N",
                        help="the threads table's N, timed beside 1 thread (default: the cores "
                             "this process may use)")
    parser.add_argument("--only-threads", action="store_true",
                        help="run the threads table alone")
    add_threads_argument(parser)
    return parser


def main(argv=None):
    parser = parser_of()
    args = parser.parse_args(argv)
    ran_on = (timing_header(args), where_it_ran())
    models = []  # (label, path, model)
    for spec in args.model or ["qwen", "smollm2"]:
        path = checkpoint(spec)
        if path is not None:
            models.append((Path(spec).name, path, load_model(path)))
    if not models:
        parser.error("no model to benchmark")

    if args.only_threads:
        say("[1/2] the step and a prefill at 1 and N threads, side by side ...")
        tables = [threads_table(models, args, ran_on).show()]
        say("[2/2] where a step's time goes at 1 and N threads, side by side ...")
        tables.append(shares_table(models, args, ran_on).show())
        if args.markdown:
            write_markdown(args.markdown, tables, argv,
                           f"Decode on 1 and N threads: OpenBLAS kernel {blas_kernel()}")
        return
    say("[1/3] one-row product routes over one large matrix, side by side ...")
    routes, best_route, dot_route = routes_table(args, ran_on)
    tables = [routes.show()]  # every table shown, for --markdown
    say("[2/3] read bandwidth and decode at batch 1, side by side ...")
    floor, bandwidth = floor_table(models, args, ran_on, best_route, dot_route)
    tables.append(floor.show())
    say(f"[3/3] batch 1 against batch {BATCH}, flat and row by row, side by side ...")
    tables.append(batching_table(models, args, ran_on, bandwidth).show())
    say("[+] the step and a prefill at 1 and N threads, side by side ...")
    tables.append(threads_table(models, args, ran_on).show())
    say("[+] where a step's time goes at 1 and N threads, side by side ...")
    tables.append(shares_table(models, args, ran_on).show())
    if not args.no_quant:
        quantized_tables(models, args, ran_on, tables)
    if args.markdown:
        write_markdown(args.markdown, tables, argv)


def floor_timings(models, args):
    """The two read probes, then per model its products alone and its decode step (and
    transformers' beside them), side by side -> (timings, {spec: (index of our step, of
    transformers' or None)}, {spec: largest |logit difference| against transformers})."""
    buffer = args.buffer_mb << 20
    fns, after = list(read_steps(buffer)), [None, None]
    where, differences = {}, {}
    for spec, path, model in models:
        step, rollback, prompt, token = decode_steps(model, 1, args.context)
        fns += [products_only(model), step]
        after += [None, rollback]
        where[spec] = (len(fns) - 1, None)
        ref = None if args.no_reference else transformers_step(path, prompt, token, args.threads)
        if ref is not None:
            ours, theirs = step()[0, -1], ref[0]()
            rollback(), ref[1]()
            differences[spec] = float(np.abs(ours - theirs).max())
            fns.append(ref[0]), after.append(ref[1])
            where[spec] = (len(fns) - 2, len(fns) - 1)
    return time_together(fns, warmup=1, repeat=args.repeat, after=after), where, differences


def floor_table(models, args, ran_on, best_route, dot_route) -> tuple:
    """Decode at batch 1 against the memory-bandwidth floor -> (Table, the read bandwidth)."""
    timings, where, differences = floor_timings(models, args)
    dot, matvec = ((args.buffer_mb << 20) / t.best for t in timings[:2])
    bandwidth = max(dot, matvec)
    table = Table("Decode benchmark: float32, batch 1, against the memory-bandwidth floor",
                  columns=[("model", ""), ("GB read/step", ".3f"), ("floor ms", ".1f"),
                           ("products ms", ".1f"), ("/ floor", ".2f"),
                           ("step ms", ".1f"), ("med ms", ".1f"), ("/ floor", ".2f"),
                           ("med / floor", ".2f"), ("target", ""), ("transformers ms", ""),
                           ("ours / theirs", "")])
    table.header(f"time: fastest and median of {args.repeat}+ rounds after 1 warm-up, side by "
                 f"side; {args.context} tokens cached", *ran_on,
                 f"read bandwidth {bandwidth / 1e9:.2f} GB/s (dot product {dot / 1e9:.2f}, "
                 f"matrix-vector {matvec / 1e9:.2f}: the faster sets the floor)")
    at_best_route = []  # where no route nears the dot product: the floor at the best route's rate
    for spec, path, model in models:
        ours, ref = (None if i is None else timings[i] for i in where[spec])
        products = timings[where[spec][0] - 1]
        read = decode_read_bytes(model.config, model.weights)
        floor = read / bandwidth
        theirs = ("n/a", "n/a") if ref is None else \
            (f"{ref.best * 1e3:.1f}", f"{ours.best / ref.best:.2f}")
        target = FLOOR_TARGETS.get(spec, FLOOR_TARGET)
        table.row(spec, read / 1e9, floor * 1e3, products.best * 1e3, products.best / floor,
                  ours.best * 1e3, ours.median * 1e3, ours.best / floor, ours.median / floor,
                  f"<= {target}x", *theirs)
        if best_route < NEAR_DOT * dot_route:
            at_best_route.append(f"{spec}: at the best route's rate ({best_route / 1e9:.1f} GB/s"
                                 f") the floor is {read / best_route * 1e3:.1f} ms; the step "
                                 f"is {ours.best * best_route / read:.2f}x it (target "
                                 f"<= {target}x)")
    table.note(f"target: step <= {FLOOR_TARGET}x the floor ("
               + ", ".join(f"{spec} {t}x" for spec, t in FLOOR_TARGETS.items()) + ")",
               *at_best_route,
               "products: the step's weight products alone (every projection and the head "
               "times one vector): BLAS's own distance from the floor on these shapes",
               *(f"{spec}: largest |logit difference| against transformers {d:.1e}"
                 for spec, d in differences.items()))
    return table, bandwidth


def batching_table(models, args, ran_on, bandwidth) -> Table:
    """One decode step of 1 and BATCH rows, flat and row by row, against the ceiling."""
    batching = Table(f"Batching: one decode step of 1 and {BATCH} rows",
                     columns=[("model", ""), ("B=1 ms", ".1f"), (f"B={BATCH} flat ms", ".1f"),
                              ("flat gain", ".2f"), ("ceiling ms", ".1f"),
                              ("ceiling gain", ".2f"), ("target gain", ".2f"),
                              (f"B={BATCH} row by row ms", ".1f"), ("row-by-row gain", ".2f"),
                              ("rows as alone", ""), (f"B={BATCH} / ceiling", ".2f"),
                              (f"B={BATCH} row-major ms", ".1f"), ("row-major / ceiling", ".2f")])
    a = xp.ones((1024, 1024), dtype=xp.float32)
    for spec, path, model in models:
        one, one_back = decode_steps(model, 1, args.context)[:2]
        step, rollback = decode_steps(model, BATCH, args.context)[:2]
        exact, exact_back = decode_steps(model, BATCH, args.context, batch_invariant=True)[:2]
        before, before_back = decode_steps(checkpoint_layout(model), BATCH, args.context)[:2]
        t1, flat, rows, gemm, old = time_together(
            [one, step, exact, lambda: a @ a, before], warmup=1, repeat=args.repeat,
            after=[one_back, rollback, exact_back, None, before_back])
        alone, rows_alone = one(), exact()
        one_back(), exact_back()
        same = bool((rows_alone == alone).all())  # every row of the invariant step: B = 1's bits
        rate = 2 * 1024 ** 3 / gemm.best                                # flop/s of this kernel
        ceiling = max(2 * BATCH * product_weights(model) / rate,        # flops at that rate
                      decode_read_bytes(model.config, model.weights) / bandwidth)  # or reads
        gain_ceiling = BATCH * t1.best / ceiling
        batching.row(spec, t1.best * 1e3, flat.best * 1e3, BATCH * t1.best / flat.best,
                     ceiling * 1e3, gain_ceiling, min(BATCH_TARGET, gain_ceiling / CEILING_SLACK),
                     rows.best * 1e3, BATCH * t1.best / rows.best,
                     "bit for bit" if same else "NO: bits differ", flat.best / ceiling,
                     old.best * 1e3, old.best / ceiling)
    batching.header(f"gain = tokens/s at B={BATCH} / tokens/s at B=1; flat: one (B, D) matrix "
                    "per projection (the default); row by row: batch_invariant=True",
                    f"ceiling: the {BATCH}-row step at its floor, or at its flops (2 per weight "
                    f"per row) at {rate / 1e9:.1f} GFLOP/s, this kernel's rate on a 1024^3 "
                    "product, whichever is slower", *ran_on)
    batching.note(f"target: flat gain >= {BATCH_TARGET}, or >= the ceiling gain / "
                  f"{CEILING_SLACK} (within 10% of the ceiling) where that is lower")
    return batching


def at_threads(n, fn):
    """fn run with threads.py's setting at n (its pool and BLAS's own threads)."""
    def timed():
        with threads.using(n):
            return fn()
    return timed


def read_at(buffer, n):
    """buffer streamed once by n threads, one dot product each over its share (BLAS at one
    thread in each): the read a step split n ways makes at best."""
    parts = np.array_split(buffer, n)
    return at_threads(n, lambda: threads.run([lambda p=p: np.dot(p, p) for p in parts]))


def threads_table(models, args, ran_on) -> Table:
    """The step of THREADS_ROWS rows at 1 and N threads, beside the read floor at each."""
    N = args.side_threads or threads.default_count()
    buffer = np.ones((args.buffer_mb << 20) // 4, np.float32)
    fns, after, rows = [read_at(buffer, 1), read_at(buffer, N)], [None, None], []
    for spec, path, model in models:
        for B in THREADS_ROWS:
            step, rollback = decode_steps(model, B, args.context)[:2]
            fns += [at_threads(1, step), at_threads(N, step)]
            after += [rollback, rollback]
            rows.append((spec, f"decode, {B} row{'s' if B > 1 else ''}", B,
                         decode_read_bytes(model.config, model.weights)))
        fns += [at_threads(1, prefill(model)), at_threads(N, prefill(model))]
        after += [None, None]
        rows.append((spec, f"prefill, {PREFILL_TOKENS} tokens", 0, None))
    timings = time_together(fns, warmup=1, repeat=args.repeat, after=after)
    before = time.process_time()
    time.sleep(1.0)                                   # the pools of 1 and N threads idle
    idle = time.process_time() - before
    read_1, read_n = ((args.buffer_mb << 20) / t.best for t in timings[:2])
    table = Table(f"Threads: the decode step and a prefill at 1 and {N} threads, side by side",
                  columns=[("model", ""), ("pass", ""), ("1 thread ms", ".1f"),
                           ("med ms", ".1f"), (f"{N} threads ms", ".1f"), ("med ms", ".1f"),
                           (f"{N} / 1", ".2f"), ("med / med", ".2f"),
                           (f"{N}-thread floor ms", ".1f"), (f"/ {N}-thread floor", ".2f"),
                           ("target", ""), ("met", "")])
    table.header(f"time: fastest and median of {args.repeat}+ rounds after 1 warm-up, the two "
                 f"counts switched round by round (kernels/threads.py's setting: its pool and "
                 f"BLAS's own threads); {args.context} tokens cached per row", *ran_on,
                 f"read floor: {args.buffer_mb} MiB streamed at {read_1 / 1e9:.2f} GB/s by 1 "
                 f"thread, {read_n / 1e9:.2f} GB/s by {N} ({read_1 / read_n:.2f}x the time)")
    for (spec, name, B, read), one, many in zip(rows, timings[2::2], timings[3::2], strict=True):
        floor = None if read is None else read / read_n
        ratio = many.best / one.best
        if B == 0:                                        # the prefill: never slower at N
            target = f"not slower (<= {NO_SLOWER}x)"
            met = ratio <= NO_SLOWER
        elif B == 1:
            target = f"<= {ONE_ROW_TARGET}x, or <= {FLOOR_TARGET}x the floor"
            met = ratio <= ONE_ROW_TARGET or many.best <= FLOOR_TARGET * floor
        else:
            target = f"tokens/s >= {STREAMS_TARGET}x"
            met = one.best / many.best >= STREAMS_TARGET
        table.row(spec, name, one.best * 1e3, one.median * 1e3, many.best * 1e3,
                  many.median * 1e3, ratio, many.median / one.median,
                  None if floor is None else floor * 1e3,
                  None if floor is None else many.best / floor, target, "yes" if met else "no")
    table.note(f"{N}-thread floor: the step's bytes (shape.decode_read_bytes) at the {N}-thread "
               "read rate; the products of a step split across the threads only where "
               "measured faster (kernels/blas.py: parts), so a no here is the measured choice "
               "of one thread",
               f"idle: {idle:.3f} s of CPU in the 1 s after, the pools' workers waiting")
    return table


def prefill(model, tokens=PREFILL_TOKENS, seed=0):
    """-> a function prefilling a fresh cache with the same `tokens` random tokens and taking
    the last position's logits: a prompt's pass, products of many rows and attention over them."""
    c = model.config
    prompt = np.random.default_rng(seed).integers(0, c.vocab_size, (1, tokens))

    def run():
        cache = KVCache.allocate(c, 1, tokens)
        return to_numpy(head(model, forward(model, prompt, cache)[:, -1:]))     # (1, 1, V)
    return run


def attention_only(model, cache, token):
    """-> a function making every layer's attention of the step on this cache, nothing else:
    a random query per row and head over the keys and values the cache holds (the step's
    own shapes and mask, from model.prepare)."""
    c = model.config
    batch = prepare(model, token, cache)
    S = batch.slots[-1]                                  # the longest row, after the step
    rng = np.random.default_rng(0)
    q = xp.asarray(rng.standard_normal((len(token), 1, c.num_attention_heads, c.head_dim),
                                       dtype=np.float32))                       # (B, 1, H, d)
    held = [(cache.k[i][:, :, :S], cache.v[i][:, :, :S]) for i in range(c.num_hidden_layers)]
    return lambda: [batch.attend(q, k, v, batch.visible) for k, v in held]


def sampling_only(model, B, seed=0):
    """-> a function drawing a token for each of B rows from random logits (V,) each, by
    SAMPLED (the penalty, the softmax, top-p's sort and the draw: sampling.next_token), each
    row by its own generator, the rows side by side on the threads where measured faster, as
    the engine draws them (threads.map_in_parts)."""
    rng = np.random.default_rng(seed)
    rows = [(z, np.random.default_rng([seed, b])) for b, z in
            enumerate(rng.standard_normal((B, model.config.vocab_size), dtype=np.float32))]
    return lambda: threads.map_in_parts(lambda row: next_token(row[0], [], SAMPLED, row[1]),
                                        rows, ("draws", True))


def shares_table(models, args, ran_on) -> Table:
    """Where a decode step's time goes at 1 and N threads, side by side: the step, its
    products alone, its attention alone, the rest (the step less those two: the norms, RoPE,
    SiLU, the residual adds, the cache writes), with what the step would take were the rest
    split perfectly across the N threads; and the draw of each row's token beside it (the
    rows side by side on the threads, as the engine draws them)."""
    N = args.side_threads or threads.default_count()
    fns, after, rows = [], [], []
    for spec, _, model in models:
        for B in SHARE_ROWS:
            cache, _, token = decode_cache(model, B, args.context)
            step, rollback = step_with_rollback(model, cache, token)
            parts = [step, products_only(model, B), attention_only(model, cache, token),
                     sampling_only(model, B)]
            for n in (1, N):
                fns += [at_threads(n, fn) for fn in parts]
                after += [rollback, None, None, None]
                rows.append((spec, B, n))
    timings = time_together(fns, warmup=1, repeat=args.repeat, after=after)
    table = Table(f"Threads: where a decode step's time goes at 1 and {N} threads",
                  columns=[("model", ""), ("rows", "d"), ("threads", "d"), ("step ms", ".2f"),
                           ("products ms", ".2f"), ("attention ms", ".2f"),
                           ("the rest ms", ".2f"), ("rest share", ".0%"),
                           ("rest split ms", ".2f"), ("split / step", ".2f"),
                           ("draw ms", ".2f"), ("draw share", ".0%")])
    table.header(f"time: fastest of {args.repeat}+ rounds after 1 warm-up, all side by side; "
                 f"{args.context} tokens cached per row; step: forward and head "
                 "(measure.timing.step_with_rollback); products: the step's weight products "
                 "alone; attention: every layer's, alone; the rest: the step less those two; "
                 "draw: sampling.next_token at temperature 0.8, top-p 0.95, for each row "
                 "(its share: of the step and the draw)", *ran_on)
    for (spec, B, n), i in zip(rows, range(0, len(fns), 4), strict=True):
        step, products, attention, sampled = (t.best for t in timings[i:i + 4])
        rest = max(step - products - attention, 0.0)
        split = step - rest * (1 - 1 / n)                       # the rest in 1/n of its time
        table.row(spec, B, n, step * 1e3, products * 1e3, attention * 1e3, rest * 1e3,
                  rest / step, split * 1e3, split / step, sampled * 1e3,
                  sampled / (step + sampled))
    table.note(f"rest split: the step, were the rest split perfectly across the threads (1/{N} "
               "of its time): 'split / step' is the most that moving it into the threads could "
               "save (it is many small NumPy calls on a few rows, each dispatched holding the "
               "interpreter's lock)", holds_line(models[0][2], N))
    return table


def holds_line(model, N) -> str:
    """What holding BLAS at one thread once per pass saves (threads.one_blas_thread, held by
    model.forward): the holds a 1-row step makes inside its pass's, each timed nested and on
    its own (BLAS's count got and set), side by side at N threads."""
    cache, _, token = decode_cache(model, 1, 8)
    step, rollback = step_with_rollback(model, cache, token)
    made, hold = {True: 0, False: 0}, threads.one_blas_thread   # nested: one open already

    def counted():
        made[threads.depth() > 0] += 1
        return hold()
    threads.one_blas_thread = counted
    try:
        step()
    finally:
        threads.one_blas_thread = hold
        rollback()

    def holds(n=1000):
        for _ in range(n):
            with hold():
                pass

    def nested():
        with hold():
            holds()
    own, inner = time_together([at_threads(N, holds), at_threads(N, nested)], warmup=1,
                               repeat=5)
    saved = made[True] * (own.best - inner.best) / 1000
    return (f"BLAS held once per pass: a 1-row step makes {made[True]} holds inside its pass's "
            f"own ({made[False]} not: the pass's, the head's), {inner.best * 1e3:.2f} us each "
            f"against {own.best * 1e3:.2f} us on its own (BLAS's count got and set, at {N} "
            f"threads): {saved * 1e3:.2f} ms a step saved")


def checkpoint_layout(model):
    """The same model with every weight in the checkpoint's row-major layout, as the library
    held them before blas.arrange measured layouts (MT_LAYOUT=row-major, for this model)."""
    keep, blas.FIXED_LAYOUT = blas.FIXED_LAYOUT, "row-major"
    try:
        return Model(model.config, dict(model.weights), model.tokenizer, model.eos_token_ids)
    finally:
        blas.FIXED_LAYOUT = keep


def write_markdown(path, tables, argv, title=None, script="bench_decode.py"):
    """The tables as Markdown, headed by the title (default: the kernel's) and the command
    that made them."""
    forced = [f"OPENBLAS_CORETYPE={os.environ['OPENBLAS_CORETYPE']}"] \
        if os.environ.get("OPENBLAS_CORETYPE") else []       # a kernel forced for this run
    command = " ".join([*forced, f"python3 scripts/dev/{script}",
                        *(sys.argv[1:] if argv is None else map(str, argv))])
    title = title or f"Decode benchmark: OpenBLAS kernel {blas_kernel()}"
    text = "\n".join([f"# {title}", "",
                      f"Written by `{command}`; every figure below is the script's own.", "",
                      *(t.markdown() for t in tables)])
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(text)
    say(f"wrote {path}")



# ----------------------------------------------------- quantized steps and speculative decoding
QUANT_SCHEMES = {"int8-row": 1.1, "int4-g128": 1.5, "nf4": 2.0}   # scheme -> target vs fp32
QUANT_BATCHES = (1, 4)


def quantized_tables(models, args, ran_on, tables):
    """Each scheme's decode step against the fp32 step, resident bytes beside; prompt lookup
    against plain greedy on the rewrite task. Side by side."""
    from quant.qmodel import SCHEMES, quantize_model, resident_bytes
    say("[+] quantized decode steps against fp32, side by side ...")
    quant = Table("Quantized decode: each scheme's step over the fp32 step",
                  columns=[("model", ""), ("weights", ""), ("resident MB", ".1f")] +
                  [(f"B={b} {k}", ".2f") for b in QUANT_BATCHES for k in ("best", "med")] +
                  [("target", "")])
    quant.header("the projections run on their codes (quant/matmul.py: a block of rows at a "
                 "time); embedding and head stay fp32", *ran_on)
    for spec, path, model in models:
        variants = {"fp32": model} | {SCHEMES[s].label: quantize_model(model, s)
                                      for s in QUANT_SCHEMES}
        ratios = {label: [] for label in variants}
        for batch in QUANT_BATCHES:
            steps = [decode_steps(m, batch, args.context)[:2] for m in variants.values()]
            times = time_together([s for s, _ in steps], warmup=1, repeat=args.repeat,
                                  after=[r for _, r in steps])
            for label, t in zip(variants, times, strict=True):
                ratios[label] += [t.best / times[0].best, t.median / times[0].median]
        targets = [None] + [f"<= {x}x" for x in QUANT_SCHEMES.values()]
        for (label, m), target in zip(variants.items(), targets, strict=True):
            quant.row(spec, label, sum(resident_bytes(m).values()) / 1e6, *ratios[label],
                      target or "")
    tables.append(quant.show())

    say("[+] speculative decoding with prompt lookup against plain greedy ...")
    spec_table = Table("Speculative decoding: prompt lookup on a rewrite task, greedy",
                       columns=[("model", ""), ("gamma", ""), ("v(gamma)", ".2f"),
                                ("tokens/pass", ".2f"), ("predicted", ".2f"),
                                ("speedup", ".2f"), ("median", ".2f"), ("same tokens", "")])
    spec_table.header("gamma: the best predicted from the measured cost v of verifying "
                      "(minitransformer.measure.timing.verification_costs); speedup over plain "
                      "greedy, side by side", *ran_on)
    for spec, path, model in models:
        row = speculative_row(model, repeat=max(2, args.repeat // 2))
        if row is not None:
            spec_table.row(spec, *row)
    spec_table.note("target: speedup >= 1.5x, tokens identical to plain greedy")
    tables.append(spec_table.show())


def speculative_row(model, new_tokens=48, largest=8, repeat=3):
    """Prompt lookup at its best predicted gamma against plain greedy -> a table row, or None
    for a model without a tokenizer (no text to rewrite)."""
    import minitransformer as mt
    from minitransformer.lookup import PromptLookup, rewrite_prompt
    from minitransformer.measure.timing import verification_costs
    from minitransformer.speculative import speculative_generate
    from sim.speculative import best_lookup_gamma
    if model.tokenizer is None:
        return None
    ids = rewrite_prompt(model)
    plain = mt.generate(model, ids, new_tokens, eos_token_id=[])
    v = verification_costs(model, ids + plain, largest, repeat)
    lookup = PromptLookup()
    gamma, _, predicted = best_lookup_gamma(ids + plain, len(ids), v, lookup)
    runs = {}
    t_plain, t_spec = time_together(
        [lambda: mt.generate(model, ids, new_tokens, eos_token_id=[]),
         lambda: runs.update(r=speculative_generate(model, lookup, ids, new_tokens,
                                                    gamma=gamma, eos_token_id=[]))],
        warmup=0, repeat=repeat)
    r = runs["r"]
    return (gamma, v[gamma], r.tokens_per_pass, predicted, t_plain.best / t_spec.best,
            t_plain.median / t_spec.median, "yes" if r.tokens == plain else "NO")


if __name__ == "__main__":
    from _common import run
    run(main)
