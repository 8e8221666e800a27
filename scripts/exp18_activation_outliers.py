"""Experiment 18: outlier features in the residual stream.

Run an ordinary prompt, capture the residual stream after every layer, and take each hidden
dimension's largest |h| over the tokens. The chapter (Qwen2.5-0.5B, 84 tokens): dimension 62
reaches 1,579.6 while the median dimension never passes 1.6; the same dimension stands out from
layer 4 to layer 20; and the histogram of the 896 per-dimension maxima at layer 16 is a heap
below 8, nothing for three octaves, and one dimension alone at the far end.
Each maximum is shown over all positions and without position 0, because a trained model's
first token often carries a spike of its own (an attention sink) that is not an outlier
feature: the second is big at every token, the first at one.
Layers are numbered from 0: "layer i" is the residual stream after layer i.
"""
import argparse

import numpy as np

from _common import add_model_argument, choose_layer, load_model, model_name, say
from _table import Table

from minitransformer.tokenizer import encode_prompt
from quant.activations import (
    PROMPT,
    capture_residuals,
    log2_histogram,
    longest_run,
    per_dim_max,
    persistence,
    top_dims,
)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_argument(parser, default="smollm2")
    parser.add_argument("--prompt", default=PROMPT)
    parser.add_argument("--layer", type=int, default=None,
                        help="layer of the histogram (default: two thirds of the way up)")
    parser.add_argument("--top", type=int, default=4, help="how many dimensions count as top")
    args = parser.parse_args(argv)
    model = load_model(args.model)
    ids = encode_prompt(model, args.prompt)
    L = model.config.num_hidden_layers
    layer = choose_layer(args.layer, L)
    say(f"forward pass over {len(ids)} tokens, keeping the residual stream of {L} layers")
    h = capture_residuals(model, ids)                                  # (L, T, D)
    # Two different things make a dimension big. The first position can carry a spike of its
    # own (an attention sink: heads with nothing to attend to park their weight on the first
    # token, and its residual grows huge in a few dimensions); an outlier *feature* is big at
    # every token. Taking maxima without position 0 separates the second from the first.
    maxima, rest = per_dim_max(h), per_dim_max(h[:, 1:])               # (L, D) each
    table = layer_table(model, h, maxima, rest, args.top)
    top_notes(table, h, maxima, rest, layer, args.top)
    histogram_notes(table, maxima[layer], rest[layer], layer)
    table.plot("layer", ["max |h|", "max |h| w/o pos 0", "median dim"], "largest and median "
               "dimension of the residual stream, layer by layer", logy=True,
               xlabel="layer", ylabel="|h| (residual stream value)")
    table.show()


def layer_table(model, h, maxima, rest, top: int) -> Table:
    """One row per layer: its largest |h| (where), without position 0, the median dimension."""
    (L, T, D) = h.shape
    table = Table(f"Experiment 18: outlier features ({T}-token prompt, {D} dimensions, "
                  f"{L} layers), {model_name(model)}", experiment=18, columns=[
                      ("layer", "d"), ("max |h|", ".1f"), ("dim", "d"), ("pos", "d"),
                      ("max |h| w/o pos 0", ".1f"), ("dim w/o pos 0", "d"),
                      ("median dim", ".2f"), (f"top {top} dims w/o pos 0", "")])
    table.header("max |h| of each dimension over the tokens, residual stream after each layer; "
                 "'pos' is the token where the largest sits; 'w/o pos 0': the same without "
                 "the first token")
    table.random_weights(model)
    for i in range(L):
        table.row(i, float(maxima[i].max()), int(maxima[i].argmax()),
                  int(np.abs(h[i]).max(axis=1).argmax()), float(rest[i].max()),
                  int(rest[i].argmax()), float(np.median(rest[i])),
                  ", ".join(str(d) for d in top_dims(rest[i], top)))
    return table


def top_notes(table, h, maxima, rest, layer: int, top: int) -> None:
    """The largest value (a first token's spike or not), and the top dimensions at one layer
    with the layers through which each stays on top."""
    spike = np.unravel_index(maxima.argmax(), maxima.shape)
    at_first = np.abs(h[spike[0], 0, spike[1]]) == maxima[spike]
    where = np.unravel_index(rest.argmax(), rest.shape)
    table.note(f"dim {spike[1]} reaches {maxima.max():.1f} (layer {spike[0]})"
               + (", at position 0: the first token's spike (an attention sink), one token, "
                  "not a feature of all of them" if at_first else ""),
               f"without position 0: dim {where[1]} reaches {rest.max():.1f} (layer "
               f"{where[0]}), while the median dimension never passes "
               f"{np.median(rest, axis=1).max():.1f}",
               f"top {top} dimensions at layer {layer} without position 0, and where each "
               f"stays in the top {top}:")
    for d in top_dims(rest[layer], top):
        layers = persistence(rest, d, top)
        first, last = longest_run(layers)
        run = (f"only at layer {first}" if len(layers) == 1 else
               f"layers {first}-{last} without a break; {len(layers)} of {len(h)} layers in all")
        table.note(f"  dim {d:>5}   max |h| {rest[layer, d]:>9.1f}   {run}")


def histogram_notes(table, maxima, rest, layer: int) -> None:
    """The histogram of one layer's per-dimension maxima, with and without position 0."""
    table.note("", f"max |h| of the {len(maxima)} dimensions at layer {layer} (log2 bins), with "
               "and without position 0 (one # per dimension, at most 40):")
    with_first, without = log2_histogram(maxima), log2_histogram(rest)
    for i, b in enumerate(with_first):  # the same bins: 0, 1, 2, 4, ... up to the larger max
        n = without[i].count if i < len(without) else 0
        table.note(f"{b.low:>6.0f} - {b.high:>6.0f} | {b.count:>4} "
                   f"{'#' * min(b.count, 40):<40}| {n:>4} {'#' * min(n, 40)}")


if __name__ == "__main__":
    from _common import run
    run(main)
