"""Experiment 12: batched decode, B = 1 ... 32 sequences each holding a 64-token cache.

Every sequence has its own 64-token prompt, prefilled alone into the paged cache the engine
uses; then B of them decode one token together in one step (model.forward), timed as the
fastest and the median of --repeat steps (the fastest is the least disturbed by other work on
the machine, and the ratios use it; each step is rolled back, so the cache stays at 64 tokens).
A row that breaks what batching cannot do (a larger batch's step cheaper than a smaller one's,
or fewer tokens/s than a smaller batch: it could take turns), or whose repeats disagree by
more than 25%, is measured again and flagged beside its row if it persists; the knee and the
ratios below are printed only from rows that are not (else a line says the machine was too
noisy, with its load). Printed per B: step latency, tokens/s, both
relative to B = 1, the gain of each row over the one before, the same step over a contiguous
KVCache (what the block table costs in NumPy), the chapter's ratios against ours, and the
knee: the batch size after which doubling the batch buys less than --knee-gain more
throughput. The chapter (laptop GPU): 1 -> 16 throughput x6.0, latency x2.67; 16 -> 32
throughput +9%, latency ~x2.

Two ways to batch, side by side: the default multiplies the whole batch as one flat matrix
per projection (each weight read once per step), the batch-invariant mode multiplies row by
row (each weight read B times) so that every row gets exactly the bits it gets alone. The
second table prints the throughput of each, and at the largest B how many logits differ
between the two and whether any greedy token changed.

--save-step-costs FILE writes the step costs for experiment 13's simulation, with the rows
still flagged after measuring again (sim/batching.py TableCost: its conclusions say "not
concluded" on them, as this table's do).
"""
import argparse
import time

import numpy as np

from _common import (
    Progress,
    add_engine_arguments,
    add_model_argument,
    add_threads_argument,
    add_timing_arguments,
    load_model,
    positive_int,
    positive_ints,
    progress,
    say,
    timing_header,
)
from _table import Table

from minitransformer.measure.sanity import (
    conclude,
    cost_falls,
    merged,
    per_unit_rises,
    recheck_rows,
    rests_on,
    unsteady,
)
from minitransformer.measure.timing import batched_steps, time_together
from minitransformer.model import forward
from minitransformer.serve.blocks import blocks_for
from minitransformer.serve.paged import PagedCache
from sim.batching import TableCost


def fill(model, B, context, block_size, seed):
    """B sequences of `context` random tokens, each prefilled alone -> the paged cache."""
    rng = np.random.default_rng(seed)
    blocks = blocks_for(context + 1, block_size)
    cache = PagedCache.allocate(model.config, B * blocks, block_size)
    start = time.perf_counter()
    for b in range(B):
        prompt = rng.integers(0, model.config.vocab_size, context).tolist()
        cache.books.add(b, prompt)
        forward(model, np.array([prompt]), cache.view([b]))
        if (b + 1) % 8 == 0 or b + 1 == B:
            progress(b + 1, B, f"prefilled {context}-token caches "
                               f"({time.perf_counter() - start:.1f} s)")
    return cache


def knee(sizes, tps, gain):
    """The first B whose doubling (when measured) buys less than `gain` more tokens/s."""
    at = dict(zip(sizes, tps, strict=True))
    for B in sizes:
        if 2 * B in at and at[2 * B] / at[B] - 1 < gain:
            return B
    return None


def check(sizes, timings) -> dict:
    """A larger batch: not cheaper, not fewer tokens/s; repeats that agree (the paged step)."""
    steps = [paged for paged, _, _ in timings]
    return merged(cost_falls(sizes, steps, "batch"), per_unit_rises(sizes, sizes, steps),
                  unsteady(sizes, steps, "B="))


def batched_timings(model, sizes, args):
    """-> ([(paged, paged batch-invariant, contiguous) Timings per B], warnings by row, the
    largest batch's logits both ways). A re-measurement redoes the flagged rows and the row
    before each."""
    cache = fill(model, sizes[-1], args.context, args.block_size, args.seed)
    ids = np.random.default_rng(args.seed + 1).integers(0, model.config.vocab_size, sizes[-1])

    def steps_for(B):
        contiguous = cache.to_contiguous(range(B), args.context + 1)   # the same keys, values
        return batched_steps(model, cache, ids[:B], contiguous)

    def measure_row(i):
        steps, rollbacks = steps_for(sizes[i])
        return tuple(time_together(steps, warmup=1, repeat=args.repeat, after=rollbacks))
    timings, warnings = recheck_rows([f"B={B}" for B in sizes], measure_row,
                                     lambda t: check(sizes, t), Progress, "batched step")
    (step_paged, step_exact, _), (rollback, _, _) = steps_for(sizes[-1])
    fast_logits = step_paged()           # B = the largest, once more each way, for the bits
    rollback()
    exact_logits = step_exact()
    rollback()
    return timings, warnings, (fast_logits, exact_logits)


