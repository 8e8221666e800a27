"""A model whose projection matrices are held quantized, and what it holds in memory.

Serves experiments 15 (resident bytes), 16 (which matrices count) and 21 (the model that is
evaluated). Every projection matrix (q, k, v, o, gate, up, down of every layer: 7 per layer,
168 in Qwen2.5-0.5B) is replaced by a QWeight of the chosen scheme (schemes.py); the forward
pass sees a quantized weight (`minitransformer.linear.is_quantized`) and lets it multiply
itself. The embedding (and so the tied head), the norms and the biases stay float32, as in
the chapter. `dequantize_model` goes back: every QWeight replaced by its float matrix.

Memory is measured, not computed: `resident_bytes` adds up the buffers the model holds, each
once. The float matrices are dropped as soon as they are quantized, so once the caller lets go
of the float model only the codes and scales remain.
Leaves out: quantizing the embedding or head, saving quantized checkpoints.
"""
import re
from dataclasses import replace
from numbers import Real

from minitransformer.linear import is_quantized
from quant.schemes import SCHEMES, check_scheme  # noqa: F401 (SCHEMES: imported from here too)

PROJECTION = re.compile(r"layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight$")


def projection_names(weights: dict) -> list[str]:
    """The names of the projection matrices, in layer order (as the checkpoint lists them)."""
    def layer(name):
        found = re.search(r"layers\.(\d+)\.", name)
        assert found, name      # it matched PROJECTION, which reads layers.N.
        return int(found.group(1))
    return sorted((n for n in weights if PROJECTION.search(n)), key=layer)


def check_threshold(threshold):
    """None (weight-only) or a magnitude >= 0 (inf: every column INT8); else a ValueError."""
    if threshold is None:
        return None
    if isinstance(threshold, bool) or not isinstance(threshold, Real) or not float(threshold) >= 0:
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
    quantize = check_scheme(scheme).quantize
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


def dequantize_model(model):
    """Model -> the same model with every quantized weight replaced by its float32 matrix.

    The same function as the quantized model (the matrices `QWeight.dequantize` specifies),
    held as floats again: 4 bytes a weight, multiplied at float speed.
    """
    return replace(model, weights={name: w.dequantize() if is_quantized(w) else w
                                   for name, w in model.weights.items()})


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
        if is_quantized(w):
            for kind, arrays in w.buffers().items():
                for array in arrays:
                    count(kind, array)
        else:
            count("projections" if PROJECTION.search(name) else "other", w)
    return total
