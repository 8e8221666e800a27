"""Benchmark: the continuous-batching engine against the same requests served one at a time.

--requests requests with seeded random prompts and output lengths (end-of-sequence off, greedy)
are generated one after another with minitransformer.generate, then served by the engine with
each --slots count, all in this one run. Printed: wall seconds, tokens/s and the speedup of
each engine run over the sum of the single-request runs, and whether every request got the
same tokens both ways (it must: batching is exact).

What to expect: decode is memory-bound, so B rows in a step cost far less than B steps; on a
CPU through NumPy the gain is smaller than on a GPU (experiment 12 shows where the step stops
being cheap), and each prompt's prefill is paid the same both ways.
"""
import argparse
import time

import numpy as np

from _common import add_model_argument, load_model, mt, positive_int, progress
from minitransformer.engine import Engine, Request


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_argument(parser)
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--prompt-len", default="8-48", help="range of prompt lengths")
    parser.add_argument("--new-tokens", default="8-64", help="range of output lengths")
    parser.add_argument("--slots", default="4,8,16", help="engine slot counts to run")
    parser.add_argument("--block-size", type=positive_int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        p_lo, p_hi = (int(x) for x in args.prompt_len.split("-"))
        n_lo, n_hi = (int(x) for x in args.new_tokens.split("-"))
        slot_counts = [int(s) for s in args.slots.split(",")]
    except ValueError:
        parser.error("--prompt-len and --new-tokens take LO-HI, --slots a comma-separated list")
    if min(p_lo, n_lo, args.requests, *slot_counts) < 1 or p_lo > p_hi or n_lo > n_hi:
        parser.error("lengths, --requests and --slots must be >= 1, ranges LO <= HI")

    model = load_model(args.model)
    rng = np.random.default_rng(args.seed)
    requests = [Request(tuple(rng.integers(0, model.config.vocab_size,
                                           rng.integers(p_lo, p_hi + 1)).tolist()),
                        int(rng.integers(n_lo, n_hi + 1)), eos_token_id=[])
                for _ in range(args.requests)]
    tokens = sum(r.max_new_tokens for r in requests)
    mt.generate(model, [1, 2, 3], 2)  # warm-up

    solo, start = [], time.perf_counter()
    for i, r in enumerate(requests, 1):
        solo.append(mt.generate(model, list(r.prompt), r.max_new_tokens, eos_token_id=[]))
        if i % 4 == 0 or i == len(requests):
            progress(i, len(requests), f"one at a time: {time.perf_counter() - start:.1f} s")
    t_solo = time.perf_counter() - start

    rows = []
    for i, slots in enumerate(slot_counts, 1):
        engine = Engine(model, slots=slots, block_size=args.block_size)
        start = time.perf_counter()
        run = engine.run(requests)
        seconds = time.perf_counter() - start
        same = sum(r.tokens == s for r, s in zip(run.results, solo))
        rows.append((f"engine, {slots} slots", seconds, same, run.steps))
        progress(i, len(slot_counts), f"engine, {slots} slots: {seconds:.1f} s")

    print("Benchmark: continuous-batching engine vs the same requests one at a time")
    print(f"{len(requests)} requests, prompts {p_lo}-{p_hi} tokens, outputs {n_lo}-{n_hi} tokens "
          f"({tokens:,} new tokens in all), greedy; wall time of this one run")
    print()
    print(f"{'':<26}{'seconds':>9}{'tokens/s':>10}{'speedup':>9}{'steps':>7}"
          f"{'same tokens':>13}")
    print(f"{'one at a time (generate)':<26}{t_solo:>9.2f}{tokens / t_solo:>10.1f}"
          f"{1:>8.2f}x{'':>7}{'':>13}")
    for name, seconds, same, steps in rows:
        print(f"{name:<26}{seconds:>9.2f}{tokens / seconds:>10.1f}{t_solo / seconds:>8.2f}x"
              f"{steps:>7}{f'{same}/{len(requests)}':>13}")
    return 0 if all(same == len(requests) for _, _, same, _ in rows) else 1


if __name__ == "__main__":
    from _common import run
    run(main)
