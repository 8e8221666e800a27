"""Experiment 11, window: a sliding window bounds the KV cache; a rotating cache holds it.

A sliding-window layer (Mistral's every layer, Qwen2's from max_window_layers on) lets a query
see only the last W positions, so it needs only W of them cached, whatever the length. The
formula becomes

    bytes = 2 x Hkv x d x bytes per element x (sum over layers of min(tokens, W) or tokens)

with tokens for a full-attention layer. First Mistral-7B-v0.1's shape (32 layers, 8 kv heads of
128, W = 4,096, fp16) by the formula against the same model without its window. Then the
same formula against the bytes a real ``KVCache`` holds (its rotating layers keep W slots, the
full ones one per position: kvcache.py), on --model's shape given a window of --window, all its
layers windowed and (Qwen2's way) only the upper half, filled by a real forward pass over
--model's tokens at each length: equal, or the script fails.
"""
import argparse
from dataclasses import replace

import numpy as np

from _common import add_model_argument, fail, load_model, positive_ints, progress
from _table import Table

from minitransformer.kvcache import KVCache
from minitransformer.kvquant import cache_bytes_per_token
from minitransformer.model import forward
from sim.kv_memory import GB, format_bytes
from sim.memory_budget import ModelSpec

MISTRAL_7B = ModelSpec("Mistral-7B", 7.24e9, 32, 8, 128)


def windowed_bytes(config, tokens: int, kv_dtype: str = "f32") -> int:
    """The formula: each layer holds min(tokens, W) slots (W its window), or tokens."""
    per_slot = cache_bytes_per_token(config, kv_dtype) // config.num_hidden_layers
    return per_slot * sum(tokens if config.window(i) is None else min(tokens, config.window(i))
                          for i in range(config.num_hidden_layers))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_argument(parser)
    parser.add_argument("--window", type=int, default=64, help="--model's window (%(default)s)")
    parser.add_argument("--lengths", type=positive_ints, default="16,64,128,256,512",
                        help="--model's lengths in tokens (default: %(default)s)")
    parser.add_argument("--contexts", type=positive_ints,
                        default="1024,4096,8192,32768,131072",
                        help="Mistral-7B's context lengths (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.window < 1:
        parser.error(f"--window must be >= 1, got {args.window}")

    m, W = MISTRAL_7B, 4096
    per_token = 2 * m.num_hidden_layers * m.num_key_value_heads * m.head_dim * 2
    table = Table("Experiment 11, window: Mistral-7B's KV cache, full against a window of 4,096 "
                  "(fp16, one user)", experiment=11, chapter=False,
                  columns=[("context", ",d"), ("full", format_bytes), ("windowed", format_bytes),
                           ("full GB", ".2f"), ("windowed GB", ".2f")])
    table.header(f"full: 2 x {m.num_hidden_layers} x {m.num_key_value_heads} x {m.head_dim} x "
                 f"2 B = {per_token:,} B/token; windowed: the same x min(tokens, {W:,})")
    for n in args.contexts:
        full, windowed = per_token * n, per_token * min(n, W)
        table.row(n, full, windowed, full / GB, windowed / GB)
    table.note(f"past {W:,} tokens the windowed cache stops growing at "
               f"{format_bytes(per_token * W)}: it holds a ring of {W:,} slots per layer")
    table.plot("context", ["full GB", "windowed GB"], "Mistral-7B's cache, full and windowed",
               xlabel="context (tokens)", ylabel="KV cache of one user (GB)")
    table.show()

    model = load_model(args.model)
    c, L = model.config, model.config.num_hidden_layers
    shapes = [("full attention", replace(c, layer_windows=())),
              (f"every layer W={args.window}", replace(c, layer_windows=(args.window,) * L)),
              (f"upper {L - L // 2} layers W={args.window}",
               replace(c, layer_windows=(None,) * (L // 2) + (args.window,) * (L - L // 2)))]
    table = Table("Experiment 11, window: the rotating cache held against the formula "
                  "(--model's shape, f32)", experiment=11, chapter=False,
                  columns=[("layers", ""), ("tokens", ",d"), ("formula", format_bytes),
                           ("held", format_bytes), ("equal", "")])
    rng, done = np.random.default_rng(0), 0
    for name, config in shapes:
        windowed = replace(model, config=config, fused=model.fused)
        for n in args.lengths:
            done += 1
            progress(done, len(shapes) * len(args.lengths), f"{name}: {n} tokens")
            cache = KVCache.allocate(config, 1, n)
            forward(windowed, rng.integers(0, c.vocab_size, (1, n)), cache)
            held, formula = cache.nbytes, windowed_bytes(config, n)
            if held != formula:
                fail(f"{name}, {n} tokens: the cache holds {held:,} B, the formula says "
                     f"{formula:,} B")
            table.row(name, n, formula, held, "yes")
    table.note("a windowed layer's bytes stop at its window; a full layer's grow with every "
               "token: a model windowed in half its layers saves half past the window")
    table.show()


if __name__ == "__main__":
    from _common import run
    run(main)
