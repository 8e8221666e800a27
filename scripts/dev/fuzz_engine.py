"""Fuzz the serving engine: many random workloads, every invariant checked after every step.

The cases are tests/engine_fuzz.py's (the CI test runs a few of them): random slots, block
sizes, pools from tight (waiting, preemption, eviction) to roomy, shared and repeated prompts,
greedy and seeded sampling, eos on or off, cancels at random steps, both policies, prefix
caching on or off, chunked prefill on or off. Checked after every step: the paged cache's books
(refcounts equal to the block tables holding each block, the free list and the kept blocks
exactly the unheld ones, names consistent); tokens so far equal to ``generate`` alone for a
request the exactness policy calls exact (batch-invariant mode, prompt prefilled whole, nothing
cached; --fast checks the default mode); every other request by the near-tie policy at the
end; at the end: zero blocks held and every request returned.

Runs on the tiny random models of tests/conftest.py (made in a temporary directory), or on
--model PATH. Prints one line per model (cases, requests, steps, preemptions, cancels,
rejections, requests that found a cached prefix, blocks evicted from the prefix cache, cases
with chunked prefill, failures); a failing case prints its seed and what
broke, and the exit status is 1. Reproduce one with --first SEED --cases 1.
"""
import argparse
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: _common, _table

from _common import add_model_argument, load_model, progress

import minitransformer as mt

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from conftest import CLOSE_CALLS, SHAPES, write_checkpoint
from engine_fuzz import run_case

COLUMNS = ("requests", "steps", "preemptions", "cancelled", "rejected", "cached", "evicted",
           "chunked")


def fuzz(label, model, seeds, batch_invariant) -> tuple:
    """-> (Counter of the case counts, [(seed, message) for each failing case])."""
    totals, failures, start = Counter(), [], time.perf_counter()
    for i, seed in enumerate(seeds, 1):
        try:
            counts = run_case(model, seed, batch_invariant)
            totals.update({k: v for k, v in counts.items() if k in COLUMNS})
        except Exception as e:
            first = str(e).splitlines()[0] if str(e) else ""
            failures.append((seed, f"{type(e).__name__}: {first}"))
        if i % 10 == 0 or i == len(seeds):
            progress(i, len(seeds), f"{label}: {len(failures)} failing, "
                                    f"{time.perf_counter() - start:.1f} s")
    return totals, failures


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_argument(parser, default=None)   # None: the tiny test models
    parser.add_argument("--cases", type=int, default=200, help="random workloads per model")
    parser.add_argument("--first", type=int, default=0, help="seed of the first case")
    parser.add_argument("--fast", action="store_true",
                        help="fuzz the default fast batching (tokens may differ at near ties, "
                             "tests/conftest.py's policy) instead of batch-invariant mode (==)")
    parser.add_argument("--models", default=",".join(SHAPES | CLOSE_CALLS),
                        help="tiny test models to fuzz when --model is not given "
                             "(default: %(default)s; the last has small logits and close "
                             "calls, where a logit error shows most in --fast)")
    args = parser.parse_args(argv)
    if args.cases < 1 or args.first < 0:
        parser.error("--cases must be >= 1 and --first >= 0")
    names = [n for n in args.models.split(",") if n]
    unknown = [n for n in names if n not in SHAPES | CLOSE_CALLS]
    if unknown or not names:
        parser.error(f"unknown model(s) {', '.join(unknown) or '(none)'}; "
                     f"choose from {', '.join(SHAPES | CLOSE_CALLS)}")
    seeds = range(args.first, args.first + args.cases)

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        if args.model:
            models = [(args.model, load_model(args.model))]
        else:
            models = [(name, mt.load(write_checkpoint(os.path.join(tmp, name), name, seed=1)))
                      for name in names]
        for label, model in models:
            rows.append((label, *fuzz(label, model, seeds, not args.fast)))

    mode = "fast batching, near ties allowed" if args.fast else \
        "batch-invariant, tokens == where exact"
    print(f"Engine fuzz: {args.cases} random workloads per model (seeds {seeds.start}.."
          f"{seeds.stop - 1}; {mode}), every invariant checked after every step")
    print()
    print(f"{'model':<24}" + "".join(f"{c:>12}" for c in COLUMNS) + f"{'failing':>9}")
    for label, totals, failures in rows:
        print(f"{label:<24}" + "".join(f"{totals[c]:>12,}" for c in COLUMNS)
              + f"{len(failures):>9}")
    for label, _, failures in rows:
        for seed, message in failures:
            print(f"  {label}, seed {seed}: {message}")
    return 1 if any(failures for _, _, failures in rows) else 0


if __name__ == "__main__":
    from _common import run
    run(main)
