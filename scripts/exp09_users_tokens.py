"""Experiment 9: KV-cache size for users x tokens, from the model's config.

Thirty-two users with 2,048 tokens each, sixty-four with 1,024, a hundred and twenty-eight with
512: all three hold 65,536 tokens, so the cache is the same size. Only the total number of
resident tokens matters, not how they are spread over users.
"""
import argparse

from _common import add_chapter_model_argument, add_model_argument, model_config
from _table import Table

from sim.arch import kv_dims
from sim.kv_memory import format_bytes, kv_bytes_per_token, users_tokens_table


def parse_shapes(text):
    """'32x2048,64x1024' -> [(32, 2048), (64, 1024)]"""
    try:
        return [tuple(int(n) for n in item.split("x")) for item in text.split(",")]
    except ValueError:
        raise ValueError(f"--shapes {text!r}: expected USERSxTOKENS,... e.g. 32x2048") from None


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_argument(parser)
    add_chapter_model_argument(parser)
    parser.add_argument("--shapes", default="1x295,1x2048,8x2048,32x2048,64x1024,128x512",
                        help="USERSxTOKENS rows, comma-separated (default: %(default)s)")
    parser.add_argument("--bytes-per-elem", type=int, default=2,
                        help="bytes per cached number: 2 for fp16 as in the chapter (default: 2)")
    args = parser.parse_args(argv)

    source, config = model_config(args)
    layers, kv_heads, head_dim = kv_dims(config)
    per_token = kv_bytes_per_token(config, args.bytes_per_elem)
    rows = users_tokens_table(config, parse_shapes(args.shapes), args.bytes_per_elem)

    table = Table(f"Experiment 9: KV cache for users x tokens ({source})", experiment=9,
                  columns=[("users", ",d"), ("tokens each", ",d"), ("total tokens", ",d"),
                           ("cache bytes", ",d"), ("size", format_bytes)])
    table.header(f"2 x {layers} layers x {kv_heads} kv heads x {head_dim} x "
                 f"{args.bytes_per_elem} B = {per_token:,} B/token")
    for r in rows:
        table.row(r.users, r.tokens_each, r.total_tokens, r.nbytes, r.nbytes)
    table.show()

if __name__ == "__main__":
    from _common import run
    run(main)
