"""Experiment 13: static vs continuous batching, simulated at a per-step cost.

64 requests with skewed output lengths (median 18, max 231, 1,874 tokens in all: the chapter's
statistics, met exactly) go through 8 slots under both policies. The step cost t(B) is the
measured one of experiment 12 when --step-costs gives it (JSON: {"batch size": seconds}, or
experiment 12's file with the rows it flagged), otherwise an affine default with the chapter's
1 -> 16 ratios. Printed: throughput, mean / p50 / p99 latency, normalised latency and TTFT per
policy, then a sweep over the Poisson arrival rate showing where the chapter's two figures
(1.6x throughput, >10x mean latency) fall. Costs experiment 12 flagged, or out of order (a
larger batch cheaper), leave every ratio "not concluded", as experiment 12 says of its own.
"""
import argparse
import math
import time
from pathlib import Path

import numpy as np

from _common import add_workload_arguments, numbers, positive_int, say, workload_lengths
from _table import Table

from minitransformer.measure.sanity import conclude_on
from minitransformer.serve.records import metrics
from sim.batching import (
    STATIC_RULE,
    AffineCost,
    TableCost,
    capacity_rate,
    first_crossing,
    simulate_continuous,
    simulate_static,
    sweep,
)
from sim.workload import make_workload

LOADS = "0.05,0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9,1,1.25,1.5,2,3,5,inf"


def describe(cost, path):
    if isinstance(cost, AffineCost):
        return (f"default affine model t(B) = {cost.a * 1e3:g} ms + {cost.b * 1e3:g} ms x B, "
                "not a measurement\n  (chosen so 1 -> 16 gives the chapter's x6.0 throughput and"
                " x2.67 latency;\n  pass --step-costs FILE with experiment 12's measured costs)")
    points = ", ".join(f"B={b} {s * 1e3:.1f} ms"
                       for b, s in zip(cost.batch_sizes, cost.seconds, strict=True))
    return (f"measured by experiment 12 (the step-cost file {Path(path).name}): {points}\n"
            "  (linear in between)")


def policy_table(title, runs):
    table = Table(title, experiment=13, chapter=False, columns=[
        ("policy", ""), ("tokens/s", ".1f"), ("mean s", ".2f"), ("p50 s", ".2f"),
        ("p99 s", ".2f"), ("s/token", ".3f"), ("TTFT s", ".2f"), ("steps", ",d")])
    for run in runs:
        m = metrics(run.results)
        table.row(run.policy, m.throughput, m.latency_mean, m.latency_p50, m.latency_p99,
                  m.normalised, m.ttft_mean, run.steps)
    return table


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--step-costs", metavar="FILE",
                        help="JSON {batch size: seconds per decode step} measured by "
                             "experiment 12 (default: the affine model)")
    parser.add_argument("--slots", type=positive_int, default=8,
                        help="batch slots (default: 8)")
    parser.add_argument("--prefill-ms", type=float, default=0.0,
                        help="prefill charged per admitted request, added to the step that "
                             "admits it (default: 0, decode steps only, as the chapter)")
    add_workload_arguments(parser)
    parser.add_argument("--rate", type=float, default=math.inf,
                        help="arrival rate (requests/s) of the first table (default: inf, "
                             "all at t = 0)")
    parser.add_argument("--loads", type=numbers, default=LOADS,
                        help="sweep rates as multiples of what full continuous slots serve "
                             "(default: %(default)s)")
    parser.add_argument("--seeds", type=positive_int, default=5,
                        help="arrival seeds averaged per sweep point (default: 5)")
    args = parser.parse_args(argv)

    try:
        cost = TableCost.from_json(args.step_costs) if args.step_costs else AffineCost()
        lengths = workload_lengths(args)
        arrivals = make_workload(lengths, args.rate, seed=0)
        prefill = args.prefill_ms / 1e3
        runs = [simulate_static(arrivals, args.slots, cost, prefill),
                simulate_continuous(arrivals, args.slots, cost, prefill)]
    except ValueError as e:
        parser.error(str(e))

    first_table(runs, lengths, cost, args).show()
    sweep_table(lengths, cost, prefill, args).show()


