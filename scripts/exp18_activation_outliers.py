"""Experiment 18: outlier features in the residual stream.

Run an ordinary prompt, capture the residual stream after every layer, and take each hidden
dimension's largest |h| over the tokens. The chapter (Qwen2.5-0.5B, 84 tokens): dimension 62
reaches 1,579.6 while the median dimension never passes 1.6; the same dimension stands out from
layer 4 to layer 20; and the histogram of the 896 per-dimension maxima at layer 16 is a heap
below 8, nothing for three octaves, and one dimension alone at the far end.
Layers are numbered from 0: "layer i" is the residual stream after layer i.
"""
import argparse

import numpy as np

from _common import add_model_argument, choose_layer, encode_prompt, load_model, say
from _table import Table
from quant.activations import (PROMPT, capture_residuals, log2_histogram,
                               longest_run, per_dim_max, persistence, top_dims)


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
    maxima = per_dim_max(capture_residuals(model, ids))               # (L, D)
    D = maxima.shape[1]

    table = Table(f"Experiment 18: outlier features ({len(ids)}-token prompt, {D} dimensions, "
                  f"{L} layers), {model.path}", experiment=18, columns=[
                      ("layer", "d"), ("max |h|", ".1f"), ("dim", "d"), ("median dim", ".2f"),
                      (f"top {args.top} dims", "")])
    table.header("max |h| of each dimension over the tokens, residual stream after each layer")
    table.random_weights(model)
    for i, row in enumerate(maxima):
        table.row(i, float(row.max()), int(row.argmax()), float(np.median(row)),
                  ", ".join(str(d) for d in top_dims(row, args.top)))
    where = np.unravel_index(maxima.argmax(), maxima.shape)
    table.note(f"dim {where[1]} reaches {maxima.max():.1f} (layer {where[0]}), while the median "
               f"dimension never passes {np.median(maxima, axis=1).max():.1f}",
               f"top {args.top} dimensions at layer {layer}, and where each stays in the top "
               f"{args.top}:")
    for d in top_dims(maxima[layer], args.top):
        layers = persistence(maxima, d, args.top)
        first, last = longest_run(layers)
        run = (f"only at layer {first}" if len(layers) == 1 else
               f"layers {first}-{last} without a break; {len(layers)} of {L} layers in all")
        table.note(f"  dim {d:>5}   max |h| {maxima[layer, d]:>9.1f}   {run}")
    table.note("", f"max |h| of the {D} dimensions at layer {layer} (log2 bins; one # per "
               "dimension, at most 40):")
    for b in log2_histogram(maxima[layer]):
        table.note(f"{b.low:>6.0f} - {b.high:>6.0f} | {'#' * min(b.count, 40):<40} {b.count}")
    table.plot("layer", ["max |h|", "median dim"], "largest and median dimension of the "
               "residual stream, layer by layer", logy=True)
    table.show()


if __name__ == "__main__":
    from _common import run
    run(main)
