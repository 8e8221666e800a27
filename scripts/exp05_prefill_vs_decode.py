"""Experiment 5: prefill against decode, in one generation with the KV cache.

One run generates N tokens greedily after a P-token prompt: the prefill pass over the prompt
makes the first token, then N - 1 decode steps make one token each. Every phase is timed (the
forward pass, the head on the last position and the argmax). The chapter's run, 40 prompt tokens
and 48 new ones on a laptop GPU:

    prefill, 40 prompt tokens : 1.0224 s   ->  25.6 ms per token
    decode,  47 steps         : 0.1665 s mean per step

a 6x gap per token, and the cheap tokens are the prompt's: a prefill pass multiplies matrices
by matrices (P rows at once), a decode step multiplies them by one vector and spends its time
reading the weights.

One run is a sample of a noisy machine, so the run is repeated: --warmup runs are discarded,
then each figure is the fastest and the median over --repeat runs (of the prefill time; of each
run's mean decode step), with more runs pooled in while the median sits far above the fastest.
"""
import argparse
import statistics

import numpy as np

from _common import (
    Progress,
    add_model_argument,
    add_prompt_arguments,
    add_threads_argument,
    add_timing_arguments,
    load_model,
    timing_header,
)
from _table import Table

from minitransformer.generate import last_logits
from minitransformer.kvcache import KVCache
from minitransformer.measure.sanity import conclude
from minitransformer.measure.timing import MAX_SPREAD, RETRIES, Timing, timed


def one_run(model, prompt, new_tokens):
    """Greedy generation with the cache -> (prefill seconds, [decode step seconds], tokens)."""
    cache = KVCache.allocate(model.config, batch=1, max_len=len(prompt) + new_tokens)

    def step(ids):  # ids (1, T) -> the next token, greedy
        return int(np.argmax(last_logits(model, ids, cache)[0]))

    token, prefill = timed(lambda: step(np.array([prompt])))          # (1, P) -> first token
    tokens, steps = [token], []
    for _ in range(new_tokens - 1):
        token, seconds = timed(lambda: step(np.array([[tokens[-1]]])))  # (1, 1)
        tokens.append(token)
        steps.append(seconds)
    return prefill, steps, tokens


def prefill_and_decode(model, prompt, new_tokens, warmup, repeat):
    """-> (Timing of the prefill, Timing of the runs' mean decode step, tokens of the last run).

    --repeat runs after --warmup, and --repeat more while a median sits far above its best."""
    prefills, means = [], []
    progress = Progress(warmup + repeat, "generation")

    def run(keep):
        prefill, steps, tokens = one_run(model, prompt, new_tokens)
        mean = statistics.fmean(steps) if steps else float("nan")
        progress(f"{'run' if keep else 'warm-up'}: prefill {prefill * 1e3:.1f} ms, "
                 f"decode {mean * 1e3:.1f} ms/step")
        if keep:
            prefills.append(prefill)
            means.append(mean)
        return tokens

    for _ in range(warmup):
        run(keep=False)
    for rounds in range(1 + RETRIES):
        tokens = [run(keep=True) for _ in range(repeat)][-1]
        timings = Timing(tuple(prefills), rounds + 1), Timing(tuple(means), rounds + 1)
        if all(t.spread <= MAX_SPREAD for t in timings):
            break
        progress.n += repeat  # a busy machine: another round, pooled in
    return *timings, tokens


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_argument(parser)
    add_prompt_arguments(parser, 48, "tokens generated: 1 by the prefill, the rest by decode "
                                     "steps (default: 48)")
    add_timing_arguments(parser, warmup=1, repeat=3, runs="generations")
    add_threads_argument(parser)
    args = parser.parse_args(argv)
    P, N = args.prompt_tokens, args.new_tokens
    if P < 1 or N < 2:
        parser.error("need --prompt-tokens >= 1, --new-tokens >= 2")

    ran_on = timing_header(args)
    model = load_model(args.model)
    c = model.config
    if P + N > c.max_position_embeddings:
        parser.error(f"P + N = {P + N} exceeds the model's {c.max_position_embeddings} positions")
    prompt = np.random.default_rng(0).integers(0, c.vocab_size, P).tolist()
    prefill, decode, _ = prefill_and_decode(model, prompt, N, args.warmup, args.repeat)

    table = Table("Experiment 5: prefill vs decode, one generation with the KV cache (float32)",
                  experiment=5, columns=[("phase", ""), ("tokens", "d"), ("time s", ".4f"),
                                         ("ms per token", ".3f"), ("med ms per token", ".3f")])
    table.header(f"time: fastest and median of {prefill.repeat} runs after {args.warmup} "
                 "warm-up (decode: each run's mean step)", ran_on)
    table.row(f"prefill, {P} prompt tokens", P, prefill.best, prefill.best / P * 1e3,
              prefill.median / P * 1e3)
    table.row(f"decode, {N - 1} steps", N - 1, decode.best * (N - 1), decode.best * 1e3,
              decode.median * 1e3)
    table.note(conclude("the ratio", f"a decode step costs {decode.best / (prefill.best / P):.1f}x "
                        f"a prompt token (the chapter: 166.5 / 25.6 = 6.5x); one prefill pass of "
                        f"{P} tokens costs {prefill.best / decode.best:.1f} decode steps",
                        {"prefill": (prefill, None), "decode": (decode, None)}))
    table.plot("phase", ["ms per token"], "prefill against decode, cost per token", kind="bar",
               xlabel="phase", ylabel="time per token (ms)")
    table.show()
    return 0


if __name__ == "__main__":
    from _common import run
    run(main)
