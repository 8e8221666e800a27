"""Experiment 15: the weights in memory, at 4, 2 and 1 bytes and in each quantized form.

The chapter: half a billion parameters are 1.98 GB at four bytes, 0.99 GB at two, 0.49 GB at
one. First that arithmetic for this model, then the real thing: every projection matrix
quantized by each scheme and the bytes the model then holds, measured two ways: the sizes of
the buffers it keeps (codes, scales, the floats that stay) and, on NumPy, the allocator's own
count of what quantizing left allocated (tracemalloc). The embedding (and tied head), norms and
biases stay float32 in every row, as in the chapter's quantized models.
"""
import argparse
import time
import tracemalloc

import numpy as np

from _common import add_model_argument, add_schemes_argument, load_model, progress
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
    for i, scheme in enumerate(schemes, 1):
        start = time.perf_counter()
        tracing = BACKEND == "numpy"
        if tracing:
            tracemalloc.start()
        quantized = quantize_model(model, scheme)
        allocated = tracemalloc.get_traced_memory()[0] if tracing else None
        if tracing:
            tracemalloc.stop()
        held = resident_bytes(quantized.weights)
        s = SCHEMES[scheme]  # expected: what the scheme's bits and group say, from the shapes
        rows.append((s.label, 8 * held["projections"] / n_proj, held["projections"],
                     sum(s.nbytes(shape) for shape in shapes), held["other"] + held["levels"],
                     allocated))
        del quantized
        progress(i, len(schemes), f"{s.label}: {time.perf_counter() - start:.1f} s")

    print(f"Experiment 15: weights in memory ({model.path})")
    print(f"{n_all:,} parameters, {n_proj:,} of them in {len(names)} projection matrices")
    print()
    print(f"{'all parameters at':<22}{'4 bytes':>14}{'2 bytes':>14}{'1 byte':>14}")
    print(f"{'':<22}" + "".join(f"{decimal(n_all * b):>14}" for b in (4, 2, 1)))
    print()
    print("measured: bytes held once the projection matrices are quantized "
          "(embedding, norms, biases: float32)")
    header = (f"{'projections':<18}{'bits/weight':>12}{'held (B)':>15}{'expected (B)':>15}"
              f"{'other (B)':>13}{'total (MB)':>12}{'vs fp32':>9}{'allocator (B)':>15}")
    print(header)
    fp32_total = rows[0][2] + rows[0][4]
    for label, bpw, held, expected, other, allocated in rows:
        total = held + other
        print(f"{label:<18}{bpw:>12.3f}{held:>15,}{expected:>15,}{other:>13,}"
              f"{total / 1e6:>12.2f}{fp32_total / total:>8.2f}x"
              f"{'' if allocated is None else f'{allocated:,}':>15}")
    print()
    print("held = the codes and scales actually kept; expected = codes at their width plus one "
          "float16 per scale;")
    print("allocator = bytes tracemalloc saw still allocated after quantizing (the float model "
          "still alive), NumPy only")


if __name__ == "__main__":
    from _common import run
    run(main)
