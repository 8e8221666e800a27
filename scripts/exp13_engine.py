"""Experiment 13 on the real engine: the chapter's 64 requests through 8 slots, both policies.

The simulation (exp13_batching_sim.py) charges a step cost per batch size; here the same
workload (sim/workload.py: 64 output lengths, median 18, max 231, 1,874 tokens) runs through
minitransformer.serve.engine on a real model: seeded random prompts of --prompt-len tokens, greedy,
end-of-sequence off so every request makes exactly its workload length. The engine's clock is
its own measured compute time. Printed per policy: throughput, mean / p50 / p99 end-to-end
latency, mean time to first token, mean time per later token, steps, preemptions; then the
simulation of the same workload at the step costs this run measured (or --step-costs FILE,
experiment 12's), so the two can be compared, and the chapter's figures (continuous: 1.6x the
throughput, mean latency more than 10x better).

Both compute a static batch's finished members as padding until its longest member ends (the
simulation charges t(slots) for every step of a batch). The one difference: here prefill is a
real pass over each prompt; the simulation charges this run's mean prefill time per admitted
request.
"""
import argparse
import math
from dataclasses import replace
from pathlib import Path

import numpy as np

from _common import (
    Progress,
    add_cache_arguments,
    add_engine_arguments,
    add_model_argument,
    add_threads_argument,
    add_workload_arguments,
    finished_progress,
    load_model,
    positive_int,
    say,
    timing_header,
    workload_lengths,
)
from _table import Table

import minitransformer as mt
from minitransformer.measure.sanity import conclude_on, load_seen
from minitransformer.serve.config import EngineConfig
from minitransformer.serve.engine import Engine
from minitransformer.serve.paged import pool_for
from minitransformer.serve.records import Request, metrics
from sim.batching import STATIC_RULE, TableCost, simulate_continuous, simulate_static
from sim.workload import make_workload


def workload(args, vocab_size):
    """-> (lengths, engine requests) for the chapter's skewed lengths."""
    lengths = workload_lengths(args)
    arrivals = [a.time for a in make_workload(lengths, args.rate, seed=0)]
    rng = np.random.default_rng(args.seed)
    requests = [Request(tuple(rng.integers(0, vocab_size, args.prompt_len).tolist()), n,
                        arrival=t, eos_token_id=[]) for n, t in zip(lengths, arrivals, strict=True)]
    return lengths, requests


def serve(model, requests, config):
    engine = Engine(model, config, history=True)     # its per-step timings
    return engine.run(requests, on_step=finished_progress(Progress(len(requests),
                                                                    config.policy)))


COLUMNS = [("policy", ""), ("tokens/s", ".1f"), ("mean s", ".2f"), ("p50 s", ".2f"),
           ("p99 s", ".2f"), ("TTFT s", ".2f"), ("ms/token", ".1f"), ("steps", ",d"),
           ("preempted", "d")]


def policy_row(table, run, engine=True):
    m = metrics(run.results)
    table.row(run.policy, m.throughput, m.latency_mean, m.latency_p50, m.latency_p99,
              m.ttft_mean, m.per_token_mean * 1e3 if engine else None, run.steps,
              run.preemptions if engine else None)


def ratios(static, cont):
    return (f"continuous vs static: throughput {cont.throughput / static.throughput:.2f}x, "
            f"mean latency {static.latency_mean / cont.latency_mean:.1f}x better, "
            f"p99 {static.latency_p99 / cont.latency_p99:.1f}x better")


def engine_table(runs, lengths, args, ran_on) -> Table:
    table = Table("Experiment 13 on the real engine: static vs continuous batching",
                  experiment=13, chapter=False, columns=COLUMNS)
    table.header(f"workload: {len(lengths)} requests, output tokens median "
                 f"{np.median(lengths):g}, max {max(lengths)}, total {sum(lengths):,}; prompts of "
                 f"{args.prompt_len} tokens; "
                 + ("all at t = 0" if math.isinf(args.rate) else f"Poisson {args.rate:g} req/s"),
                 f"{args.slots} slots; paged cache of {args.num_blocks} blocks x "
                 f"{args.block_size} tokens; greedy; times are this machine's compute time "
                 "(each step measured as the engine runs: one sample per step)", ran_on)
    for run in runs:
        policy_row(table, run)
    table.note(ratios(*[metrics(r.results) for r in runs]))
    prompt_tokens = sum(len(r.request.prompt) for r in runs[1].results)
    table.note(f"prefix caching (on, the engine's default) found "
               f"{sum(r.cached_tokens for r in runs[1].results)} of {prompt_tokens:,} prompt "
               f"tokens cached (continuous): random prompts share no block, so the table is "
               f"the same without it; chunked prefill (off) would split no prompt here with a "
               f"budget of {args.slots + args.prompt_len} tokens a step or more (bench_serving.py "
               f"measures both features on the workloads where they matter)")
    return table


