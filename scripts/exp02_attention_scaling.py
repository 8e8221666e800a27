"""Experiment 2: one attention head, one generation step computed both ways, for n = 256 ... 4,096.

The transformer is stripped away: given the queries, keys and values of n positions (one head,
d = the model's head_dim, 64 for the default model and Qwen2.5-0.5B), produce the output of the
newest position, which is what one generation step needs.
- recompute: attend all n queries over all n keys, an n x n score matrix, and keep the last row;
- cached:    the n keys and values are already held, so attend one query: a 1 x n row.
Both go through the model's own ``attention`` function, and their outputs for the last position
are compared. The chapter: at 4,096 tokens, 67 MB of scores against 16 KB (fp32).

Columns: the median time of a step; the bytes of the score matrix (its shape times 4 bytes,
exact); and the peak bytes the allocator held during one step, measured, which is larger than
the score matrix because the mask, the masked scores and softmax's temporaries are all of its
shape. The q/k/v projections are left out: this is the attention alone.

A third way, tiled: the recompute step through ``tiled_attention`` (minitransformer/tiled.py),
which computes the same n x n attention one 64 x 64 tile of scores at a time (FlashAttention's
idea), its causal mask made a tile at a time too: the largest block of scores it holds, and its
measured peak (one call: q, k, v and the output are its floor).
"""
import argparse

import numpy as np

from _common import (
    Progress,
    add_lengths_argument,
    add_model_argument,
    add_threads_argument,
    add_timing_arguments,
    model_path,
    timing_header,
)
from _table import Table

from minitransformer.backend import to_device, to_numpy
from minitransformer.config import load_config
from minitransformer.measure.sanity import recheck, slower, unsteady_line
from minitransformer.measure.timing import peak_bytes, time_together
from minitransformer.model import causal_mask, plain_attention
from minitransformer.tiled import CausalTiles, largest_score_block, tiled_attention

FP32 = 4  # bytes per score: the model's math is float32


def step_both_ways(q, k, v):
    """One head's inputs q, k, v (n, d) -> (recompute step, cached step, tiled recompute
    step), each a function returning the newest position's output (d,)."""
    n, d = q.shape
    Q, K, V = (to_device(a.reshape(1, n, 1, d)) for a in (q, k, v))  # (B=1, T=n, H=1, d)
    K, V = K.transpose(0, 2, 1, 3), V.transpose(0, 2, 1, 3)          # (B=1, Hkv=1, S=n, d)
    all_positions = to_device(np.arange(n)[None])                     # (1, n)
    last_position = to_device(np.array([[n - 1]]))                    # (1, 1)

    def recompute():
        return plain_attention(Q, K, V, causal_mask(all_positions, n))[0, -1]  # n x n scores, last row

    def cached():
        return plain_attention(Q[:, -1:], K, V, causal_mask(last_position, n))[0, -1]  # 1 x n

    def tiled():  # all n queries, the scores held 64 x 64 at a time
        return tiled_attention(Q, K, V, CausalTiles(all_positions, n))[0, -1]
    return recompute, cached, tiled