def first_table(runs, lengths, cost, args) -> Table:
    when = "all requests at t = 0" if math.isinf(args.rate) else f"Poisson, {args.rate:g} req/s"
    table = policy_table(f"Experiment 13: static vs continuous batching (simulated), {when}", runs)
    table.header(f"workload: {len(lengths)} requests, output tokens median "
                 f"{np.median(lengths):g}, max {max(lengths)}, total {sum(lengths):,} "
                 f"(log-normal sigma {args.sigma:g}, seed {args.lengths_seed})",
                 *f"step cost: {describe(cost, args.step_costs)}".splitlines(),
                 f"slots {args.slots}; prefill {args.prefill_ms:g} ms per admitted request",
                 STATIC_RULE)
    static, cont = (metrics(r.results) for r in runs)
    for message in cost.doubts().values():
        table.note(f"WARNING: step cost {message}")
    table.note(conclude_on(
        "continuous vs static", f"continuous vs static: throughput "
        f"{cont.throughput / static.throughput:.2f}x, mean latency "
        f"{static.latency_mean / cont.latency_mean:.2f}x better, p99 "
        f"{static.latency_p99 / cont.latency_p99:.2f}x better", doubted(cost)))
    return table


def doubted(cost) -> dict:
    """The step costs a ratio would rest on and must not, in brief (the first table's
    warnings say why): what conclude_on takes."""
    sizes = ", ".join(map(str, cost.doubts()))
    return {"costs": f"step costs at B = {sizes} doubted, see the warnings"} if sizes else {}


def crossing(points, capacity) -> str:
    """Where the sweep's throughput gain first reaches the chapter's 1.6x."""
    finite = [p for p in points if math.isfinite(p.rate)]
    rates = [p.rate for p in finite]
    at = first_crossing(rates, [p.throughput_gain for p in finite], 1.6)
    if at is None:
        return "the throughput gain never reaches 1.6x in this sweep"
    latency_gain = np.interp(at, rates, [p.latency_gain for p in finite])
    return (f"throughput gain reaches 1.6x at {at:.2f} req/s (load {at / capacity:.2f}); "
            f"the mean latency gain there is {latency_gain:.1f}x")


def both_figures(points) -> str:
    """The sweep's loads where both chapter figures hold."""
    both = [p.load for p in points if math.isfinite(p.rate) and p.throughput_gain >= 1.6
            and p.latency_gain > 10]
    return ("both chapter figures (>= 1.6x throughput, > 10x mean latency) at loads: "
            + (", ".join(f"{x:g}" for x in both) if both else "none of the sweep's"))


def sweep_table(lengths, cost, prefill, args) -> Table:
    capacity = capacity_rate(lengths, args.slots, cost)
    loads = args.loads
    start = time.perf_counter()
    points = sweep(lengths, [x * capacity for x in loads], args.slots, cost, prefill,
                   range(args.seeds))
    say(f"swept {len(loads)} arrival rates x {args.seeds} seeds x 2 policies in "
        f"{time.perf_counter() - start:.1f} s")
    table = Table(f"Arrival-rate sweep (Poisson, mean of {args.seeds} arrival seeds)",
                  experiment=13, columns=[
                      ("rate", ".2f"), ("load", ".2f"), ("tokens/s static", ".1f"),
                      ("tokens/s continuous", ".1f"), ("throughput gain", ".2f"),
                      ("mean s static", ".2f"), ("mean s continuous", ".2f"),
                      ("latency gain", ".1f")])
    table.header(f"load = rate / {capacity:.2f} req/s, the rate {args.slots} always-busy slots "
                 "serve", STATIC_RULE)
    for p in points:
        table.row(p.rate, p.load, p.static.throughput, p.continuous.throughput,
                  p.throughput_gain, p.static.latency_mean, p.continuous.latency_mean,
                  p.latency_gain)
    table.note(conclude_on("the 1.6x throughput gain", lambda: crossing(points, capacity),
                           doubted(cost)),
               conclude_on("both chapter figures", lambda: both_figures(points),
                           doubted(cost)))
    table.plot("load", ["mean s static", "mean s continuous"], "mean latency against load: "
               "static against continuous batching", xlabel="load (offered / capacity)",
               ylabel="mean end-to-end latency (s)", logx=True, logy=True)
    table.plot("load", ["tokens/s static", "tokens/s continuous"], "throughput against load",
               xlabel="load (offered / capacity)", ylabel="throughput (tokens/s)", logx=True)
    return table


if __name__ == "__main__":
    from _common import run
    run(main)
