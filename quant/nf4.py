"""NF4: 4-bit NormalFloat, the data type of QLoRA (Dettmers et al. 2023, arXiv:2305.14314).

Serves experiments 15, 16 and 21. Absmax spaces its 16 levels evenly; but the weights of a
block are roughly normal, most of them near zero, so NF4 puts the levels at quantiles of a
standard normal: dense near zero, sparse in the tails. Each block of 64 consecutive weights
of a row is scaled by its absmax into [-1, 1] and every weight takes the nearest level.
With a float16 scale per block that is 4 + 16/64 = 4.25 bits per weight.

The levels, from the paper's definition (and bitsandbytes' `create_normal_map`): an exact
zero is wanted, which 16 symmetric quantiles cannot give, so the two halves are built
separately. 8 positive levels are the normal quantiles at 9 evenly spaced probabilities from
`offset` down to 0.5 (the last, 0.5, is the zero, dropped here); 7 negative ones likewise from
8 probabilities; then zero; then all are divided by the largest so they span [-1, 1].
offset = (1 - 1/(2*15) + 1 - 1/(2*16)) / 2 = 0.9677083 (the quantile at 1 would be infinite).
The published table came out of float32 arithmetic (torch.linspace, torch.Tensor) with the
offset written as 0.9677083; the same steps here reproduce it bit for bit (the tests check).
Blocks here run along rows (like the group of absmax.py); bitsandbytes blocks the flattened
tensor, which is the same thing whenever rows are a multiple of 64 (Qwen2.5's 896 and 4864).
Leaves out: double quantization of the block scales (QLoRA's 4.127 bits per weight).
"""
from statistics import NormalDist

import numpy as np

from quant.qweight import QWeight
from quant.scales import build, check_weight, expand, float16_scales, group_absmax

OFFSET = 0.9677083  # (1 - 1/30 + 1 - 1/32) / 2, to the digits bitsandbytes writes


def linspace_float32(start: float, stop: float, n: int) -> list[float]:
    """n evenly spaced float32 numbers, each half stepped from its nearer end (torch's way)."""
    start, stop = np.float32(start), np.float32(stop)
    step = (stop - start) / np.float32(n - 1)
    head = [start + np.float32(i) * step for i in range(n // 2)]
    tail = [stop - np.float32(n - 1 - i) * step for i in range(n // 2, n)]
    return [float(v) for v in head + tail]


def nf4_levels() -> np.ndarray:
    """The 16 NF4 levels, ascending, float32 in [-1, 1] with an exact 0 at index 7."""
    ppf = NormalDist().inv_cdf
    positive = [ppf(p) for p in linspace_float32(OFFSET, 0.5, 9)[:-1]]   # 8 levels > 0
    negative = [-ppf(p) for p in linspace_float32(OFFSET, 0.5, 8)[:-1]]  # 7 levels < 0
    levels = np.sort(np.array(positive + [0.0] + negative, dtype=np.float32))
    return levels / levels.max()  # normalised in float32, as bitsandbytes does


NF4_LEVELS = nf4_levels()


def nf4(w, block: int = 64) -> QWeight:
    """NF4 with one float16 absmax scale per `block` consecutive weights of a row."""
    w = check_weight(w)
    scales = float16_scales(group_absmax(w, block), 1.0)     # (out, G): block absmax -> level 1
    scale = expand(scales, block, w.shape[1])               # (out, in)
    x = w / np.where(scale == 0, 1, scale)                  # (out, in) in [-1, 1]
    # Nearest level: count the midpoints between neighbouring levels that lie below x.
    midpoints = (NF4_LEVELS[1:] + NF4_LEVELS[:-1]) / 2      # (15,)
    codes = np.searchsorted(midpoints, x).astype(np.uint8)  # (out, in) in 0..15
    return build(f"NF4 block-{block}", w, codes, scales, block, 4, NF4_LEVELS)
