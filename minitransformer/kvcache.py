"""The KV cache: keys and values of every token seen so far, kept so they are never recomputed.

Causality makes this exact: the key and value at position 7 depend only on positions 0..7, so
when position 8 arrives they are the same numbers as before. The cache is explicit state: it is
allocated once, up front, for the longest sequence it will hold (growing it by concatenation
would copy O(T^2) bytes over a generation), passed into ``model.forward`` and filled there.

Per layer it holds one key and one value array of shape (B, Hkv, S_max, d): only the Hkv
key/value heads, never the H query heads they serve. So its size is the chapter's formula by
construction:  bytes per token = 2 (k and v) x L x Hkv x d x bytes per element.
The arrays are float32 by default; ``kv_dtype`` picks float16 or llama.cpp's q8_0 / q4_0
blocks (kvquant.py: integer codes plus a float16 scale per 32 numbers of a head's vector),
which the cache holds, writes and slices the same way.

Each row b of the batch has its own length: row b's next token goes to slot ``lengths[b]``, which
is also its position. Rows may differ (batched decode of sequences of different lengths); the
attention mask hides every slot at or beyond a row's length. ``trim`` rolls back tokens
(rejected speculative drafts): the slots are simply reused.

What model.forward asks of a cache (this one, serve/'s paged view, any other):

    positions(T)          host positions (B, T) of the T new tokens of every row
    slots(positions)      where they go, worked out once per forward pass
    mask(positions)       what attend reads as the mask for those queries (None: all seen)
    update(i, k, v, s)    layer i's new keys/values written; -> everything held, as held
    attend(q, k, v, m)    attention over what update handed back -> (B, T, H*d)
    advance(T)            every layer has stored its T tokens

and a caller wanting each row's bits as alone (batch-invariant) asks for ``row(b)``, a batch of
one sharing the arrays, and makes the very call a batch of one makes (generate.last_logits_alone).

A sliding-window layer (Mistral; some Qwen2 layers) never looks further back than its window
W, so such a layer keeps a ring of W slots (plus ``spare`` for drafts that may be rolled back)
instead of one per position: position p goes to slot p mod (W + spare), overwriting the one
that slid out of every later query's window. Its bytes stop growing at W tokens, whatever the
length: the chapter's formula with W in place of the sequence. A pass attends over the ring as
it was, followed by its own new keys (a prompt longer than the ring still sees all it should),
then writes the new keys in. The ring's slots are not in position order, so attention sums in
another order than over a full cache: the same tokens but for near ties (docs/kv-cache.md).

So the model never learns how a cache lays out its tokens, what format it holds or how that is
read: the cache is allocated with a way to attend (tiled.ATTENTIONS: ``attention="plain"``
reads floats, a quantized cache's blocks dequantized at once; ``"tiled"`` reads a block of keys
at a time) and hands it what it holds. A view of several sequences flattened into one row
gives its own positions and mask, and model.py does not change.
"""
from dataclasses import dataclass

import numpy as np

from minitransformer.backend import to_device, xp
from minitransformer.checks import is_integer
from minitransformer.kvquant import kv_dtype_of, zeros
from minitransformer.tiled import attention_named