def batched_table(sizes, timings, warnings, args, ran_on) -> Table:
    paged = [p.best for p, _, _ in timings]
    tps = [B / t for B, t in zip(sizes, paged, strict=True)]
    table = Table(f"Experiment 12: batched decode, each sequence holding a {args.context}-token "
                  "cache and decoding one token", experiment=12, columns=[
                      ("B", "d"), ("step ms", ".1f"), ("med ms", ".1f"), ("tokens/s", ".1f"),
                      ("latency vs B=1", ".2f"), ("tokens/s vs B=1", ".2f"),
                      ("latency vs prev", ".2f"), ("tokens/s vs prev", ".2f"),
                      ("contiguous ms", ".1f")])
    table.header(f"time: fastest and median of {args.repeat}+ steps, paged and contiguous side "
                 f"by side; paged cache, block size {args.block_size}; the contiguous column runs "
                 "model.forward on a KVCache", ran_on)
    for i, (B, (p, _, c)) in enumerate(zip(sizes, timings, strict=True)):
        table.row(B, p.best * 1e3, p.median * 1e3, tps[i], p.best / paged[0], tps[i] / tps[0],
                  None if i == 0 else p.best / paged[i - 1],
                  None if i == 0 else tps[i] / tps[i - 1], c.best * 1e3,
                  warning=warnings.get(i))
    at = dict(zip(sizes, zip(paged, tps, strict=True), strict=True))
    pairs = [(a, b) for a, b in ((1, 16), (16, 32)) if a in at and b in at]
    parts = [f"{a} -> {b}: throughput x{at[b][1] / at[a][1]:.2f} "
             f"({at[b][1] / at[a][1] - 1:+.0%}), latency x{at[b][0] / at[a][0]:.2f}"
             for a, b in pairs]
    labels, steps = [f"B={B}" for B in sizes], [p for p, _, _ in timings]

    def resting(used):  # the rows a conclusion rests on, and what a check says of them
        return rests_on(labels, steps, warnings, [i for i, B in enumerate(sizes) if B in used])
    k = knee(sizes, tps, args.knee_gain)
    table.note(conclude("here", "here: " + "; ".join(parts),
                        resting({B for pair in pairs for B in pair}))
               if parts else "here: (needs batch sizes 1, 16, 32)",
               conclude("knee", f"knee: B = {k} (doubling to {2 * k} buys "
                        f"{at[2 * k][1] / at[k][1] - 1:+.0%} tokens/s, under {args.knee_gain:.0%})"
                        if k else f"knee: not reached (every measured doubling buys "
                        f"{args.knee_gain:.0%} or more)",
                        resting({B for B in sizes if B <= (2 * k if k else sizes[-1])})))
    table.plot("B", ["tokens/s vs B=1"], "batched decode: throughput against batch size, "
               "relative to B = 1 (the knee)", xlabel="batch size B (sequences)",
               ylabel="tokens/s relative to B = 1 (x)", chapter=[(16, 6.0, "x6.0")])
    table.plot("B", ["latency vs B=1"], "batched decode: step latency against batch size, "
               "relative to B = 1", xlabel="batch size B (sequences)",
               ylabel="step latency relative to B = 1 (x)", chapter=[(16, 2.67, "x2.67")])
    return table


def ways_table(sizes, timings, logits) -> Table:
    paged = [p.best for p, _, _ in timings]
    exact = [e.best for _, e, _ in timings]
    ways = Table("Two ways to batch (paged): one flat matrix per projection (the default) vs row "
                 "by row (batch_invariant=True)", experiment=12, chapter=False, columns=[
                     ("B", "d"), ("flat ms", ".1f"), ("flat tokens/s", ".1f"),
                     ("flat vs B=1", ".2f"), ("row by row ms", ".1f"),
                     ("row by row tokens/s", ".1f"), ("row by row vs B=1", ".2f")])
    for B, t, e in zip(sizes, paged, exact, strict=True):
        ways.row(B, t * 1e3, B / t, B / t / (sizes[0] / paged[0]), e * 1e3, B / e,
                 B * exact[0] / e)
    fast_logits, exact_logits = logits
    differ = int((fast_logits != exact_logits).sum())
    changed = int((fast_logits.argmax(-1) != exact_logits.argmax(-1)).sum())
    ways.note(f"at B = {sizes[-1]}: {differ:,} of {fast_logits.size:,} logits differ between "
              f"the two (max |difference| {np.abs(fast_logits - exact_logits).max():.1e}); "
              f"greedy token changed in {changed} of {sizes[-1]} rows")
    ways.plot("B", ["flat tokens/s", "row by row tokens/s"], "flat against row-by-row batching: "
              "throughput", xlabel="batch size B (sequences)", ylabel="throughput (tokens/s)")
    return ways


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_argument(parser)
    parser.add_argument("--batch-sizes", type=positive_ints, default="1,2,4,8,16,24,32",
                        help="comma-separated (default: %(default)s)")
    parser.add_argument("--context", type=positive_int, default=64,
                        help="tokens cached per sequence")
    add_engine_arguments(parser, slots=None)
    add_timing_arguments(parser, repeat=7, runs="steps per batch size")
    parser.add_argument("--knee-gain", type=float, default=0.25,
                        help="a doubling that buys less than this is past the knee "
                             "(default: %(default)s)")
    parser.add_argument("--save-step-costs", metavar="FILE",
                        help="write the paged step latencies as JSON for experiment 13, with "
                             "the rows still flagged")
    add_threads_argument(parser)
    args = parser.parse_args(argv)
    sizes = sorted(set(args.batch_sizes))

    ran_on = timing_header(args)
    model = load_model(args.model)
    timings, warnings, logits = batched_timings(model, sizes, args)
    batched_table(sizes, timings, warnings, args, ran_on).show()
    ways_table(sizes, timings, logits).show()
    if args.save_step_costs:
        TableCost(tuple(sizes), tuple(p.best for p, _, _ in timings),
                  {sizes[i]: why for i, why in warnings.items()}).write_json(args.save_step_costs)
        say(f"step costs written to {args.save_step_costs}"
            + (f" (flagged: B = {', '.join(str(sizes[i]) for i in warnings)})" if warnings
               else ""))


if __name__ == "__main__":
    from _common import run
    run(main)
