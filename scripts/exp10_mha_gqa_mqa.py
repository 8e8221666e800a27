"""Experiment 10: the same model's KV cache per token with MHA, GQA and MQA.

Only the number of key-value heads changes: every query head with its own (MHA, H kv heads),
the model as configured (GQA for the chapter's model: 14 query heads share 2 kv heads), or
one shared by all (MQA). None of them buys arithmetic; they divide the cache by an integer.
"""
import argparse

from _common import add_chapter_model_argument, add_model_argument, model_config
from _table import Table
from sim.arch import kv_dims, query_heads
from sim.kv_memory import attention_variants, format_bytes


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
                           ("size", format_bytes), ("vs configured", lambda v: f"{v:.2f}x")])
    table.header(f"{layers} layers, {query_heads(config)} query heads, head dim {head_dim}, "
                 f"{args.bytes_per_elem} B per number")
    for v in attention_variants(config, args.bytes_per_elem):
        table.row(v.name, v.kv_heads, v.bytes_per_token, v.bytes_per_token, v.vs_configured)
    table.plot("variant", ["bytes/token"], "KV cache bytes per token: MHA, GQA, MQA",
               kind="bar")
    table.show()

if __name__ == "__main__":
    from _common import run
    run(main)
