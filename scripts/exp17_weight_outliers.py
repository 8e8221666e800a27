"""Experiment 17: one matrix's outliers, the reason one scale per tensor fails at 4 bits.

Magnitude statistics of one projection matrix: mean |w|, standard deviation, max |w|, max/std,
and the weights beyond 6 sigma. The chapter's matrix is model.layers.12.mlp.down_proj.weight of
Qwen2.5-0.5B (896 x 4864: mean |w| 0.01386, std 0.01822, max 0.43945, max/std 24.1, 692 of
4,358,144 beyond 6 sigma). Another model's layer 12 is nobody's reference, so any other model
gets, by a stated rule, the matrix whose INT4 per-tensor error is the worst: the one where a
single scale does the most harm, which is what this experiment explains. The table says which
rule chose the matrix. Then what a single scale does to it at 8 and 4 bits.
"""
import argparse

import numpy as np

from _common import add_model_argument, is_chapter_model, load_model, model_name, say
from _table import Table

from minitransformer.backend import to_numpy
from quant.absmax import absmax_per_tensor
from quant.analysis import error_table, outlier_stats

CHAPTER_MATRIX = "model.layers.12.mlp.down_proj.weight"


def choose_matrix(model, requested):
    """-> (name of the matrix to study, why that one)."""
    if requested:
        return requested, "asked (--matrix)"
    if is_chapter_model(model.config) and CHAPTER_MATRIX in model.weights:
        return CHAPTER_MATRIX, "the chapter's matrix"
    say("not the chapter's model: measuring every matrix's INT4 per-tensor error")
    name, error = error_table(model.weights, ["int4-tensor"])[0].worst
    return name, (f"the worst INT4 per-tensor error of this model ({error:.3f}); not the "
                  "chapter's model, so its layers.12 stands for nothing")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_argument(parser, default="smollm2")
    parser.add_argument("--matrix", default=None, metavar="NAME",
                        help=f"tensor name (default: {CHAPTER_MATRIX} on the chapter's "
                             "Qwen2.5-0.5B, else the matrix with the worst INT4 per-tensor error)")
    parser.add_argument("--sigmas", type=float, default=6.0)
    args = parser.parse_args(argv)
    model = load_model(args.model)
    name, why = choose_matrix(model, args.matrix)
    if name not in model.weights:
        raise ValueError(f"{name!r} is not a tensor of {model.path}")
    say(f"matrix: {name}")
    w = to_numpy(model.weights[name])
    s = outlier_stats(name, w, args.sigmas)

    table = Table(f"Experiment 17: one matrix's outliers, {model_name(model)}", experiment=17)
    table.random_weights(model)
    table.note(f"{s.name}   ({s.shape[0]} x {s.shape[1]})")
    table.note(f"chosen as {why}")
    table.note(f"mean |w| {s.mean_abs:.5f}   std {s.std:.5f}   max |w| {s.max_abs:.5f}   "
               f"max/std {s.max_over_std:.1f}")
    table.note(f"weights beyond {s.sigmas:g} sigma: {s.beyond:,} of {s.size:,}   "
               f"({100 * s.beyond / s.size:.3f} %)")
    table.note("")
    table.note("one scale for the whole matrix:")
    for bits in (8, 4):
        q = absmax_per_tensor(w, bits)
        step = float(to_numpy(q.scales).astype(np.float32)[0, 0])
        values, counts = np.unique(to_numpy(q.unpacked_codes()), return_counts=True)
        top3 = np.sort(counts)[::-1][:3].sum() / w.size
        table.note(f"  INT{bits}: step {step:.5f} = {step / s.std:.2f} std; {len(values)} of "
                   f"{2 ** bits} levels used, the 3 busiest hold {100 * top3:.1f}% of the weights; "
                   f"error {q.error:.4f}")
    table.show()


if __name__ == "__main__":
    from _common import run
    run(main)