def attention_row(n, d, warmup, repeat, seed=0):
    """-> dict of one table row for context length n."""
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((n, d), dtype=np.float32) for _ in range(3))
    recompute, cached, tiled = step_both_ways(q, k, v)
    # side by side, and again if the cached step came out slower than the recompute (a step
    # that does 1/n of the work cannot be: the machine was busy)
    (t_re, t_ca), warning = recheck(
        lambda _: time_together([recompute, cached], warmup, repeat),
        lambda t: slower(t[1], t[0], "the cached step", "the recompute")
        or unsteady_line(["recompute", "cached"], t, scale=1e3, unit="ms", fmt=".3f"))
    peak_re, peak_ca, peak_ti = peak_bytes(recompute), peak_bytes(cached), peak_bytes(tiled)
    diff = float(np.abs(to_numpy(peak_re.result) - to_numpy(peak_ca.result)).max())
    diff_tiled = float(np.abs(to_numpy(peak_re.result) - to_numpy(peak_ti.result)).max())
    return {"n": n, "recompute": t_re, "cached": t_ca, "warning": warning,
            "scores_recompute": n * n * FP32, "scores_cached": n * FP32,
            "peak_recompute": peak_re.peak_bytes, "peak_cached": peak_ca.peak_bytes,
            "scores_tiled": largest_score_block(n, n), "peak_tiled": peak_ti.peak_bytes,
            "max_diff": diff, "max_diff_tiled": diff_tiled, "counter": peak_re.counter}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_argument(parser)
    add_lengths_argument(parser, [256, 512, 1024, 2048, 4096], "context lengths n")
    parser.add_argument("--head-dim", type=int, default=None,
                        help="d (default: the model's head_dim)")
    add_timing_arguments(parser, warmup=1, repeat=5, runs="calls")
    add_threads_argument(parser)
    args = parser.parse_args(argv)
    d = args.head_dim or load_config(model_path(args.model)).head_dim
    if d < 1 or min(args.lengths) < 1:
        parser.error("--head-dim and --lengths must be positive")

    ran_on, rows = timing_header(args), []
    progress = Progress(len(args.lengths), "attention step")
    for n in args.lengths:
        rows.append(attention_row(n, d, args.warmup, args.repeat))
        r = rows[-1]
        progress(f"n={n}: recompute {r['recompute'].best * 1e3:.2f} ms, "
                 f"cached {r['cached'].best * 1e3:.3f} ms")

    table = Table(f"Experiment 2: one attention head (d = {d}), one generation step both ways, "
                  "float32", experiment=2, columns=[
                      ("n", ",d"), ("recompute ms", ".3f"), ("recompute med", ".3f"),
                      ("cached ms", ".3f"), ("cached med", ".3f"), ("ratio", ".0f"),
                      ("scores n x n B", ",d"), ("scores 1 x n B", ",d"),
                      ("peak recompute B", ",d"), ("peak cached B", ",d"),
                      ("tiled block B", ",d"), ("peak tiled B", ",d")])
    table.header(f"time: min (ms) and median (med) of {args.repeat}+ calls after "
                 f"{args.warmup} warm-up, the two ways side by side; "
                 f"peak: {rows[0]['counter']}, one step", ran_on)
    for r in rows:
        re, ca = r["recompute"], r["cached"]
        table.row(r["n"], re.best * 1e3, re.median * 1e3, ca.best * 1e3, ca.median * 1e3,
                  re.best / ca.best, r["scores_recompute"], r["scores_cached"],
                  r["peak_recompute"], r["peak_cached"], r["scores_tiled"], r["peak_tiled"],
                  warning=r["warning"])
    last = rows[-1]
    table.note(f"at n = {last['n']:,}: scores {last['scores_recompute']:,} B "
               f"({last['scores_recompute'] / 1e6:.1f} MB) recomputed against "
               f"{last['scores_cached']:,} B ({last['scores_cached'] / 1e3:.1f} KB) cached; "
               f"tiled, the largest block of scores held: {last['scores_tiled']:,} B "
               f"({last['scores_tiled'] / 1e3:.1f} KB), peak {last['peak_tiled']:,} B against "
               f"the recompute's {last['peak_recompute']:,} B")
    worst = max(r["max_diff"] for r in rows)
    worst_tiled = max(r["max_diff_tiled"] for r in rows)
    table.note(f"newest position's output, recompute vs cached: max |difference| {worst:.1e}; "
               f"recompute vs tiled: {worst_tiled:.1e}")
    table.plot("n", ["recompute ms", "cached ms"], "one attention step against the context, "
               "with and without the cache", xlabel="context n (tokens)",
               ylabel="one step (ms)", logx=True, logy=True)
    table.plot("n", ["scores n x n B", "scores 1 x n B"], "attention scores built in one step, "
               "with and without the cache", xlabel="context n (tokens)",
               ylabel="score bytes (B, fp32)", logx=True, logy=True,
               chapter=[(4096, 4096 * 4096 * 4, "67 MB"), (4096, 4096 * 4, "16 KB")])
    table.show()
    return 0 if max(worst, worst_tiled) < 1e-4 else 1


if __name__ == "__main__":
    from _common import run
    run(main)
