"""Tiled attention: softmax(Q K^T / sqrt(d)) V one block of keys at a time, the score matrix
never written (the idea of FlashAttention, Dao et al., arXiv:2205.14135, in plain NumPy).

``model.plain_attention`` is the one to read first; this is the same function computed another way.
It takes the same arguments and returns the same numbers within float32 rounding. ``TILED`` is
it with its mask, as a way to attend (model.Attention); ``ATTENTIONS`` names the two ways, as
a cache is allocated with one (``KVCache.allocate(..., attention="tiled")``) and generate takes
one, for prefill and decode alike.

``two_pass_attention`` is the plain attention for a few queries a row (a decode step): its
keys and values read a tile at a time too, but its scores, tiny at one query a row, written
whole and softmaxed once over the row as plain does: no running maximum, a few calls a tile.
``TWO_PASS`` is it with plain's mask: how a paged pool's decodes read their blocks where they
lie (serve/paged.py).
"""
from itertools import pairwise

from minitransformer.backend import to_numpy, xp
from minitransformer.kernels.attention import on_threads
from minitransformer.kvquant import dequantize, on_floats
from minitransformer.model import Attention, causal_mask, plain_attention, softmax

BLOCK = 64  # queries and keys per tile: a tile of scores is 64 x 64 floats (16 KB) per head
# slots of keys (and values) two_pass_attention reads at a time: a row of 1,024 (or 1,025)
# in 4 tiles.
# 256 trades calls for copies: a smaller tile makes more calls a layer, a larger one copies
# more a tile (on SmolLM2's 8-row decode step at 1,024 tokens, where it was chosen, 128 and
# 512 were both the slower: time that step again before moving it).
DECODE_TILE = 256


class CausalTiles:
    """model.causal_mask(positions, S) without its (B, T, S) array: a tile of it on demand.

    >>> from minitransformer.backend import to_numpy
    >>> tiles = CausalTiles(xp.asarray([[1, 2]]), 3)    # the doctest of model.causal_mask
    >>> to_numpy(tiles[:, 0:2, 1:3]).astype(int).tolist()
    [[[1, 0], [1, 1]]]
    >>> to_numpy(tiles[0:1][:, 1:2, 0:3]).astype(int).tolist()       # row 0's, a tile of it
    [[[1, 1, 1]]]
    """
    def __init__(self, positions, S: int):
        self.positions, self.S = positions, S                      # (B, T) on the device
        self.latest = to_numpy(positions).max(axis=0)              # (T,) on the host, once

    def hidden(self, queries: slice, keys: slice) -> bool:
        """Is the whole tile in every row's future? Decided on the host, no transfer."""
        return keys.start > self.latest[queries].max()

    def __getitem__(self, index):
        if isinstance(index, slice):                    # [r0:r1]: those rows' mask, as tiles
            return CausalTiles(self.positions[index], self.S)
        rows, queries, keys = index                                 # [:, i:i+t, j:j+b]
        slots = xp.arange(keys.start, min(keys.stop, self.S))       # (b,)
        return slots[None, None, :] <= self.positions[rows, queries][:, :, None]  # (B, t, b)


