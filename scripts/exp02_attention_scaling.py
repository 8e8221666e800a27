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
"""
import argparse

import numpy as np

from _common import add_model_argument, progress, say
from minitransformer.backend import to_device, to_numpy
from minitransformer.config import load_config
from minitransformer.measure import busy_note, machine, median_time, peak_bytes
from minitransformer.model import attention
from minitransformer.synth import default_model

FP32 = 4  # bytes per score: the model's math is float32


def step_both_ways(q, k, v):
    """One head's inputs q, k, v (n, d) -> (recompute step, cached step), each a function
    returning the newest position's output (d,)."""
    n, d = q.shape
    Q, K, V = (to_device(a.reshape(1, n, 1, d)) for a in (q, k, v))  # (B=1, T=n, H=1, d)
    K, V = K.transpose(0, 2, 1, 3), V.transpose(0, 2, 1, 3)          # (B=1, Hkv=1, S=n, d)
    all_positions = to_device(np.arange(n)[None])                     # (1, n)
    last_position = to_device(np.array([[n - 1]]))                    # (1, 1)

    def recompute():
        return attention(Q, K, V, all_positions)[0, -1]               # n x n scores, last row

    def cached():
        return attention(Q[:, -1:], K, V, last_position)[0, -1]       # 1 x n scores
    return recompute, cached


def measure(n, d, warmup, repeat, seed=0):
    """-> dict of one table row for context length n."""
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((n, d), dtype=np.float32) for _ in range(3))
    recompute, cached = step_both_ways(q, k, v)
    t_re = median_time(recompute, warmup, repeat)
    t_ca = median_time(cached, warmup, repeat)
    peak_re, peak_ca = peak_bytes(recompute), peak_bytes(cached)
    diff = float(np.abs(to_numpy(peak_re.result) - to_numpy(peak_ca.result)).max())
    return {"n": n, "recompute_s": t_re.median, "cached_s": t_ca.median,
            "scores_recompute": n * n * FP32, "scores_cached": n * FP32,
            "peak_recompute": peak_re.peak_bytes, "peak_cached": peak_ca.peak_bytes,
            "max_diff": diff, "counter": peak_re.counter}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_argument(parser)
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096],
                        help="context lengths n (default: %(default)s)")
    parser.add_argument("--head-dim", type=int, default=None,
                        help="d (default: the model's head_dim)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed calls (default: 1)")
    parser.add_argument("--repeat", type=int, default=5,
                        help="timed calls, the median is reported (default: 5)")
    args = parser.parse_args(argv)
    d = args.head_dim or load_config(args.model or default_model()).head_dim
    if d < 1 or min(args.lengths) < 1:
        parser.error("--head-dim and --lengths must be positive")

    ran_on, rows = machine(), []
    if note := busy_note():
        say(f"note: {note}")
    for i, n in enumerate(args.lengths, 1):
        rows.append(measure(n, d, args.warmup, args.repeat))
        r = rows[-1]
        progress(i, len(args.lengths), f"n={n}: recompute {r['recompute_s'] * 1e3:.2f} ms, "
                                       f"cached {r['cached_s'] * 1e3:.3f} ms")

    print(f"Experiment 2: one attention head (d = {d}), one generation step both ways, float32")
    print(f"time: median of {args.repeat} after {args.warmup} warm-up; "
          f"peak: {rows[0]['counter']}, one step")
    print(f"machine: {ran_on}")
    print()
    print(f"{'n':>6}{'recompute ms':>14}{'cached ms':>11}{'ratio':>8}"
          f"{'scores n x n':>15}{'scores 1 x n':>14}{'peak recompute':>16}{'peak cached':>13}")
    for r in rows:
        print(f"{r['n']:>6,}{r['recompute_s'] * 1e3:>14.3f}{r['cached_s'] * 1e3:>11.3f}"
              f"{r['recompute_s'] / r['cached_s']:>7.0f}x{r['scores_recompute']:>15,}"
              f"{r['scores_cached']:>14,}{r['peak_recompute']:>16,}{r['peak_cached']:>13,}")
    last = rows[-1]
    print()
    print(f"at n = {last['n']:,}: scores {last['scores_recompute']:,} B "
          f"({last['scores_recompute'] / 1e6:.1f} MB) recomputed against "
          f"{last['scores_cached']:,} B ({last['scores_cached'] / 1e3:.1f} KB) cached "
          f"(chapter, n = 4,096: 67 MB vs 16 KB)")
    worst = max(r["max_diff"] for r in rows)
    print(f"newest position's output, recompute vs cached: max |difference| {worst:.1e}")
    return 0 if worst < 1e-4 else 1


if __name__ == "__main__":
    raise SystemExit(main())
