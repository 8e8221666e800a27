"""Experiment 4: memory with and without the KV cache, for the same generated tokens.

The model is loaded first; then the same prompt is generated greedily twice, by full recompute
and with the cache, and for each run the allocator is asked for the most bytes it held at once
during the generation, above what it held when the run started: the peak beyond the resident
weights. Measured, not computed: on NumPy the tracemalloc peak (NumPy reports every array's data
to it), on CuPy the memory pool's (see minitransformer/measure/timing.py). The chapter: 256
tokens in fp16 on an 8 GB laptop GPU, the no-cache run used 8.3x more memory.

Where the bytes go. Without a cache the last step runs the whole sequence S through every
layer, so its activations, (S, F) in the MLP and (H, S, S) in attention, set the peak. With the
cache the peak is the cache itself (allocated once for prompt + new tokens, float32 here) plus
the prefill's activations over the prompt. Both runs generate exactly --new-tokens tokens (end
of sequence does not stop them) and must agree token for token.

Time is not this table's business: tracemalloc slows every allocation, and one generation each
way is one sample; experiment 1 times the two ways. Runtime: recompute costs a full pass per
token, O(N^2) tokens processed in all. The default is the chapter's 256 new tokens: 49 s of CPU
time on the default model (measured: 40 s user, 9 s system, most of it the recompute; one BLAS
thread, on a 2-core machine shared with other work), far longer on Qwen2.5-0.5B on a CPU;
--new-tokens 64 is a quick look.

The last rows: the allocator peak of one long prefill (--prefill-tokens, default 2,048, into a
KV cache, on --prefill-model, default SmolLM2-135M) with the plain attention and with the
tiled one (minitransformer/tiled.py), which never holds the (heads, T, T) scores: the rest of
the peak is the MLP's activations and the like. A 2,048-token prefill on SmolLM2 takes tens of
seconds each way on this CPU; the main job runs a shorter one.
"""
import argparse
from functools import partial

import numpy as np

from _common import (
    Progress,
    add_model_argument,
    add_prompt_arguments,
    add_threads_argument,
    at_least,
    load_model,
    model_name,
    model_path,
    say,
)
from _table import Table

import minitransformer as mt
from minitransformer.backend import to_numpy
from minitransformer.config import load_config
from minitransformer.kvcache import KVCache
from minitransformer.measure.timing import limit_threads, peak_bytes
from minitransformer.model import forward
from quant.qmodel import resident_bytes
from sim.kv_memory import format_bytes, kv_bytes_per_token


def peaks_both_ways(model, prompt, new_tokens):
    """-> {'recompute' | 'cache': (tokens, peak bytes)}, plus the counter's name."""
    P = len(prompt)

    def generate(cache):  # -> tokens, with progress: a recompute step costs its sequence length
        progress = Progress(new_tokens, "no cache" if not cache else "KV cache",
                            cost=(lambda i: 1) if cache else (lambda i: P + i))
        tokens = []
        for i, token in enumerate(mt.stream(model, prompt, new_tokens, cache=cache,
                                            eos_token_id=[]), 1):
            tokens.append(token)
            if i % 32 == 0 or i == new_tokens:
                progress(f"{i} tokens", done=i - progress.i)
        return tokens

    runs = {}
    for name, cache in (("recompute", False), ("cache", True)):
        peak = peak_bytes(partial(generate, cache))
        runs[name] = (peak.result, peak.peak_bytes)
        say(f"{name}: peak {peak.peak_bytes:,} B")
    return runs, peak.counter


def long_prefill(model, tokens: int) -> dict:
    """-> {'plain' | 'tiled': peak bytes of one prefill of `tokens` tokens into a cache, the
    cache allocated before counting}, and the largest |difference| of their hidden states."""
    ids = np.random.default_rng(1).integers(0, model.config.vocab_size, (1, tokens))
    peaks, hidden = {}, {}
    for attention in ("plain", "tiled"):
        cache = KVCache.allocate(model.config, 1, tokens, attention=attention)
        say(f"prefill of {tokens} tokens, {attention} attention ...")
        peak = peak_bytes(lambda: forward(model, ids, cache))
        peaks[attention], hidden[attention] = peak.peak_bytes, to_numpy(peak.result)
        say(f"{attention}: peak {peak.peak_bytes:,} B")
    return peaks, float(np.abs(hidden["plain"] - hidden["tiled"]).max())


