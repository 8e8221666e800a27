"""A model whose projection matrices are held quantized, and what it holds in memory.

Serves experiments 15 (resident bytes), 16 (which matrices count) and 21 (the model that is
evaluated). Every projection matrix (q, k, v, o, gate, up, down of every layer: 7 per layer,
168 in Qwen2.5-0.5B) is replaced by a QWeight of the chosen scheme; the forward pass sees an
object with `.matmul` and multiplies through it (minitransformer.model.linear). The
embedding (and so the tied head), the norms and the biases stay float32, as in the chapter.

Memory is measured, not computed: `resident_bytes` adds up the buffers the model holds, each
once. The float matrices are dropped as soon as they are quantized, so once the caller lets go
of the float model only the codes and scales remain.
Leaves out: quantizing the embedding or head, saving quantized checkpoints.
"""
import re
from dataclasses import replace
from numbers import Real

from quant.absmax import absmax_per_group, absmax_per_row, absmax_per_tensor
from quant.nf4 import nf4

PROJECTION = re.compile(r"layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight$")

# CLI name -> (the chapter's label, the quantizer). Order: the rows of the chapter's tables.
SCHEMES = {
    "int8-tensor": ("INT8 per-tensor", lambda w: absmax_per_tensor(w, 8)),
    "int8-row": ("INT8 per-row", lambda w: absmax_per_row(w, 8)),
    "int4-tensor": ("INT4 per-tensor", lambda w: absmax_per_tensor(w, 4)),
    "int4-row": ("INT4 per-row", lambda w: absmax_per_row(w, 4)),
    "int4-g128": ("INT4 group-128", lambda w: absmax_per_group(w, 4, 128)),
    "nf4": ("NF4 (block 64)", lambda w: nf4(w, 64)),
}


def projection_names(weights: dict) -> list[str]:
    """The names of the projection matrices, in layer order (as the checkpoint lists them)."""
    def layer(name):
        return int(re.search(r"layers\.(\d+)\.", name).group(1))
    return sorted((n for n in weights if PROJECTION.search(n)), key=layer)


def check_scheme(scheme: str) -> str:
    if scheme not in SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}; choose from {', '.join(SCHEMES)}")
    return scheme


def check_threshold(threshold):
    """None (weight-only) or a magnitude >= 0 (inf: every column INT8); else a ValueError."""
    if threshold is None:
        return None
    if isinstance(threshold, bool) or not isinstance(threshold, Real) or not threshold >= 0:
        raise ValueError(f"outlier_threshold must be None or a number >= 0 (inf allowed), "
                         f"got {threshold!r}")
    return float(threshold)


def quantize_model(model, scheme: str, outlier_threshold: float | None = None, progress=None):
    """Model -> the same model with every projection matrix quantized by `scheme`.

    outlier_threshold: None keeps activations float (weight-only quantization); a number
    also quantizes each matmul's input to INT8 per token, keeping columns above it in float
    (LLM.int8; its default is 6.0); inf quantizes every column. progress(i, n, name) is
    called before each matrix.
    """
    _, quantize = SCHEMES[check_scheme(scheme)]
    outlier_threshold = check_threshold(outlier_threshold)
    names = projection_names(model.weights)
    if not names:
        raise ValueError(f"{model.path or 'model'}: no projection matrices to quantize")
    weights = dict(model.weights)  # a new dict: the caller's model is left as it was
    for i, name in enumerate(names):
        if progress is not None:
            progress(i, len(names), name)
        try:
            q = quantize(weights[name])
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None
        weights[name] = replace(q, outlier_threshold=outlier_threshold)
    return replace(model, weights=weights)


def resident_bytes(weights) -> dict:
    """Bytes held by a weights dict (or a Model: its .weights), each buffer counted once.

    -> {"projections": codes + scales (or floats) of the projection matrices,
        "levels": the shared code tables, "other": embedding, norms, biases}
    """
    weights = getattr(weights, "weights", weights)
    if not isinstance(weights, dict):
        raise ValueError(f"expected a weights dict or a Model, got {type(weights).__name__}")
    seen, total = set(), {"projections": 0, "levels": 0, "other": 0}

    def count(kind, array):
        if id(array) not in seen:
            seen.add(id(array))
            total[kind] += int(array.nbytes)

    for name, w in weights.items():
        if hasattr(w, "codes"):  # a QWeight
            count("projections", w.codes)
            count("projections", w.scales)
            count("levels", w.levels)
        else:
            count("projections" if PROJECTION.search(name) else "other", w)
    return total
