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

Last the paged engine's blocks (serve/blocks.py), the same shapes: a block spans every layer,
so it can go back only once it slid out of every layer's window, and a sequence of n tokens
then holds

    blocks = ceil(n / bs) - floor((n - W + 1) / bs)    (at most ceil((W - 1) / bs) + 1)

where every layer slides (the window rounded out to whole blocks), ceil(n / bs) where one
attends fully. Against it the blocks the engine holds once a prompt of n tokens has run, and
the blocks it released: counted, and all of them back in the pool when the request ends.
"""
import argparse
from dataclasses import replace

import numpy as np

from _common import add_model_argument, fail, load_model, positive_ints, progress
from _table import Table

from minitransformer.kvcache import KVCache
from minitransformer.kvquant import cache_bytes_per_token
from minitransformer.model import forward
from minitransformer.serve.config import EngineConfig
from minitransformer.serve.engine import Engine
from minitransformer.serve.records import Request
from sim.kv_memory import GB, format_bytes
from sim.memory_budget import ModelSpec

MISTRAL_7B = ModelSpec("Mistral-7B", 7.24e9, 32, 8, 128)


def windowed_bytes(config, tokens: int, kv_dtype: str = "f32") -> int:
    """The formula: each layer holds min(tokens, W) slots (W its window), or tokens."""
    per_slot = cache_bytes_per_token(config, kv_dtype) // config.num_hidden_layers
    return per_slot * sum(tokens if config.window(i) is None else min(tokens, config.window(i))
                          for i in range(config.num_hidden_layers))


def paged_blocks(config, tokens: int, block_size: int) -> int:
    """The formula: a sequence's blocks, less those wholly before its next query's window
    (tokens - W + 1 on) where every layer slides; all of them where a layer attends fully."""
    held = -(-tokens // block_size)
    if config.layer_windows and all(config.layer_windows):
        held -= max(0, tokens - max(config.layer_windows) + 1) // block_size
    return held


def engine_blocks(model, tokens, block_size: int) -> tuple:
    """A prompt of `tokens` through a paged engine of one slot (its first token made) -> the
    blocks it held once the prompt's step was committed, and those it released; all back in
    the pool when it ends, or the script fails."""
    pool = -(-(len(tokens) + 1) // block_size)
    engine = Engine(model, EngineConfig(max_num_seqs=1, block_size=block_size,
                                        num_gpu_blocks_override=pool,
                                        enable_prefix_caching=False), history=True)
    engine.run([Request(tuple(tokens), 1, eos_token_id=[])])
    books = engine.cache.books
    if books.num_free != pool or len(books.free) != pool:
        fail(f"{len(tokens)} tokens: {pool - len(books.free)} blocks not back on the free list")
    return engine.memory[0].blocks_held, books.slid_out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_argument(parser)
    parser.add_argument("--window", type=int, default=64, help="--model's window (%(default)s)")
    parser.add_argument("--lengths", type=positive_ints, default="16,64,129,256,513",
                        help="--model's lengths in tokens (default: %(default)s)")
    parser.add_argument("--block-size", type=int, default=16,
                        help="the paged engine's tokens per block (%(default)s)")
    parser.add_argument("--contexts", type=positive_ints,
                        default="1024,4096,8192,32768,131072",
                        help="Mistral-7B's context lengths (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.window < 1:
        parser.error(f"--window must be >= 1, got {args.window}")
    if args.block_size < 1:
        parser.error(f"--block-size must be >= 1, got {args.block_size}")

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
    rng, done, units = np.random.default_rng(0), 0, 2 * len(shapes) * len(args.lengths)
    for name, config in shapes:
        windowed = replace(model, config=config, fused=model.fused)
        for n in args.lengths:
            done += 1
            progress(done, units, f"{name}: {n} tokens")
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

    bs = args.block_size
    per_block = cache_bytes_per_token(c, "f32") * bs      # a block: bs slots of every layer
    table = Table(f"Experiment 11, window: the paged engine's blocks held against the formula "
                  f"(--model's shape, blocks of {bs} tokens, f32)", experiment=11,
                  chapter=False,
                  columns=[("layers", ""), ("tokens", ",d"), ("formula", ",d"),
                           ("held", ",d"), ("released", ",d"), ("held bytes", format_bytes),
                           ("equal", "")])
    table.header(f"a block: {bs} slots x {per_block // bs:,} B/token = {per_block:,} B; "
                 f"every layer windowed: at most ceil(({args.window} - 1) / {bs}) + 1 = "
                 f"{-(-(args.window - 1) // bs) + 1} blocks")
    for name, config in shapes:
        windowed = replace(model, config=config, fused=model.fused)
        for n in args.lengths:
            done += 1
            progress(done, units, f"{name}: {n} tokens through the paged engine")
            held, released = engine_blocks(windowed, rng.integers(0, c.vocab_size, n).tolist(),
                                           bs)
            formula = paged_blocks(config, n, bs)
            if held != formula or held + released != -(-n // bs):
                fail(f"{name}, {n} tokens: the engine holds {held} blocks and released "
                     f"{released}, the formula says {formula} of {-(-n // bs)}")
            table.row(name, n, formula, held, released, held * per_block, "yes")
    table.note("a block holds every layer's keys of its slots: it goes back only once it slid "
               "out of every layer's window, so half the layers windowed releases none; all "
               "windowed, the blocks stop at the window rounded out to blocks, a block more "
               "than the rotating cache's slots at most")
    table.show()


if __name__ == "__main__":
    from _common import run
    run(main)