def tiled_attention(q, k, v, visible=None, block: int = BLOCK):
    """Grouped-query attention tile by tile; arguments and result as model.plain_attention's.

    q (B, T, H, d); k, v (B, Hkv, S, d), float32 or a quantized cache's QuantizedArray;
    visible (B, T, S), or CausalTiles (the same mask, made a tile at a time: what forward
    passes), or None -> (B, T, H*d).

    It replaces three lines of ``model.plain_attention``: the scores of all S keys at once
    (``scores = q @ k^T / sqrt(d)``), the masking of that (B, Hkv, G*T, S) array, and
    ``softmax(scores) @ v``. Queries are taken ``block`` positions at a time, and for each
    such tile the keys ``block`` slots at a time, so the largest array of scores is
    (B, Hkv, G*block, block): for one head 64 x 64 floats whatever S is. A quantized cache is
    dequantized here too, one block of keys and values at a time.

    Why the result is the same: softmax(s) @ v = sum_j exp(s_j - m) v_j / sum_j exp(s_j - m)
    for any constant m; the plain one takes m = the row's maximum over all keys. Here each
    query row keeps a running maximum m, a running sum l = sum exp(s_j - m) and a running
    output acc = sum exp(s_j - m) v_j over the keys seen so far. When a block raises the
    maximum to m', both sums are multiplied by exp(m - m') (online-softmax rescaling), which
    turns every term already in them into exp(s_j - m'): after the last block acc / l is
    exactly the plain formula with m = the overall maximum. Only the rounding differs (exp of
    other differences, sums in another order): within float32 tolerance, not bit for bit.
    A tile whose keys are all hidden from all its queries (the future, in a causal prefill)
    is skipped: it would add exp(-inf) = 0.
    """
    if not (isinstance(block, int) and block >= 1):
        raise ValueError(f"block={block!r}: expected an integer >= 1")
    B, T, H, d = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    G = H // Hkv
    scale = 1.0 / d ** 0.5
    q = q.reshape(B, T, Hkv, G, d).transpose(0, 2, 3, 1, 4)         # (B, Hkv, G, T, d)
    out = xp.empty((B, Hkv, G, T, d), dtype=xp.float32)
    for i in range(0, T, block):                                     # a tile of queries
        t = min(block, T - i)
        qi = q[:, :, :, i:i + t].reshape(B, Hkv, G * t, d)           # (B, Hkv, G*t, d)
        m = xp.full((B, Hkv, G * t, 1), -xp.inf, dtype=xp.float32)  # running maximum
        l = xp.zeros((B, Hkv, G * t, 1), dtype=xp.float32)          # running sum of exp
        acc = xp.zeros((B, Hkv, G * t, d), dtype=xp.float32)        # running sum of exp * v
        for j in range(0, S, block):                                 # a block of keys
            if visible is not None and hidden(visible, slice(i, i + t), slice(j, j + block)):
                continue                                             # all hidden: adds 0
            seen = None if visible is None else visible[:, i:i + t, j:j + block]  # (B, t, b)
            kj = dequantize(k[:, :, j:j + block])                    # (B, Hkv, b, d)
            vj = dequantize(v[:, :, j:j + block])
            s = (qi @ kj.transpose(0, 1, 3, 2)) * scale              # (B, Hkv, G*t, b)
            if seen is not None:
                b = s.shape[-1]
                s = xp.where(seen[:, None, None], s.reshape(B, Hkv, G, t, b), -xp.inf)
                s = s.reshape(B, Hkv, G * t, b)
            m_new = xp.maximum(m, s.max(axis=-1, keepdims=True))
            # a row that has seen no visible key yet keeps m = -inf: shift by 0, not -inf - -inf
            shift = xp.where(m_new == -xp.inf, 0, m_new)
            rescale = xp.exp(m - shift)                              # (B, Hkv, G*t, 1)
            p = xp.exp(s - shift)                                    # (B, Hkv, G*t, b)
            l = l * rescale + p.sum(axis=-1, keepdims=True)
            acc = acc * rescale + p @ vj                             # (B, Hkv, G*t, d)
            m = m_new
        out[:, :, :, i:i + t] = (acc / l).reshape(B, Hkv, G, t, d)
    return out.transpose(0, 3, 1, 2, 4).reshape(B, T, H * d)


