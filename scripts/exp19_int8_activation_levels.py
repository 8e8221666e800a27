"""Experiment 19: INT8 of the outlier-laden activation tensor, level by level.

Quantize the residual stream after one layer (tokens x dimensions) to INT8 with one absmax
scale for the whole tensor, and count the distinct levels used: overall, and for a few
ordinary dimensions. Then again with the top 4 dimensions left out of the scale. The chapter
(Qwen2.5-0.5B, layer 16, 84 tokens): 14 of 256 levels; step 12.44 (scale 12.4378) set by
1,579.6; dims 826 / 336 / 96 get 1 level each; without the top 4 dims the scale is 0.5749
(22x smaller) and they get 8 / 4 / 3 levels. The dimensions shown are, by default, the ones
whose max sits at the 90th, 50th and 10th percentile of all dimensions' maxima.
"""
import argparse

import numpy as np

from _common import add_model_argument, choose_layer, integers, load_model, model_name, say
from _table import Table

from minitransformer.tokenizer import encode_prompt
from quant.activations import PROMPT, capture_residuals, int8_levels, quantile_dims


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_argument(parser, default="smollm2")
    parser.add_argument("--prompt", default=PROMPT)
    parser.add_argument("--layer", type=int, default=None,
                        help="layer whose output is quantized (default: two thirds of the way)")
    parser.add_argument("--exclude", type=int, default=4, help="top dimensions left out")
    parser.add_argument("--dims", type=integers, default=None,
                        help="comma-separated dimensions to show")
    args = parser.parse_args(argv)
    model = load_model(args.model)
    ids = encode_prompt(model, args.prompt)
    layer = choose_layer(args.layer, model.config.num_hidden_layers)
    say(f"forward pass over {len(ids)} tokens")
    h = capture_residuals(model, ids)[layer]                           # (T, D)
    maxima = np.abs(h).max(axis=0)                                     # (D,)
    dims = args.dims or quantile_dims(maxima)
    if not all(0 <= d < h.shape[1] for d in dims):
        raise ValueError(f"--dims must be in 0..{h.shape[1] - 1}")
    one = int8_levels(h, dims)
    kept = int8_levels(h, dims, exclude=args.exclude)

    table = Table(f"Experiment 19: INT8 of the activations after layer {layer} "
                  f"({h.shape[0]} tokens x {h.shape[1]} dims), {model_name(model)}", experiment=19)
    table.random_weights(model)
    table.note(f"levels used: {one.used} of 256   (step {one.scale:.4g} = max |h| "
               f"{maxima.max():.1f} / 127)")
    table.note(f"typical |h|: median {np.median(np.abs(h)):.2f}, 99th percentile "
               f"{np.percentile(np.abs(h), 99):.2f}")
    table.note("")
    table.note(f"single tensor-wide scale = {one.scale:.4f}")
    for d in dims:
        n = one.per_dim[d]
        table.note(f"  dim {d:>3} (max |h| = {maxima[d]:.2f}):  {n} distinct level"
                   f"{'' if n == 1 else 's'} out of 256")
    table.note("")
    ratio = one.scale / kept.scale
    table.note(f"after excluding the top {args.exclude} dimensions, scale = {kept.scale:.4f}  "
               f"({ratio:.{0 if ratio >= 10 else 1}f}x smaller)")
    table.note("  " + "    ".join(f"dim {d:>3}: {kept.per_dim[d]} levels" for d in dims))
    table.note(f"  levels used by the other dimensions: {kept.used} of 256")
    table.show()


if __name__ == "__main__":
    from _common import run
    run(main)
