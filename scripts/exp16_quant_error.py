"""Experiment 16: absmax (and NF4) quantization error over every projection matrix.

For each scheme, the relative error ||W - W_hat|| / ||W|| of every projection matrix: the mean
and the worst matrix. The chapter, on Qwen2.5-0.5B's 168 matrices: INT4 per-tensor collapses
(worst matrix 0.99), per-row divides the error by 3.4, group-128 again, and NF4 is 28% below
group-128 (0.0952 vs 0.1323) at 4.25 vs 4.125 bits per weight. llama.cpp's k-quants (Q2_K..Q6_K,
quant/kquants.py) need rows of whole super-blocks of 256; a matrix whose rows are not (SmolLM2's
576) is held in llama-quantize's fallback type and measured so, and a second table compares
every scheme on the matrices the k-quants hold themselves.
"""
import argparse
import time

import numpy as np

from _common import add_model_argument, add_schemes_argument, load_model, model_name, progress, say
from _table import Table

from minitransformer.backend import to_numpy
from quant.analysis import error_table
from quant.gguf_weight import FALLBACK
from quant.kquants import SUPER
from quant.qmodel import SCHEMES, projection_names


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_argument(parser, default="smollm2")
    add_schemes_argument(parser)
    args = parser.parse_args(argv)
    model = load_model(args.model)

    start = time.perf_counter()
    names = projection_names(model.weights)
    every = max(1, len(names) // 24)  # about 24 progress lines, whatever the model's size

    def report(i, n, name):
        if (i + 1) % every == 0 or i + 1 == n:
            progress(i + 1, n, f"{name} ({time.perf_counter() - start:.1f} s)")

    table = error_table(model.weights, args.schemes, progress=report)
    say(f"quantized {len(names)} matrices x {len(table)} schemes in "
        f"{time.perf_counter() - start:.1f} s")

    params = sum(model.weights[n].shape[0] * model.weights[n].shape[1] for n in names)
    out = Table(f"Experiment 16: quantization error over {len(names)} projection matrices "
                f"({params / 1e6:.1f} M parameters), {model_name(model)}", experiment=16, columns=[
                    ("scheme", ""), ("bits/weight", ".3f"), ("mean", ".4f"), ("worst", ".4f"),
                    ("worst matrix", "")])
    out.header("relative error ||W - W_hat|| / ||W||, per matrix").random_weights(model)
    for row in table:
        name, worst = row.worst
        out.row(row.label, row.bits_per_weight, row.mean, worst, name)
    by = {row.scheme: row for row in table}
    steps = [("int4-tensor", "int4-row"), ("int4-row", "int4-g128"), ("int4-g128", "nf4"),
             ("int8-tensor", "int8-row")]
    for a, b in steps:
        if a in by and b in by:
            out.note(f"{by[a].label} -> {by[b].label}: mean error / "
                     f"{by[a].mean / by[b].mean:.2f} ({by[b].bits_per_weight:.3f} vs "
                     f"{by[a].bits_per_weight:.3f} bits/weight)")
    group = SCHEMES["int4-g128"].group
    short = [n for n in names if model.weights[n].shape[1] < group]
    if short and "int4-g128" in by:
        out.note(f"note: {len(short)} of {len(names)} matrices have rows shorter than {group} "
                 f"weights; there a group of {group} is the whole row, and group-{group} equals "
                 "per-row")
    kquants = [row for row in table if SCHEMES[row.scheme].gguf is not None]
    fit = [n for n in names if model.weights[n].shape[1] % SUPER == 0]
    if kquants and len(fit) < len(names):
        out.note(f"{', '.join(row.label for row in kquants)}: {len(names) - len(fit)} of "
                 f"{len(names)} matrices have rows that are not whole super-blocks of {SUPER}; "
                 "there they are held (and measured) as llama-quantize holds them: " +
                 ", ".join(f"{k} as {v}" for k, v in FALLBACK.items()))
    out.plot("scheme", ["mean", "worst"], "quantization error per scheme (relative, per matrix)",
             kind="bar", logy=True, xlabel="quantization scheme",
             ylabel="relative error (||W - W_hat|| / ||W||)",
             chapter=[("INT4 per-tensor", 0.99, "worst matrix 0.99"),
                      ("NF4 (block 64)", 0.0952, "NF4 0.0952"),
                      ("INT4 group-128", 0.1323, "group-128 0.1323")])
    out.show()
    if kquants and fit and len(fit) < len(names):
        super_block_table(model, table, fit).show()


def super_block_table(model, table, fit) -> Table:
    """Every scheme on the matrices whose rows are whole super-blocks: the k-quants themselves."""
    shapes = [tuple(model.weights[n].shape) for n in fit]
    params = sum(a * b for a, b in shapes)
    out = Table(f"The {len(fit)} matrices whose rows are whole super-blocks of {SUPER} "
                f"({params / 1e6:.1f} M parameters): every scheme as itself", experiment=16,
                chapter=False, columns=[("scheme", ""), ("bits/weight", ".3f"), ("mean", ".4f"),
                                        ("worst", ".4f"), ("worst matrix", "")])
    for row in table:
        errors = {n: row.errors[n] for n in fit}
        worst = max(errors, key=errors.get)
        bits = 8 * sum(SCHEMES[row.scheme].nbytes(shape) for shape in shapes) / params
        out.row(row.label, bits, float(np.mean(list(errors.values()))), errors[worst], worst)
    on_grid = np.mean([share_on_a_4_bit_grid(to_numpy(model.weights[n])) for n in fit])
    if on_grid > 0.5:
        out.note(f"{on_grid:.0%} of these matrices' blocks of 32 hold at most 16 distinct "
                 "values: the weights already lie on a 4-bit grid per 32 (a Q4_1 file's, for "
                 "a model imported from one), which an affine format with sub-blocks of 32 "
                 "(Q4_K, Q5_K) nearly reproduces; their error here says where the weights "
                 "came from more than what the format does to trained weights")
    return out


def share_on_a_4_bit_grid(w) -> float:
    """The share of w's blocks of 32 consecutive weights (along rows) with <= 16 values."""
    blocks = np.sort(w.reshape(-1, 32), axis=1)                                 # (N, 32)
    distinct = 1 + (np.diff(blocks, axis=1) != 0).sum(axis=1)
    return float((distinct <= 16).mean())


if __name__ == "__main__":
    from _common import run
    run(main)
