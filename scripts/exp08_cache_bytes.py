"""Experiment 8: KV-cache bytes per token, the formula against the arrays actually held.

    bytes/token = 2 (key and value) x layers x kv_heads x head_dim x bytes per element

with the cache's format in the last factor: f32 4, f16 2, and llama.cpp's q8_0 and q4_0 blocks
(32 int8 or 4-bit codes and one float16 scale: 34/32 and 18/32 bytes per element; the formula
counts d / 32 blocks of 34 or 18 bytes per head vector, minitransformer/kvquant.py)

(sim/kv_memory.py) is checked against ``KVCache.nbytes``, the sum of the bytes of the cache's
arrays. The comparison is made honest in one way: the cache is allocated with exactly as many
slots as tokens it then holds (``KVCache`` preallocates ``max_len`` slots, and a cache
preallocated for more tokens than it holds would count its empty slots too; the last line shows
that slack). First the chapter's check on --model: a cache of N slots in float16, filled by a
real prefill of N tokens, its per-layer shape printed. Then a table over several shapes
(--model's, the chapter's Qwen2.5-0.5B, the same with full MHA and with MQA, a 7B-class model),
each cache format, and users x tokens; those caches are filled through ``KVCache.update``, the
write the forward pass makes, with constant keys/values (the bytes held do not depend on them).
Equality is exact or the script fails. The chapter: 12,288 B/token, exact in every shape tried.
The last lines give --model's bytes per token in each format, measured against the formula.
"""
import argparse
from dataclasses import replace

import numpy as np

from _common import add_model_argument, load_model, progress
from _table import Table

from minitransformer.backend import xp
from minitransformer.checkpoints.synth import qwen25_05b_config
from minitransformer.config import ModelConfig
from minitransformer.kvcache import KVCache
from minitransformer.kvquant import KV_DTYPES, block_of, cache_bytes_per_token, vector_bytes
from minitransformer.model import forward
from sim.kv_memory import format_bytes

F32, F16, Q8, Q4 = KV_DTYPES
# The chapter's rows (its model in fp16, users x tokens; the last three hold 65,536 tokens each).
CHAPTER_ROWS = ((1, 1), (1, 295), (1, 2048), (8, 2048), (32, 2048), (64, 1024), (128, 512))


def cases(model_config):
    """-> [(name, config, dtype, users, tokens), ...]: the table's rows, in order."""
    qwen = ModelConfig.from_dict(qwen25_05b_config())
    seven_b = replace(qwen, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=128, hidden_size=4096)
    rows = [("--model", model_config, dtype, users, tokens)
            for dtype, users, tokens in ((F32, 1, 295), (F16, 1, 295), (Q8, 1, 295),
                                         (Q4, 1, 295), (F16, 4, 256), (Q8, 4, 256))]
    rows += [("Qwen2.5-0.5B", qwen, F16, users, tokens) for users, tokens in CHAPTER_ROWS]
    rows += [("Qwen2.5-0.5B", qwen, dtype, 1, 295) for dtype in (F32, Q8, Q4)]
    rows += [("  same, MHA", replace(qwen, num_key_value_heads=14), F16, 1, 295),
             ("  same, MQA", replace(qwen, num_key_value_heads=1), F16, 1, 295),
             ("7B-class", seven_b, F16, 1, 295), ("7B-class", seven_b, F32, 1, 295),
             ("7B-class", seven_b, Q8, 1, 295)]
    return rows


def fill(cache, tokens):
    """Write `tokens` tokens into every row of every layer, as the forward pass does."""
    B, Hkv, _, d = cache.k[0].shape
    kv = xp.ones((B, tokens, Hkv, d), dtype=xp.float32)            # (B, T, Hkv, d)
    # (a quantized cache stores them as codes and scales: the write quantizes)
    for layer in range(len(cache.k)):
        cache.update(layer, kv, kv)
    cache.advance(tokens)


def formula_text(config, kv_dtype):
    """'2 * L * Hkv * d * bytes', or for q8_0/q4_0 '2 * L * Hkv * blocks * block bytes'."""
    d = config.head_dim
    shape = f"2 * {config.num_hidden_layers} * {config.num_key_value_heads}"
    if kv_dtype in (F32, F16):
        return f"{shape} * {d} * {vector_bytes(d, kv_dtype) // d}"
    blocks = d // block_of(d)
    return f"{shape} * {blocks} * {vector_bytes(d, kv_dtype) // blocks}"


def held_shape(cache):
    """Layer 0's key store: 'shape dtype', or 'codes shape int8 + scales shape float16'."""
    k = cache.k[0]
    if cache.kv_dtype in (F32, F16):
        return f"{tuple(k.shape)} {k.dtype}"
    return (f"codes {tuple(k.codes.shape)} {k.codes.dtype} + scales {tuple(k.scales.shape)} "
            f"{k.scales.dtype}")


