"""Attention on the threads: a pass's attention cut into parts, across its sequences or its kv
heads, each part on a thread of the pool (threads.py), BLAS at one thread.

A learner may skip this module: `on_threads(attend)` attends as `attend` does, bit for bit
(model.plain_attention, tiled.two_pass_attention, tiled.tiled_attention). It exists because
attention's products (q @ k^T and weights @ v) and its softmax are a step's work too: left on
BLAS's own threads they fight the pool for the cores (a 64-token prefill measured 6x slower at 2
threads than at 1 on a loaded 2-core machine), and on one thread they leave the other cores idle.

Why a part gives the same bits: attention is one small problem per (sequence, kv head). NumPy's
matmul over (B, Hkv, rows, d) stacks makes one BLAS call per (b, kv head) pair, with its own
shapes; the scale, the mask and the softmax work per query row, each row summed alone. So the
parts, rows r0:r1 of the batch or kv heads h0:h1 (with the G query heads each one serves), make
the very calls the whole makes on those pairs, in their order: no sum is cut, nothing is added
in another order. Each part's (B', T, H'*d) lands in its place of the (B, T, H*d) output.

Which cut: as many parts as threads, at most one per sequence or kv head: the sequences where
the batch has one for each part (a decode step of many streams: parts of equal work), else the
kv heads (a prefill, a single stream; SmolLM2's 3 kv heads on 2 threads are parts of 2 and 1).
Whether to cut at all is measured, not assumed (threads.whole_or_parts): the first passes of
each kind of call (the way, B, T, the heads, and S to within a power of two) alternate whole
and in parts, timed as they run (the bits are the same, so the choice moves only the time), and
the parts are kept only where they were threads.SPLIT_GAIN of the whole's time or less: a tiny
model's attention, where waking a thread costs more than the part, stays whole (kept for the
process, not in the tuning file: a kind is decided within its first forward pass). MT_SPLIT
(blas.py) fixes the choice, as it fixes the products'. On CuPy the attention is one call per
product on the device, never cut.
"""
from functools import wraps

from minitransformer.backend import BACKEND, xp
from minitransformer.kernels import blas, threads


def on_threads(attend):
    """attend(q, k, v, visible), run whole or in parts across the pool's threads (see the
    docstring), BLAS at one thread either way: the same arguments, the same bits.

    >>> from minitransformer.model import plain_attention
    >>> import numpy as np
    >>> g = np.random.default_rng(0)
    >>> q, k, v = (xp.asarray(g.standard_normal(s, dtype=np.float32))
    ...            for s in ((2, 1, 4, 8), (2, 2, 5, 8), (2, 2, 5, 8)))
    >>> from minitransformer.backend import to_numpy
    >>> bool((to_numpy(in_parts(plain_attention, q, k, v, None, 2))
    ...       == to_numpy(plain_attention(q, k, v))).all())
    True
    """
    if BACKEND == "cupy":
        return attend

    @wraps(attend)
    def attend_on_threads(q, k, v, visible=None):
        count = parts_for(q, k)
        if count == 1:
            with threads.one_blas_thread():
                return attend(q, k, v, visible)
        if blas.FIXED_SPLIT == "parts":
            return in_parts(attend, q, k, v, visible, count)
        kind = (attend.__qualname__, *q.shape[:3], k.shape[1], q.shape[3],
                k.shape[2].bit_length(), count)                  # S to within a power of two
        return threads.whole_or_parts(kind, lambda n: in_parts(attend, q, k, v, visible, n),
                                      count)
    return attend_on_threads


def parts_for(q, k) -> int:
    """Into how many parts a pass may be cut: the threads (threads.count()), at most one per
    sequence or kv head, whichever it has more of; 1 under MT_SPLIT=whole."""
    if threads.count() == 1 or blas.FIXED_SPLIT == "whole":
        return 1
    return min(threads.count(), max(q.shape[0], k.shape[1]))


def axis(B: int, count: int) -> str:
    """What a pass of B sequences is cut along into count parts: the sequences where it has a
    sequence a part, else the kv heads."""
    return "sequences" if B >= count else "kv heads"


def in_parts(attend, q, k, v, visible, count: int):
    """attend(q, k, v, visible) as `count` parts along `axis`, each on a thread of the pool (BLAS
    at one thread), written into one output (B, T, H*d); count 1: whole, on this thread."""
    if count == 1:
        with threads.one_blas_thread():
            return attend(q, k, v, visible)
    B, T, H, d = q.shape
    Hkv = k.shape[1]
    G = H // Hkv
    out = xp.empty((B, T, H * d), dtype=q.dtype)

    def sequences(r0, r1):          # rows r0:r1: their queries, keys, values and mask
        seen = None if visible is None else visible[r0:r1]
        out[r0:r1] = attend(q[r0:r1], k[r0:r1, :], v[r0:r1, :], seen)

    def heads(h0, h1):              # kv heads h0:h1 and the G query heads each one serves
        part = attend(q[:, :, h0 * G:h1 * G], k[:, h0:h1], v[:, h0:h1], visible)
        out[:, :, h0 * G * d:h1 * G * d] = part
    cut, n = (sequences, B) if axis(B, count) == "sequences" else (heads, Hkv)
    threads.run([lambda a=a, b=b: cut(a, b) for a, b in blas.part_bounds(n, count, 1)])
    return out