def two_pass_attention(q, k, v, visible=None, tile: int = DECODE_TILE):
    """model.plain_attention for a few queries a row, keys and values read ``tile`` slots at
    a time; arguments and result as plain_attention's.

    q (B, T, H, d); k, v (B, Hkv, S, d): arrays, a quantized cache's QuantizedArrays, or
    anything sliced ``[:, :, j:j + n]`` (paged.InPlace: a pool's blocks where they lie, a
    tile's blocks copied at a time); visible (B, T, S) from causal_mask, or None
    -> (B, T, H*d).

    Pass one writes the scores q k^T of every key into one (B, Hkv, G*T, S) array, a tile of
    keys at a time; at T = 1 that is S floats a query head (8 rows of 1,024 slots, 9 heads:
    295 KB, against 6 MB of keys and as much of values). Then plain's own lines: the scale,
    the mask and the softmax over whole rows. Pass two sums weights @ v a tile at a time.
    Unlike tiled_attention, no running maximum and no rescaling: a handful of calls a tile.

    The tiles start every ``tile`` slots; a last one shorter than half a tile joins the one
    before (so a row of 257 slots is one tile, not a second of one slot). Bits: rows under 1.5
    tiles are one tile, plain_attention's very calls on the same shapes: its bits. Longer rows
    sum weights @ v over slots a tile at a time (and the scores come from products over fewer
    keys a call): within float32 rounding.

    >>> import numpy as np
    >>> from minitransformer.backend import to_device, to_numpy
    >>> g = np.random.default_rng(0)
    >>> q, k, v = (to_device(g.standard_normal(s, dtype=np.float32))
    ...            for s in ((2, 1, 4, 8), (2, 2, 40, 8), (2, 2, 40, 8)))
    >>> whole = to_numpy(plain_attention(q, k, v))
    >>> bool((to_numpy(two_pass_attention(q, k, v, tile=64)) == whole).all())   # one tile
    True
    >>> float(abs(to_numpy(two_pass_attention(q, k, v, tile=16)) - whole).max()) < 1e-6
    True
    """
    B, T, H, d = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    G = H // Hkv
    q = q.reshape(B, T, Hkv, G, d).transpose(0, 2, 3, 1, 4).reshape(B, Hkv, G * T, d)
    edges = [*range(0, max(S - tile // 2, 1), tile), S]  # a tail under half a tile joins the
    spans = list(pairwise(edges))                                   # tile before it: [a, b) each
    scores = xp.concatenate([q @ dequantize(k[:, :, a:b]).transpose(0, 1, 3, 2)
                             for a, b in spans], axis=-1)    # pass one: (B, Hkv, G*T, S)
    scores *= 1.0 / d ** 0.5
    if visible is not None:                                          # hide the future
        scores = xp.where(visible[:, None, None], scores.reshape(B, Hkv, G, T, S), -xp.inf)
    weights = softmax(scores).reshape(B, Hkv, G * T, S)
    (a, b), *rest = spans
    out = weights[..., a:b] @ dequantize(v[:, :, a:b])               # pass two: (B, Hkv, G*T, d)
    for a, b in rest:
        out += weights[..., a:b] @ dequantize(v[:, :, a:b])
    return out.reshape(B, Hkv, G, T, d).transpose(0, 3, 1, 2, 4).reshape(B, T, H * d)


def hidden(visible, queries: slice, keys: slice) -> bool:
    """Does the mask hide this tile's keys from all its queries?"""
    if isinstance(visible, CausalTiles):
        return visible.hidden(queries, keys)
    return not bool(to_numpy(visible[:, queries, keys].any()))  # an explicit transfer


def largest_score_block(T: int, S: int, heads: int = 1, block: int = BLOCK) -> int:
    """Bytes of the largest array of scores tiled_attention holds for T queries over S keys
    (float32, `heads` query heads; the plain attention holds heads x T x S x 4).

    >>> largest_score_block(4096, 4096), largest_score_block(1, 4096)
    (16384, 256)
    """
    return heads * min(block, T) * min(block, S) * 4


# each way on the threads (kernels/attention.py: whole, or in parts across sequences or kv
# heads, the same bits)
TILED = Attention(on_threads(tiled_attention), CausalTiles)  # dequantizes a block at a time
TWO_PASS = Attention(on_threads(two_pass_attention), causal_mask)  # plain's mask; a tile at a time
# the ways to attend, by name: the plain one reads floats (a quantized cache's blocks all
# dequantized at once, kvquant.on_floats), the tiled one reads what the cache holds
ATTENTIONS = {"plain": Attention(on_threads(on_floats(plain_attention)), causal_mask),
              "tiled": TILED}


def attention_named(name) -> Attention:
    """The way to attend called name (ATTENTIONS), or a clear error."""
    if name not in ATTENTIONS:
        raise ValueError(f"attention={name!r}: use one of {', '.join(ATTENTIONS)}")
    return ATTENTIONS[name]