def row(name, config, dtype, users, tokens):
    """Allocate exactly users x tokens slots, fill them -> one table row (a dict)."""
    cache = KVCache.allocate(config, batch=users, max_len=tokens, kv_dtype=dtype)
    fill(cache, tokens)
    per_token = cache_bytes_per_token(config, dtype)
    return {"name": name, "shape": f"{config.num_hidden_layers}x{config.num_key_value_heads}"
            f"x{config.head_dim}", "dtype": dtype, "users": users,
            "tokens": tokens, "layer_shape": tuple(cache.k[0].shape), "measured": cache.nbytes,
            "formula": users * tokens * per_token, "per_token": per_token}


def headline(model, tokens, dtype=F16):
    """The chapter's check: a real prefill of `tokens` tokens into exactly that many slots."""
    c = model.config
    cache = KVCache.allocate(c, batch=1, max_len=tokens, kv_dtype=dtype)
    ids = np.random.default_rng(0).integers(0, c.vocab_size, (1, tokens))
    forward(model, ids, cache)                                       # (1, N) -> cache of N
    assert int(cache.lengths[0]) == tokens
    return cache, cache_bytes_per_token(c, dtype), formula_text(c, dtype)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_argument(parser)
    parser.add_argument("--tokens", type=int, default=295,
                        help="tokens of the headline check (default: 295, the chapter's)")
    args = parser.parse_args(argv)
    model = load_model(args.model)
    N = args.tokens
    if not 1 <= N <= model.config.max_position_embeddings:
        parser.error(f"--tokens must be in 1..{model.config.max_position_embeddings}")

    cache, per_token, formula = headline(model, N)
    formats = [headline(model, N, dtype) for dtype in KV_DTYPES]   # a real prefill in each
    todo = cases(model.config)
    rows = []
    for i, case in enumerate(todo, 1):
        rows.append(row(*case))
        r = rows[-1]
        progress(i, len(todo), f"{r['name'].strip()} {r['dtype']} {r['users']} x {r['tokens']}: "
                               f"{r['measured']:,} B")

    exact = all(held.nbytes == N * each for held, each, _ in [(cache, per_token, formula)]
                + formats) and all(r["measured"] == r["formula"] for r in rows)
    by_total = {}  # (shape, dtype, users x tokens) -> the measured bytes of each such row
    for r in rows:
        by_total.setdefault((r["name"], r["dtype"], r["users"] * r["tokens"]), set()).add(
            r["measured"])
    same_total = all(len(held) == 1 for held in by_total.values())
    slack = KVCache.allocate(model.config, 1, 2 * N, F16)
    measured = f"{cache.nbytes:,} bytes for {N} tokens"
    width = max(len(measured), len(formula))
    table = Table("Experiment 8: KV-cache bytes per token, formula against the arrays held",
                  experiment=8, columns=[
                      ("shape", ""), ("L x Hkv x d", ""), ("dtype", ""), ("users", ",d"),
                      ("tokens", ",d"), ("per-layer k/v", ""), ("measured B", ",d"),
                      ("formula B", ",d"), ("B/token", ",d"), ("size", format_bytes),
                      ("equal", "")])
    table.header(f"KV cache tensors per layer: {held_shape(cache)} "
                 f"(k and v, {len(cache.k)} layers; {N} slots allocated, {N} filled by prefill)",
                 f"measured: {measured:<{width}} = {cache.nbytes // N:,} bytes/token",
                 f"formula : {formula:<{width}} = {per_token:,} bytes/token")
    for r in rows:
        table.row(r["name"], r["shape"], r["dtype"], r["users"], r["tokens"],
                  str(r["layer_shape"]), r["measured"], r["formula"], r["per_token"],
                  r["measured"], "yes" if r["measured"] == r["formula"] else "NO")
    table.note(f"formula == measured in {sum(r['measured'] == r['formula'] for r in rows)} of "
               f"{len(rows)} rows; same users x tokens, same bytes: "
               f"{'yes' if same_total else 'NO'}",
               f"preallocation: a cache allocated for {2 * N} slots holds {slack.nbytes:,} B "
               f"= {2 * N} x {per_token:,} whatever it is filled to",
               f"--model's cache per format, a real prefill of {N} tokens each; measured "
               "(nbytes / tokens) against the formula:")
    f32_bytes = formats[0][0].nbytes
    for (held, each, text), dtype in zip(formats, KV_DTYPES, strict=True):
        table.note(f"  {dtype:<5} {held.nbytes // N:>9,} B/token measured, formula {text} = "
                   f"{each:,}: {'equal' if held.nbytes == N * each else 'NOT EQUAL'}; "
                   f"{held.nbytes / f32_bytes:.4f}x f32; {held_shape(held)}")
    table.show()
    return 0 if exact and same_total else 1


if __name__ == "__main__":
    from _common import run
    run(main)
