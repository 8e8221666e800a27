"""Benchmark: the serving engine with and without speculative decoding, against batch size.

B concurrent streams (--batches: 1, 2, 4, 8, 16) are B greedy requests entering the engine
together, each making --new-tokens tokens (end of sequence off: both sides do the same work).
Two workloads: rewrite (each prompt holds a passage the answer repeats: the task where prompt
lookup pays) and free generation (short requests for a story: little to copy). Every setting
runs twice side by side, plain and speculating (--speculative-config, vLLM's JSON; prompt
lookup by default), --repeat rounds alternating, the fastest and the median printed.

A speedup is printed only where both sides made the same tokens for every request (greedy
speculation is exact; in the engine's default mode a token may still differ at a near tie, and
then the row says so instead of a figure). What to expect: one verification pass reads the
weights once for all the rows it verifies, so at batch 1 the accepted drafts come almost free;
as the batch grows the pass's arithmetic and attention grow with B x (drafts + 1) rows while
the weight read does not, and the speedup falls, below 1 at some batch: the crossover, printed
per workload (experiment 22 prints it beside its formula's prediction).

--draft drafts with a model instead (the config's method becomes draft_model): the distilled
draft experiment 23 cached in weights/drafts (``distilled``, its hard-label student; or
``distilled:soft1`` etc.) or the target's first N layers (``first:N``). The draft model
proposes for all streams at once, one batched draft pass per draft position (serve/drafting.py),
so its cost per step should grow far slower than B: the table gives it per step (CPU time in
the proposer, and its passes).

Every round is timed twice: wall (the engine's decode steps, as it times them) and CPU time
(time.process_time of the whole run, prefill included, which a loaded machine's waits do not
inflate, with one BLAS thread): on a shared machine the CPU ratio is the steadier figure.

The default speculation drafts up to 8 tokens and stops a sequence's drafting while its
acceptance is below 0.5 (``min_acceptance``, drafting.py). Long drafts: on a CPU most of a
verification's cost is the step from one row (a matrix-vector product) to a few (a matrix
product), which any draft pays; the rows after it cost little, so a right draft pays most when
long. The bar: free generation's lookups find some match most steps and are rarely right, and
each one rejected would cost that step.
"""
import argparse
import time
from dataclasses import dataclass, field, replace
from statistics import median

import numpy as np

from _common import (
    Progress,
    add_model_argument,
    add_threads_argument,
    load_model,
    model_name,
    positive_int,
    positive_ints,
    timing_header,
)
from _table import Table

from minitransformer.drafts import students
from minitransformer.kernels.blas import FEW_ROWS
from minitransformer.lookup import PASSAGE, TASK
from minitransformer.measure.timing import load_average, where_it_ran
from minitransformer.model import forward
from minitransformer.serve.config import EngineConfig, parse_speculative_config
from minitransformer.serve.engine import Engine
from minitransformer.serve.records import Request
from minitransformer.speculative import first_layers

WORKLOADS = ("rewrite", "free")
DEFAULT_CONFIG = ('{"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_max": 4, '
                  '"min_acceptance": 0.5}')
TOPICS = ("a lighthouse keeper", "a lost kitten", "a river in winter", "an old clock",
          "a baker at dawn", "a train at night", "a garden after rain", "a kite",
          "a library", "a fox in the snow", "a fishing boat", "a mountain path",
          "a market day", "a broken bicycle", "a letter from far away", "the first snow")


