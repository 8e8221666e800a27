"""The techniques the outliers justify, each measured on one real matmul.

Serves experiment 20. Take the residual stream after layer l (activations.py), normalize it
the way layer l+1 does (its input RMSNorm) and multiply by layer l+1's q_proj: Y = X W^T.
Each technique quantizes X and/or W its own way; the number reported is the output error
||Y - Y_hat|| / ||Y||, so weight and activation damage are counted together.

    INT8 per-tensor (W8A8)       one scale for X, one for W: outliers set both steps
    vector-wise (W8A8)           a scale per token of X, per output row of W
    LLM.int8 decomposition       vector-wise, plus X's columns with |x| > 6 kept in float
    SmoothQuant-style migration  divide column j of X by s_j, multiply W's column j by it
                                 (s_j = max|X_j|^a / max|W_j|^(1-a), a = 0.5): the product is
                                 unchanged and the outliers move into the easier weights;
                                 then W8A8 per-tensor
    group-128 / NF4 (W4A16)      weight-only: activations stay float, outliers untouched

GPTQ and AWQ (error-compensating rounding, activation-aware scaling) are named in the table
and not implemented. Leaves out: calibration sets (one prompt is the calibration here).
"""
from dataclasses import dataclass

import numpy as np

from minitransformer.backend import to_device, to_numpy
from minitransformer.model import rms_norm
from quant.absmax import absmax_per_group, absmax_per_row, absmax_per_tensor
from quant.int8 import fake_int8, int8_activations
from quant.nf4 import nf4


@dataclass(frozen=True)
class Technique:
    name: str
    remedy: str              # what it does about the outliers
    error: float | None      # output error on the measured matmul; None: not implemented
    note: str = ""


def fake_int8_per_tensor(x: np.ndarray) -> np.ndarray:
    """x on the INT8 grid of one absmax scale for the whole tensor (back in float units)."""
    return fake_int8(x, float(np.abs(x).max()) / 127)


def output_error(y: np.ndarray, y_hat: np.ndarray) -> float:
    return float(np.linalg.norm(y - y_hat) / np.linalg.norm(y))


def matmul_operands(model, residual: np.ndarray, layer: int) -> tuple[np.ndarray, np.ndarray]:
    """Residual (T, D) entering `layer` -> (X, W): q_proj's input (T, D) and weight (out, D)."""
    p = f"model.layers.{layer}."
    w = model.weights
    x = rms_norm(to_device(residual), w[p + "input_layernorm.weight"], model.config.rms_norm_eps)
    return to_numpy(x), to_numpy(w[p + "self_attn.q_proj.weight"])


def measure(x: np.ndarray, w: np.ndarray, threshold: float = 6.0, alpha: float = 0.5):
    """X (T, D), W (out, D) -> one Technique per row of the chapter's table."""
    y = x @ w.T                                                       # (T, out), the reference

    def err(x_hat, w_hat):
        return output_error(y, x_hat @ w_hat.T)

    w8_row = to_numpy(absmax_per_row(w, 8).dequantize())
    outliers = int((np.abs(x).max(axis=0) > threshold).sum())
    s = np.abs(x).max(axis=0) ** alpha / np.maximum(np.abs(w).max(axis=0), 1e-12) ** (1 - alpha)
    s = np.where(s > 0, s, 1.0)                                       # (D,) migration factors
    return [
        Technique("INT8 per-tensor (W8A8)", "none: the largest value sets everyone's step",
                  err(fake_int8_per_tensor(x), to_numpy(absmax_per_tensor(w, 8).dequantize()))),
        Technique("vector-wise INT8 (W8A8)", "a scale per token and per output row",
                  err(to_numpy(int8_activations(to_device(x), np.inf)), w8_row)),
        Technique(f"LLM.int8 decomposition (>{threshold:g})",
                  "outlier columns kept in float, the rest INT8",
                  err(to_numpy(int8_activations(to_device(x), threshold)), w8_row),
                  f"{outliers} of {x.shape[1]} columns in float"),
        Technique(f"SmoothQuant migration (a={alpha:g})",
                  "divides outlier columns down, folds the factor into W",
                  err(fake_int8_per_tensor(x / s),  # (X/s)(W*s)^T is X W^T exactly
                      to_numpy(absmax_per_tensor(w * s, 8).dequantize())),
                  f"max factor {s.max():.1f}"),
        Technique("INT4 group-128 (W4A16)", "small scale territories; activations float",
                  err(x, to_numpy(absmax_per_group(w, 4, 128).dequantize()))),
        Technique("NF4 block-64 (W4A16)", "levels where the weights are; activations float",
                  err(x, to_numpy(nf4(w, 64).dequantize()))),
        Technique("GPTQ / AWQ", "rounding that compensates error / scales by activations",
                  None, "not implemented here"),
    ]
