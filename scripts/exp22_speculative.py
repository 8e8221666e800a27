"""Experiment 22, the measured half: quantized copies of the target as speculative drafts.

For each draft: its acceptance rate alpha (agreement with the target's greedy tokens over 144
positions given the same prefix, as in experiment 21) and its cost c per token relative to the
target, measured two ways: wall-clock here, and weight bytes (what a memory-bound decode step
reads, so what c would be with a fused low-bit kernel). Then real speculative runs of 144
tokens for each gamma: tokens per verification pass and wall-clock speedup over plain greedy
`generate`, beside what sim.speculative predicts from alpha and c. The formula assumes that
verifying gamma + 1 positions costs one decode step (true where decode is memory-bound); on a
CPU it costs more, so the measured cost v of that pass is printed and used as well. Every
run's tokens are compared with plain greedy's: speculative decoding must not change one.

The drafts: the target itself (alpha = 1: the ceiling), each quantization scheme of
quant/qmodel.py, and the target's own first layers (an early-exit draft, cheaper here for
real). A quantized draft runs on its codes and scales (quant/matmul.py converts a block of
rows at a time), so its c (time) is what this CPU gives and its c (bytes) what a memory-bound
device would.
"""
import argparse
import time

import numpy as np

from _common import add_model_argument, encode_prompt, load_model, mt, progress
from minitransformer.kvcache import KVCache
from minitransformer.model import forward
from minitransformer.speculative import first_layers, speculative_generate
from quant.evaluate import agreement, reference_tokens
from quant.qmodel import SCHEMES, quantize_model, resident_bytes
from sim.speculative import expected_tokens, speedup


def weight_bytes(model) -> int:
    """Bytes of the weights one decode step reads (layers past the config's count unused)."""
    used = {n: w for n, w in model.weights.items()
            if ".layers." not in n or int(n.split(".")[2]) < model.config.num_hidden_layers}
    return sum(resident_bytes(used).values())


