"""Experiment 16: absmax (and NF4) quantization error over every projection matrix.

For each scheme, the relative error ||W - W_hat|| / ||W|| of every projection matrix: the mean
and the worst matrix. The chapter, on Qwen2.5-0.5B's 168 matrices: INT4 per-tensor collapses
(worst matrix 0.99), per-row divides the error by 3.4, group-128 again, and NF4 is 28% below
group-128 (0.0952 vs 0.1323) at 4.25 vs 4.125 bits per weight.
"""
import argparse
import time

from _common import add_model_argument, add_schemes_argument, load_model, model_name, progress, say
from _table import Table
from quant.analysis import error_table
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
    out.plot("scheme", ["mean", "worst"], "quantization error per scheme (relative, per matrix)",
             kind="bar", logy=True, xlabel="quantization scheme",
             ylabel="relative error (||W - W_hat|| / ||W||)",
             chapter=[("INT4 per-tensor", 0.99, "worst matrix 0.99"),
                      ("NF4 (block 64)", 0.0952, "NF4 0.0952"),
                      ("INT4 group-128", 0.1323, "group-128 0.1323")])
    out.show()


if __name__ == "__main__":
    from _common import run
    run(main)
