"""How close quant/'s llama.cpp quantizers come to llama.cpp's own C: the share of blocks and
bytes that differ, per type, built two ways.

The gguf package implements the quantizers of Q8_0, Q5_0 and Q5_1 (tests/quant/test_quant_gguf.py
compares those byte for byte) but not the k-quants nor IQ4_NL, so those are measured against
the C: ``--ggml DIR`` names a ggml or llama.cpp checkout, whose ggml-quants.c is compiled here
(``cc``, as a shared library beside a few stubs for what it calls of the rest of ggml) and its
``quantize_row_*_ref`` / ``quantize_iq4_nl`` called on the same matrices. Built twice: plain
``-O2`` (every float operation rounded, as NumPy rounds), and ``-O2 -march=native``, where the
compiler fuses a multiply and an add into one rounding if the CPU has FMA (llama.cpp's own
builds are native by default), so its bytes depend on the machine that ran llama-quantize.

The matrices: 1,024 super-blocks of Gaussian weights, and with ``--model`` every projection
matrix of that model (the k-quants: those whose rows are whole super-blocks of 256).
Nothing from the checkout is kept or copied: it is compiled into a temporary folder.
"""
import argparse
import ctypes
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: _common, _table

from _common import add_model_argument, load_model, model_name, say
from _table import Table

from minitransformer.backend import to_numpy
from minitransformer.formats.gguf_types import FORMATS
from quant.gguf_weight import QUANTIZERS
from quant.qmodel import projection_names

TYPES = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "Q8_0", "Q5_0", "Q5_1")
STUBS = """
#include <stdio.h>
#include <stdlib.h>
#include <stddef.h>
#include <stdint.h>
void ggml_abort(const char * file, int line, const char * fmt, ...) {
    fprintf(stderr, "ggml_abort %s:%d\\n", file, line); abort(); }
const char * ggml_type_name(int t) { return "?"; }
size_t ggml_type_size(int t) { abort(); }
size_t ggml_row_size(int t, int64_t n) { abort(); }
"""
BUILDS = {"-O2": ["-O2"], "-O2 -march=native": ["-O2", "-march=native"]}


def sources(root: Path) -> tuple[Path, list]:
    """A ggml or llama.cpp checkout -> (ggml-quants.c, include folders), or a ValueError."""
    for ggml in (root, root / "ggml"):
        quants = ggml / "src" / "ggml-quants.c"
        if quants.is_file():
            return quants, [ggml / "include", ggml / "src", ggml / "src" / "ggml-cpu"]
    raise ValueError(f"{root}: no src/ggml-quants.c or ggml/src/ggml-quants.c: not a ggml or "
                     "llama.cpp checkout")


def build(root: Path, flags: list, folder: Path) -> ctypes.CDLL:
    quants, includes = sources(root)
    stubs = folder / "stubs.c"
    stubs.write_text(STUBS)
    out = folder / f"libquants{len(list(folder.glob('*.so')))}.so"
    command = ["cc", *flags, "-std=gnu11", "-fPIC", "-shared", *(f"-I{i}" for i in includes),
               str(quants), str(stubs), "-o", str(out), "-lm"]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise ValueError(f"cc failed on {quants}: {done.stderr.strip().splitlines()[-1]}")
    return ctypes.CDLL(str(out))


def theirs(lib, type_name: str, w: np.ndarray) -> np.ndarray:
    """llama-quantize's bytes for w (out, in), without an importance matrix."""
    x = np.ascontiguousarray(w, np.float32)
    block = FORMATS[type_name]
    out = np.zeros(x.size // block.weights * block.nbytes, np.uint8)
    pointers = (x.ctypes.data_as(ctypes.c_void_p), out.ctypes.data_as(ctypes.c_void_p))
    if type_name == "IQ4_NL":
        lib.quantize_iq4_nl(*pointers, ctypes.c_int64(len(x)), ctypes.c_int64(x.shape[1]), None)
    else:
        getattr(lib, f"quantize_row_{type_name[:2].lower()}{type_name[2:]}_ref")(
            *pointers, ctypes.c_int64(x.size))
    return out.reshape(len(x), -1)


def differences(lib, type_name, matrices) -> tuple[int, int, int, int]:
    """-> (blocks that differ, blocks, bytes that differ, bytes) over the matrices."""
    nbytes = FORMATS[type_name].nbytes
    counts = np.zeros(4, np.int64)
    for w in matrices:
        ours, c = QUANTIZERS[type_name](w), theirs(lib, type_name, w)
        differ = ours.reshape(-1, nbytes) != c.reshape(-1, nbytes)
        counts += (differ.any(axis=1).sum(), len(differ), differ.sum(), differ.size)
    return tuple(int(n) for n in counts)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ggml", required=True, type=Path, metavar="DIR",
                        help="a ggml or llama.cpp checkout (its ggml-quants.c is compiled)")
    add_model_argument(parser, default=None)
    args = parser.parse_args(argv)
    sources(args.ggml)
    sets = {"Gaussian (256 x 1024)":
            [np.random.default_rng(0).standard_normal((256, 1024)).astype(np.float32)]}
    if args.model is not None:
        model = load_model(args.model)
        sets[model_name(model)] = [to_numpy(model.weights[n])
                                   for n in projection_names(model.weights)]
    table = Table("llama.cpp's quantizers in NumPy (quant/) against its C (ggml-quants.c)",
                  columns=[("matrices", ""), ("type", ""), ("build", ""), ("blocks", ",d"),
                           ("blocks differ", ".4%"), ("bytes differ", ".4%")])
    with tempfile.TemporaryDirectory() as folder:
        libs = {name: build(args.ggml, flags, Path(folder)) for name, flags in BUILDS.items()}
        for label, matrices in sets.items():
            for type_name in TYPES:
                fit = [w for w in matrices if w.shape[1] % FORMATS[type_name].weights == 0]
                if not fit:
                    continue
                for build_name, lib in libs.items():
                    say(f"{label}: {type_name}, cc {build_name}")
                    blocks_differ, blocks, bytes_differ, nbytes = differences(lib, type_name,
                                                                              fit)
                    table.row(label, type_name, build_name, blocks, blocks_differ / blocks,
                              bytes_differ / nbytes)
    table.note("-O2: every float operation rounded; -march=native: the compiler may fuse a "
               "multiply and an add (FMA) into one rounding, as llama.cpp's native builds do")
    table.show()


if __name__ == "__main__":
    from _common import run
    run(main)
