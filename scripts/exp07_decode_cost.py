"""Experiment 7: the cost of one decode step as the cache grows, C = 16 ... 1,024.

A cache is filled by prefill to C tokens, then one decode step (one token through the model,
attending over the C cached ones, and the head) is timed; a rollback, untimed, trims that token
off so that every timed step sees exactly C (measure.timing.step_with_rollback). The fastest and
the median of --repeat steps after --warmup (more while the median sits far above the fastest).
Then the cache grows to the next C by prefilling the tokens in between (in one chunk), and so
on. A step that comes out cheaper against a longer cache, or whose repeats disagree by more than
25%, is measured again (a fresh pass) and flagged if it persists; the closing ratio is printed
only when its two rows are not.

The chapter: flat. Sixty-four times more history changed nothing measurable, because a step's
cost is dominated by reading the weights; the cache it also reads is small beside them. The
last columns say how small: the bytes of cache a step reads at C (C x 2 x L x Hkv x d x 4, the
formula, float32) against the weight bytes a step reads (shape.decode_read_bytes).
"""
import argparse

import numpy as np

from _common import (
    Progress,
    add_lengths_argument,
    add_model_argument,
    add_threads_argument,
    add_timing_arguments,
    lengths_within,
    load_model,
    timing_header,
)
from _table import Table

from minitransformer.kvcache import KVCache
from minitransformer.measure.sanity import conclude, cost_falls, merged, recheck, rests_on, unsteady
from minitransformer.measure.timing import median_time, step_with_rollback
from minitransformer.model import forward
from minitransformer.shape import decode_read_bytes
from sim.kv_memory import format_bytes, kv_bytes_per_token


def step_times(model, lengths, warmup, repeat, seed=0):
    """[C, ...] (increasing) -> [Timing of one decode step against a cache of C, ...]."""
    c = model.config
    ids = np.random.default_rng(seed).integers(0, c.vocab_size, max(lengths) + 1)
    cache = KVCache.allocate(c, batch=1, max_len=max(lengths) + 1)
    timings, progress = [], Progress(len(lengths), "decode step")
    for C in lengths:
        held = int(cache.lengths[0])
        forward(model, ids[None, held:C], cache)        # grow the cache to C: prefill the gap
        token = int(ids[C])
        step, rollback = step_with_rollback(model, cache, [[token]])     # (1, 1)
        timings.append(median_time(step, warmup, repeat, after=rollback))
        progress(f"C={C}: {timings[-1].best * 1e3:.1f} ms/step "
                 f"(median {timings[-1].median * 1e3:.1f})")
    return timings


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_argument(parser)
    add_lengths_argument(parser, [16, 32, 64, 128, 256, 512, 1024], "cache lengths C")
    add_timing_arguments(parser, warmup=3, repeat=9, runs="steps")
    add_threads_argument(parser)
    args = parser.parse_args(argv)

    ran_on = timing_header(args)
    model = load_model(args.model)
    c = model.config
    lengths = lengths_within(sorted(set(args.lengths)), c.max_position_embeddings - 1,
                             f"the step's position C would be beyond the model's "
                             f"{c.max_position_embeddings} positions")
    timings, warnings = recheck(
        lambda _: step_times(model, lengths, args.warmup, args.repeat),
        lambda t: merged(cost_falls(lengths, t, "a step against C ="),
                         unsteady([f"{C:,}" for C in lengths], t, "C=")))
    weights = decode_read_bytes(c, model.weights)
    per_token = kv_bytes_per_token(c, 4)

    table = Table("Experiment 7: decode step cost vs cache length (float32)", experiment=7,
                  columns=[("C", ",d"), ("step ms", ".1f"), ("med ms", ".1f"),
                           ("vs first", ".2f"), ("cache read", format_bytes),
                           ("cache / weights", ".1%")])
    table.header(f"time: fastest and median of {args.repeat}+ steps after {args.warmup} "
                 "warm-up; cache read: C x 2 x L x Hkv x d x 4 B", ran_on)
    base = timings[0].best
    for i, (C, t) in enumerate(zip(lengths, timings, strict=True)):
        table.row(C, t.best * 1e3, t.median * 1e3, t.best / base, C * per_token,
                  C * per_token / weights, warning=warnings.get(i))
    ends = rests_on([f"C={C:,}" for C in lengths], timings, warnings, (0, len(lengths) - 1))
    table.note(conclude("the step's growth", f"C {lengths[0]:,} -> {lengths[-1]:,} "
                        f"({lengths[-1] / lengths[0]:.0f}x the history): the step costs "
                        f"{timings[-1].best / base:.2f}x", ends),
               f"weights {format_bytes(weights)} read per step whatever C")
    table.plot("C", ["step ms"], "decode: one step's cost against the cache length",
               xlabel="cache length C (tokens)", ylabel="one decode step (ms)", logx=True)
    table.show()
    return 0


if __name__ == "__main__":
    from _common import run
    run(main)