def drafts(target):
    """-> [(label, draft for alpha, draft to run)]: quantized drafts differ in the two."""
    L = target.config.num_hidden_layers
    out = [("target itself", target, target)]
    for scheme in SCHEMES.values():
        q = quantize_model(target, scheme.name)
        out.append((scheme.label, q, q))
    for n in sorted({L - 1, L // 2} - {0}, reverse=True):
        draft = first_layers(target, n)
        out.append((f"first {n} of {L} layers", draft, draft))
    return out


def race(fns, repeats, budget=1.0):
    """Time the functions in turn, round after round -> (their results, fastest times).

    At least `repeats` rounds, and more (up to 10) while they take under `budget` seconds in
    all. Interleaving puts every function under the same load, so ratios of the fastest times
    hold up on a busy machine where one unlucky baseline would skew them all."""
    results, times = [None] * len(fns), [[] for _ in fns]
    while len(times[0]) < repeats or (len(times[0]) < 10 and sum(map(sum, times)) < budget):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            results[i] = fn()
            times[i].append(time.perf_counter() - start)
    return results, [min(t) for t in times]


def verify_cost(model, ids, gamma, repeats) -> float:
    """Time of one target pass over gamma + 1 positions, in one-token decode steps."""
    def step(n):
        kv = KVCache.allocate(model.config, 1, len(ids) + n)
        forward(model, np.array([ids]), kv)
        return lambda: (forward(model, np.array([ids[-n:]]), kv), kv.trim(n))
    _, (t_verify, t_decode) = race([step(gamma + 1), step(1)], repeats, budget=0.2)
    return t_verify / t_decode


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_argument(parser, default="smollm2")
    parser.add_argument("--prompt", default="Once upon a time",
                        help="prompt text (default: %(default)r)")
    parser.add_argument("--positions", type=int, default=144,
                        help="tokens generated, and positions alpha is measured over "
                             "(default: %(default)s)")
    parser.add_argument("--gammas", default="2,4,8",
                        help="draft lengths, comma-separated (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="least timed runs of each measurement, more while they take under "
                             "--time-budget s a draft; the fastest counts (default: %(default)s)")
    parser.add_argument("--time-budget", type=float, default=1.0, metavar="SECONDS",
                        help="keep timing each draft while under this (default: %(default)s)")
    args = parser.parse_args(argv)
    try:
        gammas = [int(g) for g in args.gammas.split(",")]
    except ValueError:
        parser.error(f"--gammas must be integers separated by commas, got {args.gammas!r}")
    if args.positions < 1 or args.repeats < 1 or min(gammas) < 1:
        parser.error("--positions, --repeats and every gamma must be >= 1")

    target = load_model(args.model)
    ids = encode_prompt(target, args.prompt)
    n = args.positions
    mt.generate(target, ids, 2)  # warm-up: first-call allocations out of the timings
    plain = reference_tokens(target, ids, n)
    target_bytes = weight_bytes(target)

    rows, candidates = [], drafts(target)
    for i, (label, scored, runner) in enumerate(candidates, 1):
        alpha = agreement(scored, ids, plain) / n
        # timed side by side: plain greedy, the draft alone, then speculative at each gamma
        results, times = race(
            [lambda: reference_tokens(target, ids, n),
             lambda: mt.generate(runner, ids, n, eos_token_id=[])] +
            [lambda g=g: speculative_generate(target, runner, ids, n, gamma=g, eos_token_id=[])
             for g in gammas], args.repeats, budget=args.time_budget)
        c_bytes = weight_bytes(scored) / target_bytes
        rows.append((label, alpha, times[1] / times[0], c_bytes,
                     [(g, r, times[0] / t) for g, r, t in zip(gammas, results[2:], times[2:])]))
        progress(i, len(candidates), f"{label}: alpha {alpha:.3f}, c {times[1] / times[0]:.2f} "
                 f"(time) {c_bytes:.3f} (bytes); plain greedy {times[0]:.2f} s")
    costs = {g: verify_cost(target, ids + plain, g, args.repeats) for g in gammas}

    print(f"Experiment 22 (measured): speculative decoding, {len(ids)}-token prompt, "
          f"{n} tokens, greedy")
    print()
    print("c: a draft token's cost as a fraction of a target token's, measured as wall time")
    print("here and as weight bytes read (what it is for a memory-bound step on a GPU)")
    print(f"{'draft':<24}{'alpha':>8}{'c (time)':>10}{'c (bytes)':>11}")
    for label, alpha, c_time, c_bytes, _ in rows:
        print(f"{label:<24}{alpha:>8.3f}{c_time:>10.2f}{c_bytes:>11.3f}")
    print()
    print("formula: tokens/pass = (1 - alpha^(gamma+1)) / (1 - alpha), "
          "speedup = tokens/pass / (gamma * c + v)")
    print("with v = 1 (the chapter: verifying costs one decode step) or v measured here (below)")
    print(f"{'':<30}{'tokens / pass':>18}{'speedup, c (time)':>28}{'speedup':>11}")
    print(f"{'draft':<24}{'gamma':>6}{'formula':>9}{'measured':>9}{'v = 1':>9}{'v here':>9}"
          f"{'measured':>10}{'c (bytes)':>11}{'same':>6}")
    same_everywhere = True
    for label, alpha, c_time, c_bytes, runs in rows:
        for gamma, result, measured in runs:
            same = result.tokens == plain
            same_everywhere &= same
            with_v = expected_tokens(alpha, gamma) / (gamma * c_time + costs[gamma])
            print(f"{label:<24}{gamma:>6}{expected_tokens(alpha, gamma):>9.2f}"
                  f"{result.tokens_per_pass:>9.2f}{speedup(alpha, gamma, c_time):>8.2f}x"
                  f"{with_v:>8.2f}x{measured:>9.2f}x{speedup(alpha, gamma, c_bytes):>10.2f}x"
                  f"{'yes' if same else 'NO':>6}")
    print()
    print("v: one verification pass over gamma + 1 positions, in one-token decode steps")
    print("  " + "   ".join(f"gamma {g}: {v:.2f}" for g, v in costs.items()))
    print(f"tokens identical to plain greedy in every run: {'yes' if same_everywhere else 'NO'}")
    return 0 if same_everywhere else 1


if __name__ == "__main__":
    from _common import run
    run(main)
