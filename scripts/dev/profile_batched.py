"""Profile: where a batched decode step's time goes, each part against its own ceiling.

For B = 1, 4, 16, 32 rows of different lengths (row b holds between --context / 2 and --context
tokens, as sequences decoding side by side do), one decode step in the default flat mode
(forward and head, measure.timing.step_with_rollback) is timed side by side with its parts, each
made alone on the step's own shapes:

  products   every weight product of the step: each projection and the head times the B rows,
             by linear, the very calls the step makes. Ceiling: the step's reads at the read
             bandwidth (the faster of a dot product and a matrix-vector product over --buffer-mb)
             or its flops (2 per weight per row) at this kernel's rate on a 1024^3 product,
             timed in the same run, whichever is slower.
  attention  every layer's attention over the cache, as the step calls it (all rows together
             over the longest row's slots, the short rows masked). Ceiling: the keys and values
             each row holds, read once, or its flops (2 for q.k and 2 for p.v per held token,
             head and dimension) at the same rate, whichever is slower.
  in cache   the same products over a slab of each weight small enough to stay in cache between
             calls (under blas.COLD_BYTES; as many weight rows in all, so as many flops): what
             the products would cost were reading the weights free: the kernel's own few-row
             product rate on these shapes, whatever the route (an estimate: the slabs make more
             and smaller calls than the step, each a little dearer per flop).
  the rest   the step less those two: the norms, RoPE, SwiGLU's activation, the cache writes,
             the embedding row, the residual adds and the per-row NumPy work around them. No
             ceiling of its own (its bytes are the activations, a few MB); its share is printed.

The step's ceiling is the sum of the two. The native BLAS kernel is measured in this process,
a second one (--second, default: Haswell under SkylakeX, SkylakeX under Haswell on a CPU with
AVX-512) in a child process with OPENBLAS_CORETYPE set: OpenBLAS fixes its kernel when a process
loads it. BLAS threads fixed (--threads, default 1), the fastest of --repeat rounds and the
median printed, ratios from the fastest. This profiles; it changes nothing in the engine. Models
as bench_decode's (--model qwen|smollm2|PATH, default both). --markdown FILE writes the tables
(docs/benchmarks/batched-profile.md).
"""
import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: _common, _table

from _common import (
    add_threads_argument,
    add_timing_arguments,
    at_least,
    load_model,
    positive_int,
    say,
    timing_header,
)
from _table import Table
from bench_decode import (
    attention_only,
    checkpoint,
    decode_cache,
    product_weights,
    products_only,
    read_steps,
    step_matrices,
    write_markdown,
)

from minitransformer.backend import xp
from minitransformer.kernels import blas
from minitransformer.kernels.tuning import cpu
from minitransformer.linear import linear
from minitransformer.measure.timing import (
    blas_kernel,
    step_with_rollback,
    time_together,
    where_it_ran,
)
from minitransformer.shape import decode_read_bytes

BATCHES = (1, 4, 16, 32)
COLUMNS = [("model", ""), ("B", ""), ("step ms", ".1f"), ("step / ceiling", ".2f"),
           ("products ms", ".1f"), ("products ceiling ms", ".1f"), ("/ ceiling", ".2f"),
           ("attention ms", ".2f"), ("attention ceiling ms", ".3f"), ("/ ceiling", ".1f"),
           ("rest ms", ".1f"), ("rest / step", ".2f"), ("products in cache ms", ".1f"),
           ("in cache / products ceiling", ".2f")]