def prompts(model, workload: str, n: int) -> list:
    """n prompts of a workload as token ids (through the chat template when there is one).

    Rewrite: every stream the project's passage, the very prompt of one stream, so the batch
    size is all that changes (the passage with its sentences rotated, one prompt per stream,
    was rewritten loosely from some sentences, and a batch lasts as long as its slowest
    stream: 40 steps at 2 streams against 17 at 1). Free: a story, a topic per stream."""
    texts = ([TASK + PASSAGE] * n if workload == "rewrite" else
             [f"Write a short story about {TOPICS[i % len(TOPICS)]}." for i in range(n)])
    tok = model.tokenizer
    if tok is None:
        raise ValueError(f"{model.path}: no tokenizer.json, cannot encode the workloads")
    return [tok.chat_prompt([{"role": "user", "content": t}]) if tok.chat_template
            else tok.encode(t) for t in texts]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_argument(parser, default="smollm2")
    parser.add_argument("--batches", type=positive_ints, default="1,2,4,8,16",
                        help="concurrent streams (default: %(default)s)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS),
                        help=f"comma-separated from {', '.join(WORKLOADS)} (default: both)")
    parser.add_argument("--new-tokens", type=positive_int, default=64,
                        help="tokens per stream (default: %(default)s)")
    parser.add_argument("--speculative-config", default=DEFAULT_CONFIG, metavar="JSON",
                        help=f"vLLM's speculative config (default: {DEFAULT_CONFIG})")
    parser.add_argument("--draft", metavar="DRAFT",
                        help="draft with a model: 'distilled' (or 'distilled:NAME', NAME one "
                             f"of {', '.join(students.SHORT)}; default hard) or 'first:N' "
                             "(the target's first N layers); default: the config's method")
    parser.add_argument("--repeat", type=positive_int, default=3,
                        help="timed rounds of each side, alternating (default: %(default)s)")
    add_threads_argument(parser)
    args = parser.parse_args(argv)
    workloads = args.workloads.split(",")
    if not set(workloads) <= set(WORKLOADS) or not workloads:
        parser.error(f"--workloads: choose from {', '.join(WORKLOADS)}, got {args.workloads!r}")
    try:
        spec = parse_speculative_config(args.speculative_config)
    except ValueError as e:
        parser.error(f"--speculative-config: {e}")
    if spec.method != "ngram" and args.draft is None:
        parser.error("--speculative-config: method draft_model needs --draft (the model)")
    timing_header(args)     # --threads applied before the load; show() prints the line
    model = load_model(args.model)
    draft = None
    if args.draft is not None:
        draft = draft_model(model, args.draft)
        spec = replace(spec, method="draft_model", model=args.draft)
    n, batches = args.new_tokens, args.batches
    prime(model)
    progress = Progress(len(workloads) * len(batches), "settings")
    results = {}
    for workload in workloads:
        ids = prompts(model, workload, max(batches))
        for B in batches:
            results[workload, B] = side_by_side(model, ids[:B], n, spec, args.repeat, draft)
            r = results[workload, B]
            progress(f"{workload}, {B} streams: decode plain {min(r.plain):.2f} s, "
                     f"speculating {min(r.spec):.2f} s, same tokens {r.same}/{B}")
    show(model, results, workloads, n, args, spec)
    return 0 if all(r.same == B for (_, B), r in results.items()) else 1


def draft_model(target, name: str):
    """--draft -> the draft Model: 'first:N', or 'distilled[:NAME]' from experiment 23's
    cache (never trained here: a ValueError says how to make it)."""
    if name.startswith("first:"):
        try:
            return first_layers(target, int(name[len("first:"):]))
        except ValueError as e:
            raise ValueError(f"--draft {name}: {e}") from None
    what, _, short = name.partition(":")
    short = short or "hard"
    if what != "distilled" or short not in students.SHORT:
        raise ValueError(f"--draft {name!r}: use 'first:N' or 'distilled[:NAME]', NAME one of "
                         f"{', '.join(students.SHORT)}")
    settings = students.Settings()
    if not students.students_file(target, settings).is_file():
        raise ValueError(f"--draft {name}: no distilled draft cached for this model in "
                         f"weights/drafts: run scripts/exp23_soft_labels.py first")
    d = students.distilled(target, settings)
    (_, make), = students.drafts_of(target, d, [short])
    return make()


def prime(model) -> None:
    """One pass over every row count the products measure (blas.FEW_ROWS): the route each
    shape takes is timed on its first use, and a verification pass meets row counts a
    plain decode never does; timed here, before either side is."""
    for rows in range(1, FEW_ROWS + 1):
        forward(model, np.zeros((rows, 1), dtype=np.int64))


@dataclass
class Sides:
    plain: list = field(default_factory=list)   # decode seconds per round
    spec: list = field(default_factory=list)
    plain_wall: list = field(default_factory=list)  # whole runs, prefill included
    spec_wall: list = field(default_factory=list)
    plain_cpu: list = field(default_factory=list)   # whole runs' CPU seconds (process_time)
    spec_cpu: list = field(default_factory=list)
    drafting: list = field(default_factory=list)    # CPU seconds in the proposer per step
    same: int = 0               # streams with the same tokens both ways (every round)
    counters: object = None     # the speculating engine's SpecCounters (last round)
    steps: tuple = (0, 0)       # engine steps, plain and speculating
    passes: float = 0.0         # draft model passes per speculating step (last round)
    load: float = 0.0           # the highest 1-minute load average seen

    @property
    def speedup(self) -> float:
        """Decode time plain over speculating, fastest rounds."""
        return min(self.plain) / min(self.spec)


def side_by_side(model, ids, n: int, spec, repeat: int, draft=None) -> Sides:
    """B = len(ids) streams, plain and speculating, `repeat` rounds alternating who goes
    first -> their decode seconds (the engine's decode steps, timed by it), wall and CPU
    seconds, and the speculating side's CPU seconds in its proposer."""
    requests = [Request(tuple(p), n, eos_token_id=[]) for p in ids]
    out, same = Sides(), None
    for r in range(repeat):
        runs = {}
        for side in (("plain", "spec") if r % 2 == 0 else ("spec", "plain")):
            config = EngineConfig(max_num_seqs=len(ids),
                                  speculative_config=spec if side == "spec" else None)
            engine = Engine(model, config, history=True, draft_model=draft)
            spent = time_proposals(engine) if side == "spec" else None
            start, cpu = time.perf_counter(), time.process_time()
            run = engine.run(requests)
            getattr(out, f"{side}_cpu").append(time.process_time() - cpu)
            getattr(out, f"{side}_wall").append(time.perf_counter() - start)
            getattr(out, side).append(sum(t for _, t in engine.decode_times))
            runs[side] = (run, engine)
            if spent is not None:
                out.drafting.append(spent[0] / max(1, run.steps - 1))
        now = sum(a.tokens == b.tokens for a, b in zip(runs["plain"][0].results,
                                                       runs["spec"][0].results, strict=True))
        same = now if same is None else min(same, now)
        speculating = runs["spec"][1].speculator
        out.counters = speculating.counters
        out.steps = (runs["plain"][0].steps, runs["spec"][0].steps)
        drafter = speculating.proposer.draft
        out.passes = 0.0 if drafter is None else drafter.passes / max(1, out.steps[1] - 1)
        out.load = max(out.load, load_average() or 0.0)
    out.same = same
    return out


