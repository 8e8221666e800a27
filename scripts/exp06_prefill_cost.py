"""Experiment 6: the cost of prefill as the prompt grows.

One prefill pass over P tokens, as generation does it (a cache allocated for the P tokens, the
forward pass, the head on the last position), timed for each P: the median of --repeat passes
after --warmup. The chapter: the time grows with P, but per token it falls, because a pass over
P tokens multiplies every weight matrix by P rows at once (matrix-matrix work) and reads each
weight once for all of them. This is why time to first token grows with the prompt.
"""
import argparse

import numpy as np

from _common import add_model_argument, load_model, progress, say
from minitransformer.generate import last_logits
from minitransformer.kvcache import KVCache
from minitransformer.measure import busy_note, machine, median_time
from minitransformer.model import forward


def prefill_time(model, ids, warmup, repeat):
    """ids (P,) -> Timing of one prefill pass (fresh cache each time)."""
    def prefill():
        cache = KVCache.allocate(model.config, batch=1, max_len=len(ids))
        return last_logits(model, forward(model, ids[None], cache))    # (1, P) -> (1, V)
    return median_time(prefill, warmup, repeat)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_argument(parser)
    parser.add_argument("--lengths", type=int, nargs="+", default=[8, 16, 32, 64, 128, 256, 512],
                        help="prompt lengths P (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed passes (default: 1)")
    parser.add_argument("--repeat", type=int, default=3,
                        help="timed passes, the median is reported (default: 3)")
    args = parser.parse_args(argv)
    if min(args.lengths) < 1 or args.warmup < 0 or args.repeat < 1:
        parser.error("need --lengths >= 1, --warmup >= 0, --repeat >= 1")

    model = load_model(args.model)
    limit = model.config.max_position_embeddings
    lengths = [P for P in args.lengths if P <= limit]
    if not lengths:
        parser.error(f"every --lengths is beyond the model's {limit} positions")
    if len(lengths) < len(args.lengths):
        say(f"skipping P > {limit}: beyond the model's positions")
    ids = np.random.default_rng(0).integers(0, model.config.vocab_size, max(lengths))
    ran_on, rows = machine(), []
    if note := busy_note():
        say(f"note: {note}")
    for i, P in enumerate(lengths, 1):
        t = prefill_time(model, ids[:P], args.warmup, args.repeat)
        rows.append((P, t.median))
        progress(i, len(lengths), f"P={P}: {t.median * 1e3:.1f} ms "
                                  f"(best {t.best * 1e3:.1f}, worst {t.worst * 1e3:.1f})")

    print(f"Experiment 6: prefill cost vs prompt length (float32, median of {args.repeat} "
          f"passes after {args.warmup} warm-up)")
    print(f"machine: {ran_on}")
    print()
    print(f"{'P':>6}{'time (ms)':>12}{'ms/token':>10}{'tokens/s':>10}")
    for P, seconds in rows:
        print(f"{P:>6,}{seconds * 1e3:>12.1f}{seconds * 1e3 / P:>10.2f}{P / seconds:>10.0f}")
    (P0, t0), (P1, t1) = rows[0], rows[-1]
    print()
    print(f"P {P0} -> {P1}: the pass costs {t1 / t0:.1f}x, a token {t1 / P1 / (t0 / P0):.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