def row_lengths(batch: int, context: int) -> np.ndarray:
    """Tokens each of `batch` rows holds: spread evenly from context / 2 to context.

    >>> row_lengths(4, 32).tolist(), row_lengths(1, 32).tolist()
    ([16, 21, 26, 32], [32])
    """
    if batch == 1:
        return np.array([context])
    return np.linspace(context // 2, context, batch).astype(np.int64)


def products_in_cache(model, rows):
    """-> a function making the weight products of one decode step of `rows` rows over weights
    that stay in cache: each weight (n, in) replaced by calls over one slab of its first rows
    (a copy in its layout, under blas.COLD_BYTES, shared by the weights of that shape), as
    many calls as cover its n rows (the last over the remainder): the same rows, in-dim and
    flops as products_only, none of its reads from memory."""
    slabs, calls = {}, []
    for w in step_matrices(model):
        n, k = w.shape
        per = max(1, min(n, blas.COLD_BYTES // (k * w.itemsize) - 1))  # weight rows a slab
        x = xp.ones((rows, k), dtype=xp.float32)
        for size in [per] * (n // per) + [n % per] * bool(n % per):
            key = (size, k, blas.layout_on_device(w))
            if key not in slabs:                          # w's first rows, in w's layout
                slabs[key] = w[:size].copy(order="F" if key[2] == "column-major" else "C")
            calls.append((x, slabs[key]))
    return lambda: [linear(x, slab) for x, slab in calls]


def attention_work(config, lengths) -> tuple:
    """What one step's attention must do, over every layer -> (bytes of keys and values each
    row holds, after this step's token; flops: 2 for q.k and 2 for p.v per held token, query
    head and dimension)."""
    held = int((np.asarray(lengths) + 1).sum())                       # tokens over all rows
    L, d = config.num_hidden_layers, config.head_dim
    return (2 * 4 * held * config.num_key_value_heads * d * L,
            4 * held * config.num_attention_heads * d * L)


def profile(args) -> dict:
    """Everything measured under the kernel this process runs -> {"headers", "rows"}."""
    ran_on = timing_header(args)   # BLAS threads fixed first: the loads measure layouts too
    models = []
    for spec in args.model or ["qwen", "smollm2"]:
        path = checkpoint(spec)
        if path is not None:
            models.append((os.path.basename(str(spec)), load_model(path)))
    buffer = args.buffer_mb << 20
    a = xp.ones((1024, 1024), dtype=xp.float32)
    say(f"[{blas_kernel()}] read bandwidth and the kernel's product rate ...")
    dot, matvec, gemm = time_together([*read_steps(buffer), lambda: a @ a], warmup=1,
                                      repeat=args.repeat)
    bandwidth, rate = max(buffer / dot.best, buffer / matvec.best), 2 * 1024 ** 3 / gemm.best
    rows = []
    for spec, model in models:
        c = model.config
        for B in BATCHES:
            say(f"[{blas_kernel()}] {spec}: B = {B}, the step and its parts side by side ...")
            lengths = row_lengths(B, args.context)
            cache, _, token = decode_cache(model, B, args.context, lengths=lengths)
            step, rollback = step_with_rollback(model, cache, token)
            step_t, products_t, attention_t, cached_t = time_together(
                [step, products_only(model, B), attention_only(model, cache, token),
                 products_in_cache(model, B)],
                warmup=1, repeat=args.repeat, after=[rollback, None, None, None])
            products_ceiling = max(decode_read_bytes(c, model.weights) / bandwidth,
                                   2 * B * product_weights(model) / rate)
            kv_bytes, flops = attention_work(c, lengths)
            attention_ceiling = max(kv_bytes / bandwidth, flops / rate)
            rest = step_t.best - products_t.best - attention_t.best
            rows.append([spec, B, step_t.best * 1e3,
                         step_t.best / (products_ceiling + attention_ceiling),
                         products_t.best * 1e3, products_ceiling * 1e3,
                         products_t.best / products_ceiling, attention_t.best * 1e3,
                         attention_ceiling * 1e3, attention_t.best / attention_ceiling,
                         rest * 1e3, rest / step_t.best, cached_t.best * 1e3,
                         cached_t.best / products_ceiling])
    return {"kernel": blas_kernel(), "rows": rows, "headers": [
        ran_on, where_it_ran(),
        f"read bandwidth {bandwidth / 1e9:.2f} GB/s (dot product {buffer / dot.best / 1e9:.2f},"
        f" matrix-vector {buffer / matvec.best / 1e9:.2f}: the faster); product rate "
        f"{rate / 1e9:.1f} GFLOP/s (a 1024^3 product)"]}


def second_kernel(native: str) -> str:
    """The kernel to force beside the native one: Haswell beside SkylakeX, SkylakeX beside
    Haswell where the CPU has AVX-512 (Sandybridge where not), Haswell beside any other."""
    if native == "Haswell":
        return "SkylakeX" if cpu()["avx512"] else "Sandybridge"
    return "Haswell"


def child_profile(kernel, argv) -> dict:
    """This script under OPENBLAS_CORETYPE=kernel, in a child process -> its profile (its
    progress goes to stderr as it comes)."""
    done = subprocess.run([sys.executable, __file__, *map(str, argv), "--child"],
                          stdout=subprocess.PIPE, text=True,
                          env=dict(os.environ, OPENBLAS_CORETYPE=kernel))
    if done.returncode != 0:
        raise ValueError(f"the profile under OPENBLAS_CORETYPE={kernel} failed (exit "
                         f"{done.returncode})")
    return json.loads(done.stdout)


def child_arguments(args) -> list:
    """The command line a child runs the same profile with."""
    return [*(a for m in args.model or [] for a in ("--model", m)), "--context", args.context,
            "--repeat", args.repeat, "--buffer-mb", args.buffer_mb, "--threads", args.threads]


def table(result, forced=None) -> Table:
    t = Table(f"Batched decode step, profiled: OpenBLAS kernel {result['kernel']}"
              + (f" (forced: OPENBLAS_CORETYPE={forced})" if forced else ""), columns=COLUMNS)
    t.header("each part timed alone on the step's shapes, side by side with the step; rows of "
             "different lengths (context / 2 .. context tokens)", *result["headers"])
    for row in result["rows"]:
        t.row(*row)
    t.note("ceilings: products at their reads or their flops (at the 1024^3 rate), whichever "
           "is slower; attention at the keys and values the rows hold or its flops; the step "
           "at their sum; the rest (norms, RoPE, activation, cache writes, residuals) has none; "
           "products in cache: the same products over slabs of the weights that stay in cache "
           "(as many flops, no reads from memory), the nearest this BLAS's products of B rows "
           "come to their ceiling")
    rest = [name for name, _ in COLUMNS].index("rest ms")
    busy = [f"{row[0]} B={row[1]}" for row in result["rows"] if row[rest] < 0]
    if busy:
        t.note(f"rest below 0 ({', '.join(busy)}): the parts' fastest rounds were not the "
               "step's, the machine was too busy for this split; measure again on a quiet one")
    return t


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", action="append", metavar="PATH|qwen|smollm2",
                        help="a checkpoint to profile (repeatable; default: qwen and smollm2)")
    parser.add_argument("--context", type=at_least(2), default=128,
                        help="tokens the longest row holds (default: %(default)s)")
    add_timing_arguments(parser, repeat=5, runs="rounds")
    parser.add_argument("--buffer-mb", type=positive_int, default=1024,
                        help="MiB streamed to measure read bandwidth (default: %(default)s)")
    parser.add_argument("--second", metavar="KERNEL",
                        help="the OpenBLAS kernel forced beside the native one (default: see "
                             "above; 'none': the native kernel only)")
    parser.add_argument("--markdown", metavar="FILE", help="also write the tables as Markdown")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    add_threads_argument(parser)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(profile(args)))
        return 0
    native = profile(args)
    second = args.second or second_kernel(native["kernel"])
    tables = [table(native, forced=os.environ.get("OPENBLAS_CORETYPE")).show()]
    if second.lower() != "none":
        tables.append(table(child_profile(second, child_arguments(args)), forced=second).show())
    if args.markdown:
        write_markdown(args.markdown, tables, argv, title="Batched decode step, profiled",
                       script="profile_batched.py")
    return 0


if __name__ == "__main__":
    from _common import run
    run(main)
