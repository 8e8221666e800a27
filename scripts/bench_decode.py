"""Benchmark: how close is a NumPy decode step to the memory-bandwidth floor?

A decode step at batch 1 must read every weight once (the embedding row it looks up aside, but
including a tied head, which reads the whole embedding matrix): that is a floor on its time,
  floor = bytes of weights read per step / read bandwidth,
with the read bandwidth measured in this same run (a BLAS dot product streaming a buffer far
larger than any cache). Target: a decode step within 1.3x of the floor.

It also checks the KV-cache speedup of experiment 1 against a prediction. Recompute pays a full
prefill of P, P+1, ..., P+N-1 tokens; the cache pays one prefill of P plus N-1 decode steps. With
prefill(P) measured at a few lengths (linear fit) and decode measured alone, the predicted
speedup is sum_s prefill(P+s) / (prefill(P) + (N-1) decode); it is printed beside the measured
one. On a GPU a short prefill costs about one decode step (both are weight-reads); on a CPU
prefill is compute-bound and costs far more per pass, so recompute is much dearer here.

Default checkpoint: a random Qwen2.5-0.5B-shaped one (bf16 on disk, ~1 GB), generated once into
weights/qwen25-05b-random/. --model points it elsewhere.
"""
import argparse
import time

import numpy as np

from _common import add_model_argument, load_model, mt, say
from minitransformer.kvcache import KVCache
from minitransformer.measure import median_time
from minitransformer.model import forward, head
from minitransformer.synth import make_checkpoint, qwen25_05b_config, weights_dir


def median_seconds(fn, repeat, warmup=1):
    return median_time(fn, warmup, repeat).median


def read_bandwidth(nbytes=1 << 30, repeat=5):
    """Bytes/s streamed from memory by a BLAS dot product over a buffer of nbytes (float32)."""
    a = np.ones(nbytes // 4, dtype=np.float32)
    return nbytes / median_seconds(lambda: np.dot(a, a), repeat)  # a*a reads the buffer once


def weight_bytes_per_step(model):
    """Every float the decode step reads: all weights but the embedding (one row is read), plus
    the head (which *is* the embedding when tied)."""
    c, w = model.config, model.weights
    total = sum(int(a.nbytes) for name, a in w.items() if name != "model.embed_tokens.weight")
    head_bytes = int(w["model.embed_tokens.weight"].nbytes) if c.tie_word_embeddings else 0
    return total + head_bytes + c.hidden_size * 4


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_argument(parser)
    parser.add_argument("--prompt-tokens", type=int, default=40)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--skip-recompute", action="store_true",
                        help="skip the (slow) measured recompute run")
    args = parser.parse_args(argv)

    path = args.model
    if path is None:
        path = weights_dir() / "qwen25-05b-random"
        if not (path / "model.safetensors").is_file():
            say(f"writing a random Qwen2.5-0.5B-shaped checkpoint to {path} (once) ...")
            make_checkpoint(path, qwen25_05b_config(), seed=0, dtype="bfloat16")
    model = load_model(path)
    c = model.config
    P, N = args.prompt_tokens, args.new_tokens
    ids = np.random.default_rng(0).integers(0, c.vocab_size, P + N)

    say("[1/5] measuring read bandwidth ...")
    bandwidth = read_bandwidth()
    step_bytes = weight_bytes_per_step(model)
    floor = step_bytes / bandwidth

    say("[2/5] decode step at batch 1 ...")
    cache = KVCache.allocate(c, batch=1, max_len=P + N + args.repeat + 2)
    forward(model, ids[None, :P], cache)

    def decode_step():
        head(model, forward(model, ids[None, P:P + 1], cache)[:, -1:])
    decode = median_seconds(decode_step, args.repeat)

    say("[3/5] prefill at several prompt lengths ...")
    lengths = sorted({P, (2 * P + N) // 2, P + N - 1})
    prefill = {}
    for n in lengths:
        def prefill_pass():
            head(model, forward(model, ids[None, :n], KVCache.allocate(c, 1, n))[:, -1:])
        prefill[n] = median_seconds(prefill_pass, max(2, args.repeat // 2))
    slope, intercept = np.polyfit(lengths, [prefill[n] for n in lengths], 1)
    predicted_recompute = sum(intercept + slope * (P + s) for s in range(N))
    predicted_cached = prefill[P] + (N - 1) * decode
    predicted = predicted_recompute / predicted_cached

    say("[4/5] measured generation with the cache ...")
    start = time.perf_counter()
    cached_tokens = mt.generate(model, ids[:P], N, eos_token_id=[])
    t_cached = time.perf_counter() - start
    t_recompute = None
    if not args.skip_recompute:
        say(f"[5/5] measured generation by recompute ({N} full passes) ...")
        start = time.perf_counter()
        slow_tokens = mt.generate(model, ids[:P], N, cache=False, eos_token_id=[])
        t_recompute = time.perf_counter() - start
        assert slow_tokens == cached_tokens, "cache and recompute disagree"

    print(f"Decode benchmark: {c.num_hidden_layers} layers x {c.hidden_size}, "
          f"vocab {c.vocab_size}, float32 math, batch 1")
    print()
    print(f"weights read per decode step     {step_bytes / 1e9:10.3f} GB")
    print(f"read bandwidth (measured)        {bandwidth / 1e9:10.2f} GB/s")
    for label, t in (("bandwidth floor per step", floor), ("decode step (median)", decode)):
        print(f"{label:<33}{t * 1e3:10.1f} ms   ({1 / t:6.2f} tokens/s)")
    print(f"decode / floor                   {decode / floor:10.2f}x   (target <= 1.3x)")
    print()
    print(f"{'prefill P':>10}{'time (ms)':>12}{'ms/token':>10}{'tokens/s':>10}")
    for n in lengths:
        t = prefill[n]
        print(f"{n:>10}{t * 1e3:>12.1f}{t * 1e3 / n:>10.2f}{n / t:>10.1f}")
    print()
    print(f"generation of {N} tokens after a {P}-token prompt")
    print(f"  with cache  (measured)         {t_cached:10.2f} s")
    if t_recompute is not None:
        print(f"  recompute   (measured)         {t_recompute:10.2f} s")
        measured = t_recompute / t_cached
        print(f"  speedup     (measured)         {measured:10.2f}x")
    print(f"  speedup     (predicted)        {predicted:10.2f}x   "
          f"= sum prefill(P..P+{N - 1}) / (prefill(P) + {N - 1} decode)")
    if t_recompute is not None:
        print(f"  predicted / measured           {predicted / measured:10.2f}")
    print(f"  one prefill of {P} tokens = {prefill[P] / decode:.1f} decode steps on this machine")


if __name__ == "__main__":
    from _common import run
    run(main)