@dataclass
class KVCache:
    k: list                # L arrays (B, Hkv, S_max, d) (or QuantizedArrays of that shape);
                           # a ring layer's (B, Hkv, W + spare, d)
    v: list                # L arrays, as k
    lengths: np.ndarray    # (B,) tokens held by each row, on the host
    attention: str = "plain"  # how it is attended over (tiled.ATTENTIONS)
    rings: tuple = ()      # per layer: its window W where it keeps a ring, else None
    longest: int = 0       # S_max, the positions it holds (0: the first layer's slots)

    @classmethod
    def allocate(cls, config, batch: int, max_len: int, kv_dtype: str = "f32",
                 attention: str = "plain", spare: int = 0) -> "KVCache":
        """kv_dtype: f32, f16, q8_0 or q4_0 (kvquant.KV_DTYPES); attention: plain or tiled;
        spare: slots a sliding-window layer keeps beyond its window, for as many tokens
        rolled back (speculative drafts)."""
        for name, n, low in (("batch", batch, 1), ("max_len", max_len, 1), ("spare", spare, 0)):
            if not is_integer(n) or n < low:
                raise ValueError(f"a cache needs an integer {name} >= {low}, got {n!r}")
        attention_named(attention)
        windows = getattr(config, "layer_windows", ()) or (None,) * config.num_hidden_layers
        rings = tuple(w if w is not None and w + spare < max_len else None for w in windows)
        if any(rings) and (attention != "plain" or kv_dtype not in ("f32", "f16")):
            raise ValueError(f"a sliding-window layer's ring holds f32 or f16 keys read by the "
                             f"plain attention; got kv_dtype={kv_dtype!r}, "
                             f"attention={attention!r}")
        H, d = config.num_key_value_heads, config.head_dim
        slots = [max_len if w is None else w + spare for w in rings]
        return cls(k=[zeros((batch, H, n, d), kv_dtype) for n in slots],
                   v=[zeros((batch, H, n, d), kv_dtype) for n in slots],
                   lengths=np.zeros(batch, dtype=np.int64), attention=attention,
                   rings=rings if any(rings) else (), longest=max_len)

    def row(self, b: int) -> "KVCache":
        """Row b alone, a batch of one: the same arrays (what it writes lands here)."""
        return KVCache([a[b:b + 1] for a in self.k], [a[b:b + 1] for a in self.v],
                       self.lengths[b:b + 1], self.attention, self.rings, self.longest)

    @property
    def max_len(self) -> int:
        return self.longest or self.k[0].shape[2]

    def ring(self, layer: int) -> int | None:
        """Layer's window W if it keeps a ring of slots, else None (one slot per position)."""
        return self.rings[layer] if self.rings else None

    @property
    def kv_dtype(self) -> str:
        return kv_dtype_of(self.k[0])

    @property
    def nbytes(self) -> int:
        """Bytes of the arrays actually held (all slots, filled or not; codes and scales)."""
        return sum(int(a.nbytes) for a in self.k + self.v)

    def positions(self, T: int) -> np.ndarray:
        """Positions (B, T) of T new tokens per row; they are also the slots they go to."""
        positions = self.lengths[:, None] + np.arange(T)
        if positions.max() >= self.max_len:
            raise ValueError(f"the cache holds {self.max_len} positions; appending {T} token(s) "
                             f"to a row of {int(self.lengths.max())} would overflow it")
        return positions

    def slots(self, positions: np.ndarray):
        """Where positions (B, T) go, as device indices: worked out once per forward pass.

        Row b's token t goes to slot positions[b, t]; -> (rows (B, 1), positions (B, T), S),
        S = the longest row after the append.
        """
        B = positions.shape[0]
        return xp.arange(B)[:, None], to_device(positions), int(positions.max()) + 1

    def mask(self, positions: np.ndarray, window: int | None = None):
        """The mask this cache's attention reads for queries at positions (B, T); with a
        window, the mask of the sliding-window layers, over what update hands them: their
        ring followed by the new keys where they keep one, else every slot."""
        if window is None:
            return causal(positions, self.attention)
        if not self.rings:                    # slot j holds position j
            S = int(positions.max()) + 1
            return sliding(positions, xp.arange(S)[None], window)
        ring = self.k[self.rings.index(window)].shape[2]
        held = ring_positions(positions[:, 0], ring)                  # (B, ring) before
        return sliding(positions, xp.concatenate([held, to_device(positions)], axis=1), window)

    def attend(self, q, k, v, visible):
        """q (B, T, H, d) over k, v (B, Hkv, S, d) as update returned them -> (B, T, H*d)."""
        return attention_named(self.attention).attend(q, k, v, visible)

    def update(self, layer: int, k, v, slots=None):
        """Write the new keys/values of one layer; return everything held for attention.

        k, v (B, T, Hkv, d) -> k, v (B, Hkv, S, d) views. The write uses advanced indices on
        axes 0 and 2: cache[b, :, positions[b, t]] = k[b, t], no transpose needed, because
        numpy puts the indexed axes first, (B, T), and the sliced one after, (Hkv, d):
        >>> from types import SimpleNamespace
        >>> from minitransformer.backend import to_numpy
        >>> shape = SimpleNamespace(num_hidden_layers=1, num_key_value_heads=1, head_dim=3)
        >>> cache = KVCache.allocate(shape, batch=2, max_len=4)
        >>> k = xp.ones((2, 1, 1, 3), dtype=xp.float32)             # (B, T, Hkv, d)
        >>> rows, positions, S = cache.slots(np.array([[2], [0]]))  # row 0 at slot 2, row 1 at 0
        >>> cache.k[0][rows, :, positions].shape                      # (B, T, Hkv, d)
        (2, 1, 1, 3)
        >>> k_held, v_held = cache.update(0, k, k, (rows, positions, S))
        >>> to_numpy(k_held[:, 0, :, 0]).tolist()                     # (B, S): slot filled or not
        [[0.0, 0.0, 1.0], [1.0, 0.0, 0.0]]
        """
        rows, positions, S = self.slots(self.positions(k.shape[1])) if slots is None else slots
        if self.ring(layer):
            return self.rotate(layer, k, v, rows, positions)
        self.k[layer][rows, :, positions] = k
        self.v[layer][rows, :, positions] = v
        return self.k[layer][:, :, :S], self.v[layer][:, :, :S]

    def rotate(self, layer: int, k, v, rows, positions):
        """A ring layer's update: -> the ring as it was followed by the new keys/values
        (B, Hkv, ring + T, d), what this pass attends over; then the newest of them written
        into the ring, position p at slot p mod ring (at most a ring's worth: a longer prompt's
        first keys would be overwritten in this very write)."""
        ring = self.k[layer].shape[2]
        held_k = xp.concatenate([self.k[layer], k.transpose(0, 2, 1, 3)], axis=2)
        held_v = xp.concatenate([self.v[layer], v.transpose(0, 2, 1, 3)], axis=2)
        last = slice(-min(k.shape[1], ring), None)                     # the newest <= ring
        self.k[layer][rows, :, positions[:, last] % ring] = k[:, last]
        self.v[layer][rows, :, positions[:, last] % ring] = v[:, last]
        return held_k, held_v

    def advance(self, T: int) -> None:
        """Called by forward after every layer has stored its T new tokens."""
        self.lengths += T

    def trim(self, n) -> None:
        """Forget the last n tokens of every row (or n[b] of row b)."""
        n = np.broadcast_to(np.asarray(n, dtype=np.int64), self.lengths.shape)
        if (n < 0).any() or (n > self.lengths).any():
            raise ValueError(f"cannot trim {n.tolist()} tokens from rows of "
                             f"{self.lengths.tolist()}")
        spare = min((self.k[i].shape[2] - w for i, w in enumerate(self.rings) if w),
                    default=None)
        if spare is not None and (n > spare).any():   # their ring slots were written over
            raise ValueError(f"cannot trim {n.tolist()} tokens from a sliding-window cache "
                             f"allocated with spare={spare} slots")
        self.lengths -= n


