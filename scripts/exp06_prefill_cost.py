"""Experiment 6: the cost of prefill as the prompt grows.

One prefill pass over P tokens, as generation does it (a cache allocated for the P tokens, the
forward pass, the head on the last position), timed for each P: the fastest and the median of
--repeat passes after --warmup (more while the median sits far above the fastest). A longer pass
that comes out cheaper than a shorter one, or a per-token cost standing above both neighbours,
or one whose repeats disagree by more than 25%, is measured again (with the row before it) and,
if it persists, flagged beside its row; the closing ratio is printed only when its rows are
not. The chapter: the time grows with P, but per token it falls, because a pass over P
tokens multiplies every weight matrix by P rows at once (matrix-matrix work) and reads each
weight once for all of them. This is why time to first token grows with the prompt.
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

from minitransformer.generate import last_logits
from minitransformer.kvcache import KVCache
from minitransformer.measure.sanity import (
    conclude,
    cost_falls,
    merged,
    recheck_rows,
    rests_on,
    spikes,
    unsteady,
)
from minitransformer.measure.timing import median_time


def prefill_time(model, ids, warmup, repeat):
    """ids (P,) -> Timing of one prefill pass (fresh cache each time)."""
    def prefill():
        cache = KVCache.allocate(model.config, batch=1, max_len=len(ids))
        return last_logits(model, ids[None], cache)                     # (1, P) -> (1, V)
    return median_time(prefill, warmup, repeat)


def flagged(lengths, timings) -> dict:
    """A longer pass cheaper than a shorter one; a per-token outlier; repeats that disagree."""
    return merged(cost_falls(lengths, timings, "a pass over P ="),
                  spikes(lengths, lengths, timings) | unsteady(lengths, timings, "P="))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_argument(parser)
    add_lengths_argument(parser, [8, 16, 32, 64, 128, 256, 512], "prompt lengths P")
    add_timing_arguments(parser, warmup=1, repeat=3, runs="passes")
    add_threads_argument(parser)
    args = parser.parse_args(argv)

    ran_on = timing_header(args)
    model = load_model(args.model)
    limit = model.config.max_position_embeddings
    lengths = lengths_within(args.lengths, limit, f"the model's {limit} positions")
    ids = np.random.default_rng(0).integers(0, model.config.vocab_size, max(lengths))

    labels = [f"P={P}" for P in lengths]
    timings, warnings = recheck_rows(
        labels, lambda i: prefill_time(model, ids[:lengths[i]], args.warmup, args.repeat),
        lambda timings: flagged(lengths, timings), Progress, "prefill")

    table = Table("Experiment 6: prefill cost vs prompt length (float32)", experiment=6,
                  columns=[("P", ",d"), ("time ms", ".1f"), ("med ms", ".1f"),
                           ("ms per token", ".2f"), ("tokens/s", ".0f")])
    table.header(f"time: fastest and median of {args.repeat}+ passes after {args.warmup} "
                 "warm-up", ran_on)
    for i, (P, t) in enumerate(zip(lengths, timings, strict=True)):
        table.row(P, t.best * 1e3, t.median * 1e3, t.best * 1e3 / P, P / t.best,
                  warning=warnings.get(i))
    (P0, t0), (P1, t1) = (lengths[0], timings[0].best), (lengths[-1], timings[-1].best)
    ends = rests_on(labels, timings, warnings, (0, len(lengths) - 1))
    table.note(conclude("the pass's growth", f"P {P0} -> {P1}: the pass costs {t1 / t0:.1f}x, "
                        f"a token {t1 / P1 / (t0 / P0):.2f}x", ends))
    table.plot("P", ["ms per token"], "prefill: cost per prompt token against prompt length",
               xlabel="prompt length P (tokens)", ylabel="time per prompt token (ms)",
               logx=True)
    table.show()
    return 0


if __name__ == "__main__":
    from _common import run
    run(main)
