"""Experiment 10: the same model's KV cache per token with MHA, GQA and MQA.

Only the number of key-value heads changes: every query head with its own (MHA, H kv heads),
the model as configured (GQA for the chapter's model: 14 query heads share 2 kv heads), or
one shared by all (MQA). None of them buys arithmetic; they divide the cache by an integer.
The cache's format divides it again: the last columns are the bytes per token of a real
KVCache of each variant in each format (f32, f16, llama.cpp's q8_0 and q4_0 blocks; the bytes
its arrays hold over its slots), checked against the formula (minitransformer/kvquant.py).
"""
import argparse
from types import SimpleNamespace

from _common import add_chapter_model_argument, add_model_argument, model_config
from _table import Table

from minitransformer.kvcache import KVCache
from minitransformer.kvquant import KV_DTYPES, cache_bytes_per_token
from sim.arch import kv_dims, query_heads
from sim.kv_memory import attention_variants, format_bytes

SLOTS = 16  # slots of each measured cache (bytes per slot do not depend on how many: exp. 8)


def measured_per_token(layers, kv_heads, head_dim, kv_dtype) -> tuple[int, bool]:
    """-> (bytes per token of a real cache of this shape and format, equal to the formula)."""
    shape = SimpleNamespace(num_hidden_layers=layers, num_key_value_heads=kv_heads,
                            head_dim=head_dim)
    held = KVCache.allocate(shape, batch=1, max_len=SLOTS, kv_dtype=kv_dtype).nbytes
    return held // SLOTS, held == SLOTS * cache_bytes_per_token(shape, kv_dtype)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_argument(parser)
    add_chapter_model_argument(parser)
    parser.add_argument("--bytes-per-elem", type=int, default=2,
                        help="bytes per cached number: 2 for fp16 as in the chapter (default: 2)")
    args = parser.parse_args(argv)

    source, config = model_config(args)
    layers, _, head_dim = kv_dims(config)

    table = Table(f"Experiment 10: MHA vs GQA vs MQA ({source})", experiment=10,
                  columns=[("variant", ""), ("kv heads", "d"),
                           ("bytes/token", lambda v: f"{v:,} B/token"),
                           ("size", format_bytes), ("vs configured", lambda v: f"{v:.2f}x")]
                  + [(f"{t} B/token", ",d") for t in KV_DTYPES] + [("= formula", "")])
    table.header(f"{layers} layers, {query_heads(config)} query heads, head dim {head_dim}, "
                 f"{args.bytes_per_elem} B per number")
    exact = True
    for v in attention_variants(config, args.bytes_per_elem):
        formats = [measured_per_token(layers, v.kv_heads, head_dim, t) for t in KV_DTYPES]
        exact &= all(equal for _, equal in formats)
        table.row(v.name, v.kv_heads, v.bytes_per_token, v.bytes_per_token, v.vs_configured,
                  *[held for held, _ in formats],
                  "yes" if all(equal for _, equal in formats) else "NO")
    table.note(f"per format: a real KVCache of {SLOTS} slots, its nbytes / {SLOTS}; q8_0 and "
               "q4_0 hold 32 codes of 8 or 4 bits and one float16 scale per 32 numbers")
    table.plot("variant", ["bytes/token"], "KV cache bytes per token: MHA, GQA, MQA",
               kind="bar", xlabel="attention variant", ylabel="KV cache per token (bytes)")
    table.show()
    return 0 if exact else 1

if __name__ == "__main__":
    from _common import run
    run(main)
