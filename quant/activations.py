"""Outlier features in the residual stream, and what they do to INT8 activations.

Serves experiments 18 and 19. Run a prompt through the model, keep the residual stream h
after every layer, and look at each hidden dimension's largest magnitude over the tokens: in
trained models a handful of dimensions are orders of magnitude bigger than the rest, and they
are the same dimensions layer after layer (Dettmers et al. 2022, "LLM.int8()"). Then quantize
one layer's activation tensor to INT8 with a single absmax scale and count the levels that are
actually used: the outliers set the step, and ordinary dimensions collapse to a level or two.
Leaves out: inputs of individual matmuls (techniques.py looks at one), attention internals.
"""
from dataclasses import dataclass

import numpy as np

from minitransformer.backend import to_numpy
from minitransformer.model import block, embed, prepare
from quant.int8 import int8_codes

# An ordinary paragraph (written for this project), about 84 tokens with Qwen2.5's tokenizer.
PROMPT = ("The old lighthouse keeper climbed the spiral stairs every evening at dusk, carrying "
          "a tin of oil and a cloth for the lens. From the top he could see the fishing boats "
          "coming home to the harbour, their lights bobbing on the dark water. He had done this "
          "for forty years, and he knew each boat by the shape of its sail and the sound of its "
          "engine. Tonight the wind was rising, and he watched the last boat")


def default_layer(num_layers: int) -> int:
    """Two thirds of the way up (the chapter's layer 16 of 24), leaving a layer after it."""
    return max(0, min(round(2 * num_layers / 3), num_layers - 2))


def capture_residuals(model, ids) -> np.ndarray:
    """One prompt (T,) -> the residual stream after each layer, float32 (L, T, D) on the host."""
    ids = np.asarray(ids, dtype=np.int64)[None]                         # (1, T)
    batch, h, residuals = prepare(model, ids), embed(model, ids), []
    for i in range(model.config.num_hidden_layers):                     # forward, layer by layer
        h = block(model, i, h, batch)                                   # (1, T, D)
        residuals.append(to_numpy(h[0]))
    return np.stack(residuals)


def per_dim_max(h: np.ndarray) -> np.ndarray:
    """(L, T, D) -> (L, D): the largest |h| each dimension reaches over the tokens, per layer."""
    return np.abs(h).max(axis=1)


@dataclass(frozen=True)
class Bin:
    low: float
    high: float
    count: int


def log2_histogram(values: np.ndarray) -> list[Bin]:
    """Count values in [0, 1), [1, 2), [2, 4), ... up to the octave that holds the largest."""
    top = max(float(values.max()), 1.0)
    edges = [0.0] + [2.0 ** k for k in range(int(np.floor(np.log2(top))) + 2)]
    counts, _ = np.histogram(values, bins=edges)  # the last bin is closed: it holds the max
    return [Bin(lo, hi, int(c)) for lo, hi, c in zip(edges[:-1], edges[1:], counts, strict=True)]


def top_dims(maxima: np.ndarray, k: int) -> np.ndarray:
    """(D,) -> the k dimensions with the largest maxima, largest first."""
    return np.argsort(-maxima, kind="stable")[:k]


def persistence(maxima: np.ndarray, dim: int, k: int) -> list[int]:
    """(L, D) -> the layers at which `dim` is one of the k largest dimensions."""
    return [layer for layer in range(len(maxima)) if dim in top_dims(maxima[layer], k)]


def longest_run(layers: list[int]) -> tuple[int, int]:
    """The longest stretch of consecutive layers in a sorted list, as (first, last)."""
    best, start = (layers[0], layers[0]), layers[0]
    after = [*layers[1:], layers[-1] + 2]  # each one's next; past the last, none that runs on
    for previous, layer in zip(layers, after, strict=True):
        if layer != previous + 1:
            if previous - start > best[1] - best[0]:
                best = (start, previous)
            start = layer
    return best


@dataclass(frozen=True)
class Int8Levels:
    scale: float               # max |h| / 127
    used: int                  # distinct INT8 codes in the whole tensor
    per_dim: dict              # dim -> distinct codes used by that dimension's values


def int8_levels(h: np.ndarray, dims, exclude: int = 0) -> Int8Levels:
    """Quantize an activation tensor (T, D) to INT8 with one absmax scale and count levels.

    exclude: leave the `exclude` dimensions with the largest maxima out of the scale and the
    count (what a mixed-precision decomposition would keep in float).
    """
    kept = np.ones(h.shape[1], bool)
    kept[top_dims(np.abs(h).max(axis=0), exclude)] = False
    scale = float(np.abs(h[:, kept]).max()) / 127
    codes = int8_codes(h, scale)
    return Int8Levels(scale=scale, used=len(np.unique(codes[:, kept])),
                      per_dim={int(d): len(np.unique(codes[:, d])) for d in dims})


def quantile_dims(maxima: np.ndarray, quantiles=(0.9, 0.5, 0.1)) -> list[int]:
    """(D,) -> the dimension whose max sits at each quantile of all maxima (typical dims)."""
    order = np.argsort(maxima, kind="stable")
    return [int(order[int(round(q * (len(order) - 1)))]) for q in quantiles]