def time_proposals(engine) -> list:
    """Count the CPU seconds the engine's proposer spends proposing -> [seconds], growing."""
    proposer, spent = engine.speculator.proposer, [0.0]
    propose = proposer.propose

    def timed(asks):
        start = time.process_time()
        try:
            return propose(asks)
        finally:
            spent[0] += time.process_time() - start
    proposer.propose = timed
    return spent


def crossover(rows: dict):
    """{batch: Sides} -> the smallest batch whose speedup is below 1, None if none is; a
    batch whose two sides made different tokens has no speedup and counts for nothing."""
    return next((B for B, r in sorted(rows.items()) if r.same == B and r.speedup < 1), None)


def summary(workload: str, rows: dict) -> str:
    """A workload's line: its speedup at the smallest batch and where it falls below 1."""
    first = min(rows)
    at_first = (f"{rows[first].speedup:.2f}x at {first} stream(s)" if rows[first].same == first
                else f"no speedup at {first} stream(s): tokens differ")
    B = crossover(rows)
    return (f"{workload}: {at_first}; " + (f"below 1 from {B} streams" if B is not None else
                                            f"not below 1 up to {max(rows)} streams"))


def show(model, results, workloads, n, args, spec) -> None:
    def x(v):
        return f"{v:.2f}x"

    load = max(r.load for r in results.values())
    table = Table(f"Benchmark: speculative decoding in the engine, {model_name(model)}",
                  columns=[("workload", ""), ("streams", "d"), ("plain tok/s", ".1f"),
                           ("spec tok/s", ".1f"), ("speedup", ""), ("median", ""),
                           ("end to end", ""), ("CPU", ""), ("CPU median", ""),
                           ("draft ms/step", ".1f"), ("draft passes/step", ".2f"),
                           ("steps", ""), ("accepted", ".2f"), ("tokens/draft", ".2f"),
                           ("same", "")])
    table.header(f"{n} new tokens per stream, greedy, end of sequence off; speculation: "
                 f"{describe(spec, args)}", timing_header(args), where_it_ran(),
                 f"decode: the engine's decode steps (the first token of each stream comes "
                 f"from its prefill, the same both ways); the fastest and the median of "
                 f"{args.repeat} rounds, the two sides alternating",
                 f"the highest 1-minute load average seen: {load:.1f}" +
                 (" -- MEASURED UNDER LOAD: rerun on a quiet machine" if load > 1.5 else ""))
    for (workload, B), r in results.items():
        c = r.counters
        exact = r.same == B
        tokens = B * (n - 1)            # decode tokens per run (a stream's first: prefill)
        table.row(workload, B, tokens / min(r.plain), tokens / min(r.spec),
                  x(r.speedup) if exact else "tokens differ",
                  x(median(r.plain) / median(r.spec)) if exact else "",
                  x(min(r.plain_wall) / min(r.spec_wall)) if exact else "",
                  x(min(r.plain_cpu) / min(r.spec_cpu)) if exact else "",
                  x(median(r.plain_cpu) / median(r.spec_cpu)) if exact else "",
                  1000 * min(r.drafting), r.passes, f"{r.steps[0]}/{r.steps[1]}",
                  c.accepted_tokens / c.draft_tokens if c.draft_tokens else 0.0,
                  1 + c.accepted_tokens / c.drafts if c.drafts else 1.0, f"{r.same}/{B}")
    table.note("speedup: decode time plain over speculating (fastest rounds; median beside; "
               "end to end: whole runs, prefill included; CPU: whole runs' CPU time, fastest "
               "and median); printed only where every stream got the same tokens both ways "
               "in every round",
               "draft ms/step: CPU time in the proposer per speculating step (fastest round); "
               "draft passes/step: a draft model's forward passes per step (one per draft "
               "position, whatever the streams)",
               "steps: engine steps plain / speculating; accepted: accepted / drafted tokens; "
               "tokens/draft: tokens a verified draft yields (1 + accepted / drafts)",
               *(summary(w, {B: r for (v, B), r in results.items() if v == w})
                 for w in workloads))
    table.show()


def describe(spec, args) -> str:
    """The speculation as the table names it: the JSON given, and the draft model if any."""
    return args.speculative_config + (f"; draft model: {args.draft}" if args.draft else "")


if __name__ == "__main__":
    from _common import run
    run(main)
