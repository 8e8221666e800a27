"""Experiment 7: the cost of one decode step as the cache grows, C = 16 ... 1,024.

A cache is filled by prefill to C tokens, then one decode step (one token through the model,
attending over the C cached ones, the head, the argmax) is timed; ``trim(1)`` rolls that token
back so that every timed step sees exactly C. The median of --repeat steps after --warmup. Then
the cache grows to the next C by prefilling the tokens in between (in one chunk), and so on.

The chapter: flat. Sixty-four times more history changed nothing measurable, because a step's
cost is dominated by reading the weights; the cache it also reads is small beside them. The
last columns say how small: the bytes of cache a step reads at C (C x 2 x L x Hkv x d x 4, the
formula, float32) against the bytes of the weights.
"""
import argparse

import numpy as np

from _common import add_model_argument, load_model, progress, say
from minitransformer.generate import last_logits
from minitransformer.kvcache import KVCache
from minitransformer.measure import busy_note, machine, median_time
from minitransformer.model import forward
from sim.kv_memory import format_bytes, kv_bytes_per_token


def decode_step(model, cache, token: int) -> int:
    """One greedy decode step against the cache, then rolled back: -> the next token."""
    logits = last_logits(model, forward(model, np.array([[token]]), cache))  # (1, 1) -> (1, V)
    cache.trim(1)  # back to exactly the tokens it held, for the next timed step
    return int(np.argmax(logits[0]))


def step_times(model, lengths, warmup, repeat, seed=0):
    """[C, ...] (increasing) -> [Timing of one decode step against a cache of C, ...]."""
    c = model.config
    ids = np.random.default_rng(seed).integers(0, c.vocab_size, max(lengths) + 1)
    cache = KVCache.allocate(c, batch=1, max_len=max(lengths) + 1)
    timings = []
    for i, C in enumerate(lengths, 1):
        held = int(cache.lengths[0])
        forward(model, ids[None, held:C], cache)        # grow the cache to C: prefill the gap
        token = int(ids[C])
        timings.append(median_time(lambda: decode_step(model, cache, token), warmup, repeat))
        progress(i, len(lengths), f"C={C}: {timings[-1].median * 1e3:.1f} ms/step "
                                  f"(best {timings[-1].best * 1e3:.1f})")
    return timings


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_argument(parser)
    parser.add_argument("--lengths", type=int, nargs="+",
                        default=[16, 32, 64, 128, 256, 512, 1024],
                        help="cache lengths C (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps (default: 3)")
    parser.add_argument("--repeat", type=int, default=9,
                        help="timed steps, the median is reported (default: 9)")
    args = parser.parse_args(argv)
    if min(args.lengths) < 1 or args.warmup < 0 or args.repeat < 1:
        parser.error("need --lengths >= 1, --warmup >= 0, --repeat >= 1")

    model = load_model(args.model)
    c = model.config
    lengths = sorted({C for C in args.lengths if C < c.max_position_embeddings})
    if not lengths:
        parser.error(f"every --lengths is at or beyond the model's {c.max_position_embeddings} "
                     "positions")
    if len(lengths) < len(set(args.lengths)):
        say(f"skipping C >= {c.max_position_embeddings}: the step's position would be beyond "
            "the model's positions")
    ran_on = machine()
    if note := busy_note():
        say(f"note: {note}")
    timings = step_times(model, lengths, args.warmup, args.repeat)
    weights = sum(int(w.nbytes) for w in model.weights.values())
    per_token = kv_bytes_per_token(c, 4)

    print(f"Experiment 7: decode step cost vs cache length (float32, median of {args.repeat} "
          f"steps after {args.warmup} warm-up)")
    print(f"machine: {ran_on}")
    print()
    print(f"{'C':>6}{'step (ms)':>11}{'vs first':>10}{'cache read':>13}{'/ weights':>11}")
    base = timings[0].median
    for C, t in zip(lengths, timings):
        print(f"{C:>6,}{t.median * 1e3:>11.1f}{t.median / base:>9.2f}x"
              f"{format_bytes(C * per_token):>13}{C * per_token / weights:>10.1%}")
    print()
    print(f"C {lengths[0]:,} -> {lengths[-1]:,} ({lengths[-1] / lengths[0]:.0f}x the history): "
          f"the step costs {timings[-1].median / base:.2f}x; weights {format_bytes(weights)} "
          f"read per step whatever C")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
