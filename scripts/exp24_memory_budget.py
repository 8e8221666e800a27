"""Experiment 24: the memory budget. For each card: weights, what is left after a fixed
reserve, and how many tokens of KV cache fit in it (all users together), for 7B / 13B / 70B
models at fp16 / int8 / int4.

The chapter states no assumptions; the ones that reproduce every figure it quotes (13B int4 on
8 GB: 6.2 GB, 337 tokens; 16 GB int8: 7B 65,378 tokens, 13B 3,136; 7B fp16 13.0 GB) are the
defaults below and are printed above the tables. Change any of them, or add your own model
with --model PATH or a name, 'default' or 'smollm2' (parameters counted from its config.json).
"""
import argparse
import dataclasses
from pathlib import Path

from _common import model_path, numbers, say
from _table import Table

from minitransformer.config import load_config
from sim.kv_memory import format_bytes
from sim.memory_budget import INT4, MODELS, PRECISIONS, Assumptions, ModelSpec, budget_table


def cells(row, gb):
    """-> (left, max tokens, max tokens with a q8_0 cache) as printed: why nothing fits, when
    nothing does."""
    if row.weight_bytes > row.card_gb * gb:
        return "-", "weights do not fit", "-"
    left = row.left_bytes / gb
    if row.left_bytes <= 0:  # two decimals, or -0.02 GB would print as -0.0
        return f"{left:.2f} GB", "no room after reserve", "-"
    return f"{left:.1f} GB", f"{row.max_tokens:,}", f"{row.max_tokens_int8:,}"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cards", type=numbers, default=[8, 16, 24],
                        help="card memory in GB, comma-separated (default: 8,16,24)")
    parser.add_argument("--reserve-gb", type=float, default=Assumptions.reserve_gb,
                        help="held back on every card for activations and runtime "
                             "(default: %(default)s)")
    parser.add_argument("--int4-bits", type=float, default=INT4.bits_per_weight,
                        help="bits per int4 weight including scales (default: %(default)s, "
                             "group-128 with fp16 scales)")
    parser.add_argument("--decimal-gb", action="store_true",
                        help="GB = 10^9 bytes instead of the chapter's 2^30")
    parser.add_argument("--model", default=None, metavar="PATH|NAME",
                        help="also budget this checkpoint (its config.json), or 'default' or "
                             "'smollm2' (default: only the chapter's 7B / 13B / 70B)")
    args = parser.parse_args(argv)

    assumptions = Assumptions(gb=10**9 if args.decimal_gb else 2**30,
                              reserve_gb=args.reserve_gb)
    precisions = [dataclasses.replace(p, bits_per_weight=args.int4_bits) if p is INT4 else p
                  for p in PRECISIONS]
    models = list(MODELS)
    if args.model:
        path = model_path(args.model)
        models.append(ModelSpec.from_config(load_config(path), name=Path(path).resolve().name))
        say(f"--model {args.model}: {models[-1].parameters:,} parameters")
    try:
        rows = budget_table(args.cards, models, precisions, assumptions)
    except ValueError as e:
        parser.error(str(e))

    gb = "2^30" if assumptions.gb == 2**30 else "10^9"
    assumed = [f"assumptions: GB = {gb} bytes; a fixed {assumptions.reserve_gb:g} GB reserve per "
               "card for activations and runtime",
               "  weights: parameters x bits / 8, with "
               + ", ".join(f"{p.name} {p.bits_per_weight:g}" for p in precisions)
               + " bits per weight"
               + (" (int4: 4 bits + one fp16 scale per group of 128, as the chapter prices it)"
                  if args.int4_bits == INT4.bits_per_weight else ""),
               f"  KV cache in fp16 ({assumptions.kv_bytes_per_elem} B per number) whatever the "
               "weights are; max tokens = floor(left / KV bytes per token), all users together",
               "  beside it an int8 cache, llama.cpp's q8_0: 32 int8 codes + one fp16 scale per "
               "32 numbers = 34/32 B per number (the bytes our q8_0 KVCache holds)",
               *(f"  {m.name}: {m.parameters:,.0f} parameters, {m.num_hidden_layers} layers x "
                 f"{m.num_key_value_heads} kv heads x {m.head_dim}" for m in models)]
    for i, card in enumerate(args.cards):
        table = Table(f"Experiment 24: memory budget of a {card:g} GB card = weights + reserve + "
                      "KV cache (all users' tokens)", experiment=24,
                      chapter=i == len(args.cards) - 1,
                      columns=[("model", ""), ("precision", ""),
                               ("weights", lambda v: f"{v:.1f} GB"),
                               ("left", ""), ("KV/token", format_bytes), ("max tokens", ""),
                               ("KV/token q8_0", format_bytes), ("max tokens q8_0", "")])
        table.header(*(assumed if i == 0 else ()))
        for r in (r for r in rows if r.card_gb == card):
            left, tokens, tokens_int8 = cells(r, assumptions.gb)
            table.row(r.model, r.precision, r.weight_bytes / assumptions.gb, left,
                      r.kv_bytes_per_token, tokens, r.kv_int8_bytes_per_token, tokens_int8)
        table.show()

if __name__ == "__main__":
    from _common import run
    run(main)