def ring_positions(lengths, ring: int):
    """Lengths (B,) of rows before a pass -> (B, ring) on the device: the position slot j
    holds, the latest p < length with p mod ring == j; negative (hidden by every mask) where
    none was written yet.
    >>> from minitransformer.backend import to_numpy
    >>> to_numpy(ring_positions(np.array([6, 2]), 4)).tolist()   # 0..5 into 4 slots; 0, 1
    [[4, 5, 2, 3], [0, 1, -2, -1]]
    """
    j = np.arange(ring)[None]                                          # (1, ring)
    last = lengths[:, None] - 1                                        # (B, 1)
    return to_device(j + ring * ((last - j) // ring))


def sliding(positions: np.ndarray, held, window: int):
    """The mask of a sliding-window layer: a query at p sees a key at position q when
    p - window < q <= p. positions (B, T) of the queries, held (B or 1, S) the positions of
    the keys it is handed (negative: an empty slot) -> visible (B, T, S).
    >>> from minitransformer.backend import to_numpy
    >>> to_numpy(sliding(np.array([[3]]), xp.arange(5)[None], 2)).astype(int).tolist()
    [[[0, 0, 1, 1, 0]]]
    """
    p = to_device(positions)[:, :, None]                              # (B, T, 1)
    q = held[:, None, :]                                               # (B, 1, S)
    return (q >= 0) & (q <= p) & (q > p - window)


def causal(positions: np.ndarray, attention: str = "plain"):
    """The causal mask of queries at positions (B, T) over the slots 0..S-1 of rows that hold
    one token per slot, S the longest row: each query sees its own row's slots up to its
    position, so slots past a row's length (the other rows', rolled-back drafts) are hidden.
    None where every query sees every slot: one new token per row, all rows S long (every
    decode step of a single sequence).
    >>> causal(np.array([[4], [4]])) is None, causal(np.array([[4], [2]])).shape
    (True, (2, 1, 5))
    """
    lengths = positions[:, -1] + 1                                   # (B,) slots each row sees
    S = int(lengths.max())
    if positions.shape[1] == 1 and (lengths == S).all():
        return None
    return attention_named(attention).mask(to_device(positions), S)
