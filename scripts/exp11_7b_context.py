"""Experiment 11: a 7B-class model's KV cache against context length, and the context at which
one user's cache outgrows the model's own fp16 weights.

The chapter's 7B class: 32 layers, 8 key-value heads of dimension 128 (128 KB/token in fp16),
7e9 parameters (13.0 GB in fp16). At 128,000 tokens one user's cache is bigger than the model.
"""
import argparse

from _common import positive_ints
from _table import Table

from sim.kv_memory import GB, context_table, crossing_tokens, format_bytes, kv_bytes_per_token
from sim.memory_budget import FP16, SEVEN_B, ModelSpec, weight_bytes


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=positive_ints,
                        default="1024,4096,8192,16384,32768,65536,100000,128000",
                        help="context lengths in tokens, comma-separated (default: %(default)s)")
    parser.add_argument("--layers", type=int, default=SEVEN_B.num_hidden_layers)
    parser.add_argument("--kv-heads", type=int, default=SEVEN_B.num_key_value_heads)
    parser.add_argument("--head-dim", type=int, default=SEVEN_B.head_dim)
    parser.add_argument("--params", type=float, default=SEVEN_B.parameters,
                        help="parameter count, for the fp16 weights (default: 7e9)")
    args = parser.parse_args(argv)
    contexts = args.contexts

    model = ModelSpec("7B-class", args.params, args.layers, args.kv_heads, args.head_dim)
    weights = weight_bytes(model, FP16)
    per_token = kv_bytes_per_token(model)
    cross = crossing_tokens(model, weights)

    table = Table("Experiment 11: a 7B-class KV cache against context length (fp16, one user)",
                  experiment=11, columns=[("context", ",d"), ("cache", format_bytes),
                                          ("cache GB", ".2f"), ("vs weights", ".2f")])
    table.header(f"2 x {model.num_hidden_layers} layers x {model.num_key_value_heads} kv heads "
                 f"x {model.head_dim} x 2 B = {per_token:,} B/token = "
                 f"{format_bytes(per_token)}/token",
                 f"weights: {model.parameters:,.0f} parameters x 2 B = {weights / GB:.1f} GB")
    for r in context_table(model, contexts, weights):
        table.row(r.tokens, r.nbytes, r.nbytes / GB, r.vs_weights)
    table.note(f"one user's cache outgrows the {weights / GB:.1f} GB of fp16 weights from "
               f"{cross:,} tokens of context")
    table.plot("context", ["cache GB"], "one user's KV cache against context, and the weights",
               xlabel="context (tokens)", ylabel="KV cache of one user (GB)",
               hline=("fp16 weights", round(weights / GB, 1)))
    table.show()

if __name__ == "__main__":
    from _common import run
    run(main)
