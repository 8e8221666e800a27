"""Experiment 12: batched decode, B = 1 ... 32 sequences each holding a 64-token cache.

Every sequence has its own 64-token prompt, prefilled alone into the paged cache the engine
uses; then B of them decode one token together in one step (model.forward), timed as the
fastest of --repeat steps (the least disturbed by other work on the machine; each step is
rolled back, so the cache stays at 64 tokens). Printed per B: step latency, tokens/s, both
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

--save-step-costs FILE writes {"batch size": seconds} for experiment 13's simulation.
"""
import argparse
import json
import time

import numpy as np

from _common import add_model_argument, load_model, progress, say
from minitransformer.backend import synchronize, to_device
from minitransformer.generate import last_logits
from minitransformer.kvcache import KVCache
from minitransformer.model import forward
from minitransformer.paged import PagedCache, gather


def best_steps(steps, rollbacks, repeat):
    """Fastest seconds of each step over `repeat` rounds after a warm-up, the steps taken in
    turn within a round (so a burst of load elsewhere hits them alike), each rolled back."""
    times = [[] for _ in steps]
    for _ in range(repeat + 1):
        for step, rollback, t in zip(steps, rollbacks, times):
            synchronize()
            start = time.perf_counter()
            step()
            synchronize()
            t.append(time.perf_counter() - start)
            rollback()
    return [min(t[1:]) for t in times]


