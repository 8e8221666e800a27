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
then each figure is the median over --repeat runs (of the prefill time; of each run's mean
decode step).
"""
import argparse
import statistics

import numpy as np

from _common import add_model_argument, load_model, progress, say
from minitransformer.generate import last_logits
from minitransformer.kvcache import KVCache
from minitransformer.measure import busy_note, machine, timed
from minitransformer.model import forward


def one_run(model, prompt, new_tokens):
    """Greedy generation with the cache -> (prefill seconds, [decode step seconds], tokens)."""
    cache = KVCache.allocate(model.config, batch=1, max_len=len(prompt) + new_tokens)

    def step(ids):  # ids (1, T) -> the next token, greedy
        return int(np.argmax(last_logits(model, forward(model, ids, cache))[0]))

    token, prefill = timed(lambda: step(np.array([prompt])))          # (1, P) -> first token
    tokens, steps = [token], []
    for _ in range(new_tokens - 1):
        token, seconds = timed(lambda: step(np.array([[tokens[-1]]])))  # (1, 1)
        tokens.append(token)
        steps.append(seconds)
    return prefill, steps, tokens


def measure(model, prompt, new_tokens, warmup, repeat):
    """-> (median prefill seconds, median of the runs' mean decode step, tokens of the last run)."""
    prefills, means = [], []
    for i in range(warmup + repeat):
        prefill, steps, tokens = one_run(model, prompt, new_tokens)
        label = "warm-up" if i < warmup else "run"
        mean = statistics.fmean(steps) if steps else float("nan")
        progress(i + 1, warmup + repeat, f"{label}: prefill {prefill * 1e3:.1f} ms, "
                                         f"decode {mean * 1e3:.1f} ms/step")
        if i >= warmup:
            prefills.append(prefill)
            means.append(mean)
    return statistics.median(prefills), statistics.median(means), tokens


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_argument(parser)
    parser.add_argument("--prompt-tokens", type=int, default=40,
                        help="prompt length P, token ids drawn with seed 0 (default: 40)")
    parser.add_argument("--new-tokens", type=int, default=48,
                        help="tokens generated: 1 by the prefill, the rest by decode steps "
                             "(default: 48)")
    parser.add_argument("--warmup", type=int, default=1, help="discarded runs (default: 1)")
    parser.add_argument("--repeat", type=int, default=3,
                        help="measured runs, medians reported (default: 3)")
    args = parser.parse_args(argv)
    P, N = args.prompt_tokens, args.new_tokens
    if P < 1 or N < 2 or args.warmup < 0 or args.repeat < 1:
        parser.error("need --prompt-tokens >= 1, --new-tokens >= 2, --warmup >= 0, --repeat >= 1")

    model = load_model(args.model)
    c = model.config
    if P + N > c.max_position_embeddings:
        parser.error(f"P + N = {P + N} exceeds the model's {c.max_position_embeddings} positions")
    prompt = np.random.default_rng(0).integers(0, c.vocab_size, P).tolist()
    ran_on = machine()
    if note := busy_note():
        say(f"note: {note}")
    prefill, decode, _ = measure(model, prompt, N, args.warmup, args.repeat)
    per_token = prefill / P

    print(f"Experiment 5: prefill vs decode, one generation with the KV cache (float32, median "
          f"of {args.repeat} runs after {args.warmup} warm-up)")
    print(f"machine: {ran_on}")
    print()
    left = (f"prefill, {P} prompt tokens", f"decode,  {N - 1} steps")
    width = max(map(len, left)) + 1
    ms = per_token * 1e3  # the chapter's one decimal, more digits for a tiny model
    print(f"{left[0]:<{width}}: {prefill:.4f} s   ->  {ms:.{1 if ms >= 1 else 3}f} ms per token")
    print(f"{left[1]:<{width}}: {decode:.4f} s mean per step")
    print()
    print(f"a decode step costs {decode / per_token:.1f}x a prompt token "
          f"(the chapter: 166.5 / 25.6 = 6.5x); one prefill pass of {P} tokens costs "
          f"{prefill / decode:.1f} decode steps")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