def memory_table(model, P, N, runs, counter, threads, prefill) -> Table:
    """Peaks beyond the weights, with and without the cache; prefill: (model, tokens, peaks,
    largest difference) of the long prefill, plain against tiled, or None."""
    c = model.config
    (slow, peak_slow), (fast, peak_fast) = runs["recompute"], runs["cache"]
    cache_held = (P + N) * kv_bytes_per_token(c, 4)
    same = sum(a == b for a, b in zip(slow, fast, strict=True))
    table = Table(f"Experiment 4: memory with and without the KV cache ({P}-token prompt, {N} "
                  "new tokens, greedy, float32)", experiment=4,
                  columns=[("method", ""), ("peak beyond weights", format_bytes),
                           ("bytes", ",d")])
    weights = format_bytes(sum(resident_bytes(model).values()))
    table.header(f"measured: {counter}, during generation, above the resident weights "
                 f"({weights}, loaded before counting started); "
                 f"memory does not depend on timing ({threads})")
    table.row("no cache (full recompute)", peak_slow, peak_slow)
    table.row("KV cache (prefill + decode)", peak_fast, peak_fast)
    if prefill:
        long_model, n, prefill_peaks, prefill_diff = prefill
        lc = long_model.config
        for attention in ("plain", "tiled"):
            table.row(f"{n:,}-token prefill, {attention} attention", prefill_peaks[attention],
                      prefill_peaks[attention])
    table.note(f"no cache / cache: {peak_slow / peak_fast:.1f}x the memory",
               f"of the cached run's peak, the cache itself: {cache_held:,} B ({P + N} slots x "
               f"{kv_bytes_per_token(c, 4):,} B/token in float32, preallocated; exact, "
               "experiment 8)",
               f"tokens identical: {same} of {N}")
    if prefill:
        scores = lc.num_attention_heads * n * n * 4
        table.note(f"long prefill on {model_name(long_model)} ({lc.num_attention_heads} heads): "
                   f"plain / tiled {prefill_peaks['plain'] / prefill_peaks['tiled']:.1f}x the "
                   f"memory; the plain one's scores alone are {lc.num_attention_heads} x {n:,} x "
                   f"{n:,} x 4 = {scores:,} B per layer; hidden states plain vs tiled: max "
                   f"|difference| {prefill_diff:.1e}")
    return table


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_argument(parser)
    add_prompt_arguments(parser, 256, "tokens generated each way (default: the chapter's 256; "
                                      "recompute costs O(N^2) passes, so fewer is much faster)")
    parser.add_argument("--prefill-model", default="smollm2", metavar="PATH|NAME",
                        help="the model of the long prefill (default: smollm2)")
    parser.add_argument("--prefill-tokens", type=at_least(0), default=2048,
                        help="tokens of the long prefill, plain against tiled attention "
                             "(default: 2048; 0 leaves it out)")
    add_threads_argument(parser)
    args = parser.parse_args(argv)
    path = model_path(args.model)
    c = load_config(path)
    P, N = args.prompt_tokens, args.new_tokens
    if P < 1 or N < 1 or P + N > c.max_position_embeddings:
        parser.error(f"need P >= 1, N >= 1 and P + N <= {c.max_position_embeddings} "
                     f"(the model's positions), got P={P}, N={N}")

    threads = limit_threads(args.threads or None)
    model = load_model(path)
    prompt = np.random.default_rng(0).integers(0, c.vocab_size, P).tolist()
    mt.generate(model, prompt[:4], 2)  # warm-up: first-call allocations out of the numbers
    say(f"generating {N} tokens after a {P}-token prompt, recompute then cache ...")
    runs, counter = peaks_both_ways(model, prompt, N)
    prefill = None
    if args.prefill_tokens:
        long_model = load_model(model_path(args.prefill_model))
        n = args.prefill_tokens
        if n > long_model.config.max_position_embeddings:
            parser.error(f"--prefill-tokens {n} exceeds the prefill model's "
                         f"{long_model.config.max_position_embeddings} positions")
        prefill = (long_model, n, *long_prefill(long_model, n))
    memory_table(model, P, N, runs, counter, threads, prefill).show()
    return 0 if runs["recompute"][0] == runs["cache"][0] else 1


if __name__ == "__main__":
    from _common import run
    run(main)