def fill(model, B, context, block_size, seed):
    """B sequences of `context` random tokens, each prefilled alone -> (paged cache, the same
    keys/values copied into a contiguous KVCache)."""
    rng = np.random.default_rng(seed)
    blocks = -(-(context + 1) // block_size)
    cache = PagedCache.allocate(model.config, B * blocks, block_size)
    start = time.perf_counter()
    for b in range(B):
        prompt = rng.integers(0, model.config.vocab_size, context).tolist()
        cache.add(b, prompt)
        forward(model, np.array([prompt]), cache.view([b]))
        if (b + 1) % 8 == 0 or b + 1 == B:
            progress(b + 1, B, f"prefilled {context}-token caches "
                               f"({time.perf_counter() - start:.1f} s)")
    kv = KVCache.allocate(model.config, B, context + 1)
    for layer in range(model.config.num_hidden_layers):
        table = to_device(np.array([cache.seqs[b].blocks for b in range(B)]))
        kv.k[layer][:, :, :context] = gather(cache.k[layer], table, context)
        kv.v[layer][:, :, :context] = gather(cache.v[layer], table, context)
    kv.lengths[:] = context
    return cache, kv


def knee(sizes, tps, gain):
    """The first B whose doubling (when measured) buys less than `gain` more tokens/s."""
    at = dict(zip(sizes, tps))
    for B in sizes:
        if 2 * B in at and at[2 * B] / at[B] - 1 < gain:
            return B
    return None


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_argument(parser)
    parser.add_argument("--batch-sizes", default="1,2,4,8,16,24,32",
                        help="comma-separated (default: %(default)s)")
    parser.add_argument("--context", type=int, default=64, help="tokens cached per sequence")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=15, help="timed steps per batch size")
    parser.add_argument("--knee-gain", type=float, default=0.25,
                        help="a doubling that buys less than this is past the knee "
                             "(default: %(default)s)")
    parser.add_argument("--save-step-costs", metavar="FILE",
                        help="write the paged step latencies as JSON {batch size: seconds}")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        sizes = sorted({int(b) for b in args.batch_sizes.split(",")})
    except ValueError:
        parser.error(f"--batch-sizes {args.batch_sizes!r}: expected integers like 1,2,4")
    if sizes[0] < 1 or args.context < 1 or args.repeat < 1 or args.block_size < 1:
        parser.error("batch sizes, --context, --repeat and --block-size must be >= 1")

    model = load_model(args.model)
    cache, kv = fill(model, sizes[-1], args.context, args.block_size, args.seed)
    ids = np.random.default_rng(args.seed + 1).integers(0, model.config.vocab_size, sizes[-1])
    paged, contiguous, exact = [], [], []
    for i, B in enumerate(sizes, 1):
        rows = list(range(B))

        def step_paged(batch_invariant=False):  # as the engine does it: room, then the step
            cache.make_room(rows, 1)
            return last_logits(model, forward(model, ids[:B, None], cache.view(rows),
                                              batch_invariant), batch_invariant)

        def step_contiguous():
            rows_kv = KVCache([k[:B] for k in kv.k], [v[:B] for v in kv.v], kv.lengths[:B])
            last_logits(model, forward(model, ids[:B, None], rows_kv))

        def rollback_paged():
            for b in rows:
                cache.trim(b, 1)

        def rollback_contiguous():
            kv.lengths[:] = args.context

        p, e, c = best_steps([step_paged, lambda: step_paged(True), step_contiguous],
                             [rollback_paged, rollback_paged, rollback_contiguous], args.repeat)
        paged.append(p)
        exact.append(e)
        contiguous.append(c)
        progress(i, len(sizes), f"B={B}: {p * 1e3:.1f} ms paged ({e * 1e3:.1f} ms "
                                f"batch-invariant), {c * 1e3:.1f} ms contiguous")
    fast_logits = step_paged()           # B = the largest, once more each way, for the bits
    rollback_paged()
    exact_logits = step_paged(True)
    rollback_paged()

    tps = [B / t for B, t in zip(sizes, paged)]
    print(f"Experiment 12: batched decode, each sequence holding a {args.context}-token cache "
          f"and decoding one token")
    print(f"(fastest of {args.repeat} steps; paged cache, block size {args.block_size}; "
          "the contiguous column runs model.forward on a KVCache)")
    print()
    print(f"{'':>4}{'':>11}{'':>10}{'vs B = 1':^20}{'vs previous row':^20}")
    print(f"{'B':>4}{'step (ms)':>11}{'tokens/s':>10}{'latency':>10}{'tokens/s':>10}"
          f"{'latency':>10}{'tokens/s':>10}{'contiguous (ms)':>17}")
    for i, (B, t, c) in enumerate(zip(sizes, paged, contiguous)):
        previous = f"{'':>20}" if i == 0 else \
            f"{t / paged[i - 1]:>9.2f}x{tps[i] / tps[i - 1]:>9.2f}x"
        print(f"{B:>4}{t * 1e3:>11.1f}{tps[i]:>10.1f}{t / paged[0]:>9.2f}x"
              f"{tps[i] / tps[0]:>9.2f}x{previous}{c * 1e3:>17.1f}")
    print()
    at = dict(zip(sizes, zip(paged, tps)))
    print("chapter: 1 -> 16: throughput x6.0, latency x2.67; "
          "16 -> 32: throughput +9%, latency ~x2")
    parts = [f"{a} -> {b}: throughput x{at[b][1] / at[a][1]:.2f} "
             f"({at[b][1] / at[a][1] - 1:+.0%}), latency x{at[b][0] / at[a][0]:.2f}"
             for a, b in ((1, 16), (16, 32)) if a in at and b in at]
    print("here:    " + ("; ".join(parts) if parts else "(needs batch sizes 1, 16, 32)"))
    print()
    print(f"Two ways to batch (paged): one flat matrix per projection (the default) vs row by row "
          f"(batch_invariant=True)")
    print(f"{'B':>4}{'flat (ms)':>11}{'tokens/s':>10}{'vs B = 1':>10}"
          f"{'row by row (ms)':>17}{'tokens/s':>10}{'vs B = 1':>10}")
    for B, t, e in zip(sizes, paged, exact):
        print(f"{B:>4}{t * 1e3:>11.1f}{B / t:>10.1f}{B / t / tps[0]:>9.2f}x"
              f"{e * 1e3:>17.1f}{B / e:>10.1f}{B * exact[0] / e:>9.2f}x")
    differ = int((fast_logits != exact_logits).sum())
    changed = int((fast_logits.argmax(-1) != exact_logits.argmax(-1)).sum())
    print(f"at B = {sizes[-1]}: {differ:,} of {fast_logits.size:,} logits differ between the two "
          f"(max |difference| {np.abs(fast_logits - exact_logits).max():.1e}); greedy token "
          f"changed in {changed} of {sizes[-1]} rows")
    print()
    k = knee(sizes, tps, args.knee_gain)
    print(f"knee: B = {k} (doubling to {2 * k} buys {at[2 * k][1] / at[k][1] - 1:+.0%} "
          f"tokens/s, under {args.knee_gain:.0%})" if k else
          f"knee: not reached (every measured doubling buys {args.knee_gain:.0%} or more)")
    if args.save_step_costs:
        with open(args.save_step_costs, "w") as f:
            json.dump({str(B): t for B, t in zip(sizes, paged)}, f, indent=1)
        say(f"step costs written to {args.save_step_costs}")


if __name__ == "__main__":
    main()
