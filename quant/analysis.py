"""What quantization does to the weights: the error table and one matrix's outliers.

Serves experiments 16 and 17. `error_table` quantizes every projection matrix with every
scheme and keeps the relative error ||W - W_hat|| / ||W|| of each (the mean over matrices and
the worst one are the chapter's two columns). `outlier_stats` says why the errors are what
they are: a few weights many standard deviations out set the absmax scale for everyone.
Leaves out: error measured on the layer outputs (that is experiment 21's job, end to end).
"""
from dataclasses import dataclass, field

import numpy as np

from minitransformer.backend import to_numpy
from quant.qmodel import projection_names
from quant.scales import check_weight
from quant.schemes import SCHEMES, check_scheme


@dataclass(frozen=True)
class SchemeError:
    scheme: str                 # CLI name, e.g. "int4-g128"
    label: str                  # the chapter's row label
    bits_per_weight: float      # codes + scales over all matrices, measured in bytes
    errors: dict = field(repr=False)  # matrix name -> relative error

    @property
    def mean(self) -> float:
        return float(np.mean(list(self.errors.values())))

    @property
    def worst(self) -> tuple[str, float]:
        name = max(self.errors, key=self.errors.__getitem__)
        return name, self.errors[name]


def error_table(weights: dict, schemes=tuple(SCHEMES), progress=None) -> list[SchemeError]:
    """Quantize each projection matrix with each scheme; one SchemeError per scheme.

    Goes matrix by matrix (all schemes on one matrix, then the next) so that only one float
    matrix and one quantized copy are alive at a time. progress(i, n, name) before each matrix.
    """
    names = projection_names(weights)
    if not names:
        raise ValueError("no projection matrices (names like layers.N.mlp.down_proj.weight)")
    errors: dict[str, dict] = {check_scheme(s).name: {} for s in schemes}
    stored = dict.fromkeys(schemes, 0)  # bytes of codes + scales
    count = 0                           # weights
    for i, name in enumerate(names):
        if progress is not None:
            progress(i, len(names), name)
        w = to_numpy(weights[name])
        count += w.size
        for s in schemes:
            q = SCHEMES[s].quantize(w)
            errors[s][name] = q.error
            stored[s] += q.nbytes
    return [SchemeError(s, SCHEMES[s].label, 8 * stored[s] / count, errors[s]) for s in schemes]


@dataclass(frozen=True)
class OutlierStats:
    name: str
    shape: tuple
    mean_abs: float
    std: float
    max_abs: float
    beyond: int        # weights more than `sigmas` standard deviations from the mean
    sigmas: float

    @property
    def max_over_std(self) -> float:
        return self.max_abs / self.std if self.std > 0 else float("inf")

    @property
    def size(self) -> int:
        return self.shape[0] * self.shape[1]


def outlier_stats(name: str, w, sigmas: float = 6.0) -> OutlierStats:
    """Magnitude statistics of one matrix; `beyond` counts |w - mean| > sigmas * std."""
    w = check_weight(w).astype(np.float64)  # statistics of millions of values: sum in float64
    mean, std = w.mean(), w.std()
    return OutlierStats(name=name, shape=w.shape, mean_abs=float(np.abs(w).mean()),
                        std=float(std), max_abs=float(np.abs(w).max()),
                        beyond=int((np.abs(w - mean) > sigmas * std).sum()), sigmas=sigmas)


def default_outlier_matrix(weights: dict, table: list[SchemeError] | None = None) -> str:
    """The chapter's matrix, layers.12.mlp.down_proj, when the model has it; else the worst.

    "Worst" is the matrix with the largest INT4 per-tensor error (the scheme that collapses),
    taken from `table` when given, else measured here.
    """
    names = projection_names(weights)
    chapter = [n for n in names if n.endswith("layers.12.mlp.down_proj.weight")]
    if chapter:
        return chapter[0]
    for row in table or []:
        if row.scheme == "int4-tensor":
            return row.worst[0]
    return max(names, key=lambda n: SCHEMES["int4-tensor"].quantize(weights[n]).error)
