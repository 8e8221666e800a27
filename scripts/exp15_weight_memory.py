"""Experiment 15: the weights in memory, at 4, 2 and 1 bytes and in each quantized form.

The chapter: half a billion parameters are 1.98 GB at four bytes, 0.99 GB at two, 0.49 GB at
one. First that arithmetic for this model, then the real thing: every projection matrix
quantized by each scheme and the bytes the model then holds, measured two ways: the sizes of
the buffers it keeps (codes, scales, the floats that stay) and, on NumPy, the allocator's own
count of what quantizing left allocated (tracemalloc). The embedding (and tied head), norms and
biases stay float32 in every row, as in the chapter's quantized models. llama.cpp's k-quants
(Q2_K..Q6_K) are held as their GGUF blocks, so their expected bytes are the block layout's
(144 bytes per 256 weights for Q4_K); a matrix whose rows are not whole super-blocks of 256 is
held in llama-quantize's fallback type, and a note says how many.
"""
import argparse
import tracemalloc
from collections import Counter

import numpy as np

from _common import Progress, add_model_argument, add_schemes_argument, load_model, model_name
from _table import Table

from minitransformer.backend import BACKEND, to_numpy
from quant.qmodel import SCHEMES, projection_names, quantize_model, resident_bytes


def decimal(n: float) -> str:
    """Bytes in decimal units, as the chapter writes them (0.5 B params x 4 = 1.98 GB)."""
    for unit, name in ((1e9, "GB"), (1e6, "MB"), (1e3, "KB")):
        if n >= unit:
            return f"{n / unit:.2f} {name}"
    return f"{n:.0f} B"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_argument(parser)
    add_schemes_argument(parser)
    args = parser.parse_args(argv)
    model = load_model(args.model)
    schemes = args.schemes

    names = projection_names(model.weights)
    shapes = [tuple(model.weights[n].shape) for n in names]
    n_proj = sum(a * b for a, b in shapes)
    n_all = sum(int(np.prod(w.shape)) for w in model.weights.values())
    base = resident_bytes(model.weights)
    rows = [("fp32", 32.0, base["projections"], 4 * n_proj, base["other"], None),
            ("fp16 (cast)", 16.0, sum(to_numpy(model.weights[n]).astype(np.float16).nbytes
                                      for n in names), 2 * n_proj, base["other"], None)]
    progress = Progress(len(schemes), "quantizing")
    held_as = {}   # k-quant label -> GGUF type -> matrices held so
    for scheme in schemes:
        tracing = BACKEND == "numpy"
        if tracing:
            tracemalloc.start()
        quantized = quantize_model(model, scheme)
        allocated = tracemalloc.get_traced_memory()[0] if tracing else None
        if tracing:
            tracemalloc.stop()
        held = resident_bytes(quantized.weights)
        s = SCHEMES[scheme]  # expected: what the scheme's bits and group say, from the shapes
        if s.gguf is not None:
            held_as[s.label] = Counter(quantized.weights[n].type_name for n in names)
        rows.append((s.label, 8 * held["projections"] / n_proj, held["projections"],
                     sum(s.nbytes(shape) for shape in shapes), held["other"] + held["levels"],
                     allocated))
        del quantized
        progress(s.label)

    table = Table(f"Experiment 15: weights in memory ({model_name(model)})", experiment=15,
                  chapter=False, columns=[("all parameters at", ""), ("4 bytes", decimal),
                                          ("2 bytes", decimal), ("1 byte", decimal)])
    table.header(f"{n_all:,} parameters, {n_proj:,} of them in {len(names)} projection matrices")
    table.row("", n_all * 4, n_all * 2, n_all)
    table.show()
    table = Table("Measured: bytes held once the projection matrices are quantized (embedding, "
                  "norms, biases: float32)", experiment=15, columns=[
                      ("projections", ""), ("bits/weight", ".3f"), ("held B", ",d"),
                      ("expected B", ",d"), ("other B", ",d"), ("total MB", ".2f"),
                      ("vs fp32", lambda v: f"{v:.2f}x"), ("allocator B", ",d")])
    fp32_total = rows[0][2] + rows[0][4]
    for label, bpw, held, expected, other, allocated in rows:
        total = held + other
        table.row(label, bpw, held, expected, other, total / 1e6, fp32_total / total, allocated)
    table.note("held = the codes and scales actually kept; expected = codes at their width plus "
               "one float16 per scale (for Q2_K..Q6_K: the GGUF block layout's bytes);",
               "allocator = bytes tracemalloc saw still allocated after quantizing (the float "
               "model still alive), NumPy only")
    for label, types in held_as.items():
        if len(types) > 1:
            kinds = ", ".join(f"{n} {t}" for t, n in types.most_common())
            table.note(f"{label}: its {len(names)} matrices held as {kinds} (rows that are not "
                       "whole super-blocks of 256 take llama-quantize's fallback type)")
    table.plot("projections", ["total MB"], "weights in memory per scheme", kind="bar",
               xlabel="storage scheme", ylabel="weights in memory (MB)")
    table.show()


if __name__ == "__main__":
    from _common import run
    run(main)
