"""Benchmark: the continuous-batching engine against the same requests served one at a time.

--requests requests with seeded random prompts and output lengths (end-of-sequence off, greedy)
are generated one after another with minitransformer.generate, then served by the engine with
each --slots count, all in this one run, side by side, --repeat times (the fastest and the
median printed). Printed: wall seconds, tokens/s and the speedup of each engine run over the sum
of the single-request runs, and whether every request got the same tokens both ways (it must:
batching is exact).

What to expect: decode is memory-bound, so B rows in a step cost far less than B steps; on a
CPU through NumPy the gain is smaller than on a GPU (experiment 12 shows where the step stops
being cheap), and each prompt's prefill is paid the same both ways.
"""
import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: _common, _table

from _common import (
    Progress,
    add_engine_arguments,
    add_model_argument,
    add_threads_argument,
    add_timing_arguments,
    load_model,
    positive_int,
    positive_ints,
    timing_header,
)
from _table import Table

import minitransformer as mt
from minitransformer.measure.timing import time_together
from minitransformer.serve.config import EngineConfig
from minitransformer.serve.engine import Engine
from minitransformer.serve.records import Request


def span(text):
    """argparse type: 'LO-HI', two integers 1 <= LO <= HI -> (LO, HI)."""
    try:
        lo, hi = (int(x) for x in text.split("-"))
    except ValueError:
        lo = hi = 0
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"expected LO-HI with 1 <= LO <= HI, got {text!r}")
    return lo, hi


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_argument(parser)
    parser.add_argument("--requests", type=positive_int, default=24)
    parser.add_argument("--prompt-len", type=span, default="8-48", help="range of prompt lengths")
    parser.add_argument("--new-tokens", type=span, default="8-64", help="range of output lengths")
    parser.add_argument("--slots", type=positive_ints, default="4,8,16",
                        help="engine slot counts to run")
    add_engine_arguments(parser, slots=None)
    add_timing_arguments(parser, repeat=2, runs="runs of each way, side by side,")
    add_threads_argument(parser)
    args = parser.parse_args(argv)
    (p_lo, p_hi), (n_lo, n_hi), slot_counts = args.prompt_len, args.new_tokens, args.slots

    ran_on = timing_header(args)
    model = load_model(args.model)
    rng = np.random.default_rng(args.seed)
    requests = [Request(tuple(rng.integers(0, model.config.vocab_size,
                                           rng.integers(p_lo, p_hi + 1)).tolist()),
                        int(rng.integers(n_lo, n_hi + 1)), eos_token_id=[])
                for _ in range(args.requests)]
    tokens = sum(r.max_new_tokens for r in requests)
    mt.generate(model, [1, 2, 3], 2)  # warm-up

    progress, solo, runs = Progress((1 + len(slot_counts)) * args.repeat, "runs"), [], {}

    def one_at_a_time():
        solo[:] = [mt.generate(model, list(r.prompt), r.max_new_tokens, eos_token_id=[])
                   for r in requests]
        progress("one at a time")

    def engine_run(slots):
        def serve():
            config = EngineConfig(max_num_seqs=slots, block_size=args.block_size)
            runs[slots] = Engine(model, config).run(requests)
            progress(f"engine, {slots} slots")
        return serve

    t_solo, *t_engine = time_together([one_at_a_time, *(engine_run(s) for s in slot_counts)],
                                      warmup=0, repeat=args.repeat)
    table = Table("Benchmark: continuous-batching engine vs the same requests one at a time",
                  columns=[("", ""), ("seconds", ".2f"), ("median s", ".2f"),
                           ("tokens/s", ".1f"), ("speedup", lambda v: f"{v:.2f}x"),
                           ("steps", "d"), ("same tokens", "")])
    table.header(f"{len(requests)} requests, prompts {p_lo}-{p_hi} tokens, outputs {n_lo}-{n_hi} "
                 f"tokens ({tokens:,} new tokens in all), greedy; the fastest and the median of "
                 f"{args.repeat}+ runs of each way, side by side", ran_on)
    table.row("one at a time (generate)", t_solo.best, t_solo.median, tokens / t_solo.best, 1.0,
              None, None)
    rows = []
    for slots, t in zip(slot_counts, t_engine, strict=True):
        same = sum(r.tokens == s for r, s in zip(runs[slots].results, solo, strict=True))
        rows.append(same)
        table.row(f"engine, {slots} slots", t.best, t.median, tokens / t.best,
                  t_solo.best / t.best, runs[slots].steps, f"{same}/{len(requests)}")
    table.show()
    return 0 if all(same == len(requests) for same in rows) else 1


if __name__ == "__main__":
    from _common import run
    run(main)