def step_costs(model, requests, runs, config, args):
    """The step-cost table the simulation uses: --step-costs (with what experiment 12
    flagged in it), or the runs' own decode steps (both policies once more, pooled, when a
    larger batch came out cheaper) -> (TableCost, what its doubts still say)."""
    steps = [s for run in runs for s in run.decode_times]
    cost = TableCost.from_json(args.step_costs) if args.step_costs else \
        TableCost.from_steps(steps, args.slots)
    if cost.doubts() and not args.step_costs:   # measure again, pooling the steps
        say("step costs out of order (a larger batch cheaper): both policies once more")
        steps += [s for policy in ("static", "continuous")
                  for s in serve(model, requests, replace(config, policy=policy)).decode_times]
        cost = TableCost.from_steps(steps, args.slots)
    return cost, cost.doubts()


def simulation_table(runs, lengths, cost, warnings, args) -> Table:
    prefill = float(np.mean([s for run in runs for _, s in run.prefill_times]))
    arrivals = make_workload(lengths, args.rate, seed=0)
    sims = [simulate_static(arrivals, args.slots, cost, prefill),
            simulate_continuous(arrivals, args.slots, cost, prefill)]
    source = (f"from the step-cost file {Path(args.step_costs).name}" if args.step_costs else
              "measured in this run (median per batch size)")
    points = ", ".join(f"B={b} {s * 1e3:.1f}"
                       for b, s in zip(cost.batch_sizes, cost.seconds, strict=True))
    sim = Table("Simulation (sim/batching.py) of the same workload", experiment=13,
                columns=COLUMNS)
    sim.header(f"step costs {source}: {points} ms; prefill {prefill * 1e3:.1f} ms per "
               "admitted request", STATIC_RULE)
    for run in sims:
        policy_row(sim, run, engine=False)
    for message in warnings.values():
        sim.note(f"WARNING: step cost {message}")
    sim.note(conclude_on("continuous vs static (simulated)",
                         lambda: ratios(*[metrics(r.results) for r in sims]),
                         {B: f"step cost at B = {B} doubted" for B in warnings},
                         "" if args.step_costs else load_seen()))
    return sim


def exactness_table(model, runs, args) -> Table:
    """Every request of the continuous run generated alone, its tokens compared."""
    same, results = 0, runs[1].results
    for i, result in enumerate(results, 1):
        r = result.request
        same += result.tokens == mt.generate(model, list(r.prompt), r.max_new_tokens,
                                             eos_token_id=[], kv_dtype=args.kv_cache_dtype,
                                             attention=args.attention)
        if i % 8 == 0 or i == len(results):
            say(f"[{i}/{len(results)}] checked against generate: {same} identical")
    static_same = all(a.tokens == b.tokens
                      for a, b in zip(*(run.results for run in runs), strict=True))
    return Table("Exactness", chapter=False).note(
        f"tokens identical to generating each request alone: {same} of {len(results)} "
        f"(continuous); static gave the same tokens: {static_same}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_argument(parser)
    add_engine_arguments(parser)
    parser.add_argument("--num-blocks", type=int, default=None,
                        help="paged pool size (default: every slot can hold its longest "
                             "request, so nobody is preempted)")
    parser.add_argument("--prompt-len", type=positive_int, default=16, help="tokens per prompt")
    add_workload_arguments(parser)
    parser.add_argument("--rate", type=float, default=math.inf,
                        help="Poisson arrivals, requests/s (default: inf, all at t = 0)")
    parser.add_argument("--step-costs", metavar="FILE",
                        help="simulate at experiment 12's step costs (JSON) instead of the "
                             "ones this run measured")
    parser.add_argument("--check", action="store_true",
                        help="also generate every request alone and compare the tokens (slow)")
    add_cache_arguments(parser)
    add_threads_argument(parser)
    args = parser.parse_args(argv)

    ran_on = timing_header(args)
    model = load_model(args.model)
    try:
        lengths, requests = workload(args, model.config.vocab_size)
    except ValueError as e:
        parser.error(str(e))
    if args.num_blocks is None:
        args.num_blocks = pool_for(requests, args.slots, args.block_size)
    config = EngineConfig(max_num_seqs=args.slots, block_size=args.block_size,
                          num_gpu_blocks_override=args.num_blocks,
                          kv_cache_dtype=args.kv_cache_dtype, attention=args.attention)
    runs = [serve(model, requests, replace(config, policy=policy))
            for policy in ("static", "continuous")]
    engine_table(runs, lengths, args, ran_on).show()
    cost, warnings = step_costs(model, requests, runs, config, args)
    simulation_table(runs, lengths, cost, warnings, args).show()
    if args.check:
        exactness_table(model, runs, args).show()
    say("done")


if __name__ == "__main__":
    from _common import run
    run(main)
