"""The paged KV cache: the device pool the block manager's books describe, and the forward
pass's view of it (experiment 14).

    pool    per layer, one array (N, Hkv, bs, d) of keys and one of values: a block is a
            small (Hkv, bs, d) cache, float or a QuantizedArray of codes and scales (kvquant)
    books   a blocks.BlockManager (``books``): free list, block tables, refcounts, prefix index
    view    ``view(seq_ids)`` is what ``model.forward`` talks to (kvcache.py's protocol):
            ``positions``, ``update`` (write the new keys/values into their slots, return all
            held), ``mask`` (causal; a sliding-window layer's, model.Batch.windowed),
            ``attend``, ``advance``

What ``update`` returns depends on how a pass reads the pool (``PagedCache.reads_in_place``):

    in place  the blocks where they lie (``InPlace``), read a tile of slots at a time, each
              tile gathering only the few blocks its slots lie in (PagedAttention's reading:
              never a row's whole context copied). The plain attention's decodes (at most
              FEW_QUERIES queries a row: a decode step, a verification, a ragged pass's decode
              groups), by tiled.two_pass_attention, 256 slots a tile (``PagedCache.way``); the
              tiled attention's every pass, 64 slots a tile, online softmax
    gathered  each row's blocks end to end (``gather``), a copy per layer: the plain
              attention's prompts, and every pass of a pool made ``in_place=False`` (the
              batch-invariant engine's; the "before" of ``bench_mixed_step.py --reads``)

Bits (docs/serving.md, "Exactness"): the tiled attention in place is its gathered copy's, bit
for bit (the same tiles, laid out alike). The plain attention in place is the gathered copy's
for rows under 384 slots (one tile: plain's very calls; a tail under half a tile joins the
tile before); past that, weights @ v is summed a tile at a time and the last bits move: the
default engine's near-tie rule covers it, and the batch-invariant engine, which gathers,
keeps generate's bits.

The books decide, the pool does: a copy on write or a swap the books queue (``moves``) is
carried out by ``do``, when the engine asks, before the pool is read or written, in the order
decided; reading ``k`` or ``v`` moves nothing. Shapes: N
blocks, bs slots per block, nb blocks in a table; B, T, S, Hkv, d as in model.py. Leaves out:
a kernel that multiplies each block where it lies (NumPy multiplies arrays, so a tile's blocks
are indexed: a copy of a tile's slots of every row, bounded whatever the context).

Example: blocks of 4 slots; "b" starts with a's first 4 tokens, so it holds a's first block
and its keys, and only its fifth token is computed:

>>> from minitransformer.config import ModelConfig
>>> from minitransformer.model import forward
>>> from minitransformer.checkpoints.synth import qwen2_config, random_model
>>> model = random_model(qwen2_config())
>>> cache = PagedCache.allocate(model.config, 8, block_size=4)
>>> a = [5, 6, 7, 8, 9, 10]
>>> books = cache.books
>>> books.add("a", a)                 # -> prompt tokens already held: none
0
>>> _ = forward(model, np.array([a]), cache.view(["a"]))
>>> books.seal("a", a)                # name a's full blocks: offered to later prompts
>>> books.add("b", [5, 6, 7, 8, 42]), books.seqs["b"].blocks     # block 0 is a's
(4, [0, 2])
>>> bool((to_numpy(cache.to_contiguous(["b"]).k[0][0, :, :4]) ==
...       to_numpy(cache.to_contiguous(["a"]).k[0][0, :, :4])).all())
True
"""
import numpy as np

from minitransformer.backend import memory_bytes, to_device, to_numpy, xp
from minitransformer.kvcache import KVCache, causal, sliding
from minitransformer.kvquant import (
    KVDims,
    QuantizedArray,
    cache_bytes_per_token,
    kv_dtype_of,
    zeros,
)
from minitransformer.serve.blocks import BlockManager, Copy, SwapIn, SwapOut, pool_blocks
from minitransformer.tiled import TWO_PASS, attention_named

FEW_QUERIES = 16    # queries a row up to which the plain attention reads the blocks in place


def pool_for(requests, slots: int, block_size: int) -> int:
    """Blocks for a pool in which every slot can hold the longest request: nobody waits for
    memory and nobody is preempted (what a contiguous cache would reserve, rounded to blocks).

    >>> from minitransformer.serve.records import Request
    >>> pool_for([Request((1, 2, 3), 5), Request((4,), 13)], slots=2, block_size=4)  # 2 x 14/4
    8
    """
    longest = max(len(r.prompt) + r.max_new_tokens for r in requests)
    return pool_blocks(slots, longest, block_size)


def check_fits(config, slots: int, num_blocks: int, block_size: int,
               kv_dtype: str = "f32") -> None:
    """A ValueError saying how many bytes the KV pool and the slot table would take, when that
    is more than the backend has: checked before anything is allocated.

    >>> from minitransformer.config import ModelConfig
    >>> from minitransformer.checkpoints.synth import qwen2_config
    >>> check_fits(ModelConfig.from_dict(qwen2_config()), 8, 10**10, 16)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: a KV pool of 10000000000 blocks x 16 tokens and 8 slots need 40,960,000,000,064...
    """
    per_token = cache_bytes_per_token(config, kv_dtype)   # K and V in the pool's format
    need = num_blocks * block_size * per_token + 8 * slots  # a slot a pointer
    have, where = memory_bytes()
    if need > have:
        raise ValueError(f"a KV pool of {num_blocks} blocks x {block_size} tokens and {slots} "
                         f"slots need {need:,} bytes ({need / 2**30:,.1f} GiB), more than the "
                         f"{have:,} bytes of {where}: ask for fewer blocks or slots")


class PagedCache:
    """The pool arrays, and the books (a BlockManager) that say whose tokens each block holds.
    The books decide, the pool does: a move happens when ``do`` is asked, never on a read."""

    def __init__(self, books: BlockManager, k: list, v: list, attention: str = "plain",
                 in_place: bool = True):
        attention_named(attention)              # checked: how its views attend (tiled.py)
        self.books, self.k, self.v = books, k, v    # L arrays (N, Hkv, bs, d) each
        self.attention, self.in_place = attention, in_place

    @classmethod
    def allocate(cls, config, num_blocks: int, block_size: int, kv_dtype: str = "f32",
                 attention: str = "plain", in_place: bool = True):
        """A pool of num_blocks blocks and its books. kv_dtype: f32, f16, q8_0 or q4_0
        (kvquant.KV_DTYPES); attention: plain or tiled; in_place: passes read the blocks
        where they lie (``reads_in_place``; False: every pass reads them gathered)."""
        books = BlockManager(num_blocks, block_size, config.cache_window)  # checks the sizes
        shape = (num_blocks, config.num_key_value_heads, block_size, config.head_dim)
        L = config.num_hidden_layers
        return cls(books, [zeros(shape, kv_dtype) for _ in range(L)],
                   [zeros(shape, kv_dtype) for _ in range(L)], attention, in_place)

    def reads_in_place(self, T: int) -> bool:
        """Does a pass of T queries a row read the blocks where they lie? The tiled
        attention's every pass; the plain one's decodes (at most FEW_QUERIES a row)."""
        return self.in_place and (self.attention == "tiled" or T <= FEW_QUERIES)

    def way(self, T: int):
        """How a pass of T queries a row attends (a model.Attention): the pool's, or for the plain
        one's passes in place, tiled.TWO_PASS (the same softmax, a tile of keys at a time)."""
        if self.attention == "plain" and self.reads_in_place(T):
            return TWO_PASS
        return attention_named(self.attention)

    @property
    def kv_dtype(self) -> str:
        return kv_dtype_of(self.k[0])

    @property
    def bytes_per_token(self) -> int:
        _, Hkv, _, d = self.k[0].shape
        return cache_bytes_per_token(KVDims(len(self.k), Hkv, d), self.kv_dtype)

    def stats(self):
        return self.books.stats(self.bytes_per_token)

    def do(self, moves) -> None:
        """Carry out the books' moves, in the order they were decided (a swap out reads its
        blocks before a later move or write reuses them)."""
        for move in moves:
            if isinstance(move, Copy):
                for k, v in zip(self.k, self.v, strict=True):
                    k[move.dst], v[move.dst] = k[move.src], v[move.src]
            elif isinstance(move, SwapOut):
                index = to_device(np.array(move.blocks, dtype=np.int64))
                move.into.k = [on_host(k[index]) for k in self.k]
                move.into.v = [on_host(v[index]) for v in self.v]
            elif isinstance(move, SwapIn):
                index = to_device(np.array(move.blocks, dtype=np.int64))  # host-made, in range
                assert move.source.k is not None and move.source.v is not None  # swapped out
                for layer in range(len(self.k)):
                    self.k[layer][index] = on_device(move.source.k[layer])
                    self.v[layer][index] = on_device(move.source.v[layer])

    def view(self, seq_ids, starts=None) -> "PagedView":
        """The sequences seq_ids as one batch for model.forward (row b = seq_ids[b]). starts:
        where each row's new tokens go when a plan has counted them in the books already
        (``append``); by default each row's length, and ``advance`` counts them."""
        seqs = [self.books.seqs[s] for s in seq_ids]
        counted = starts is not None
        if not counted:
            starts = [s.length for s in seqs]
        return PagedView(self, list(seq_ids), seqs, np.array(starts, dtype=np.int64), counted)

    def to_contiguous(self, seq_ids, max_len: int | None = None) -> KVCache:
        """The sequences' keys and values copied into a contiguous KVCache of max_len
        positions (default: the longest row's length), row b = seq_ids[b]: the same bits in
        the other layout, e.g. to time the two layouts' decodes side by side."""
        books = self.books
        lengths = np.array([books.seqs[s].length for s in seq_ids], dtype=np.int64)
        S = int(lengths.max())
        max_len = S if max_len is None else max_len
        if max_len < S:
            raise ValueError(f"max_len={max_len} is shorter than the longest row ({S})")
        bs = books.block_size
        _, Hkv, _, d = self.k[0].shape
        kv = KVCache([zeros((len(seq_ids), Hkv, max_len, d), self.kv_dtype) for _ in self.k],
                     [zeros((len(seq_ids), Hkv, max_len, d), self.kv_dtype) for _ in self.v],
                     lengths, self.attention)
        for b, (s, n) in enumerate(zip(seq_ids, lengths.tolist(), strict=True)):  # its own length
            seq = books.seqs[s]        # slots of blocks that slid out of the window stay 0
            base = seq.slid * bs
            table = to_device(block_table([seq], books.blocks_for(n) - seq.slid))  # (1, nb)
            for contiguous, pool in zip(kv.k + kv.v, self.k + self.v, strict=True):
                contiguous[b:b + 1, :, base:n] = gather(pool, table, n - base)
        return kv


class PagedView:
    """Rows of the pool as one batch: where their new tokens go, and what they attend over."""

    def __init__(self, cache: PagedCache, ids: list, seqs: list, starts: np.ndarray,
                 counted: bool):
        self.cache, self.ids, self.seqs, self.starts, self.counted = (cache, ids, seqs, starts,
                                                                      counted)

    def row(self, b: int) -> "PagedView":
        """Row b alone, a batch of one."""
        return PagedView(self.cache, self.ids[b:b + 1], self.seqs[b:b + 1], self.starts[b:b + 1],
                         self.counted)

    def positions(self, T: int) -> np.ndarray:
        """Positions (B, T) of T new tokens per row: where they go, and their RoPE angle."""
        rooms = np.array([len(s.blocks) for s in self.seqs]) * self.cache.books.block_size
        if (self.starts + T > rooms).any():
            raise ValueError(f"no room for {T} token(s) in rows of {self.starts.tolist()} "
                             f"(slots {rooms.tolist()}): call make_room first")
        return self.starts[:, None] + np.arange(T)

    def held(self, positions: np.ndarray) -> tuple:
        """What the rows' passes attend over: -> (per row, its first block held (B,), S the
        slots of the longest row from there). Slot j of row b holds position
        first[b] * bs + j; the blocks before first[b] slid out of the window (blocks.py)."""
        first = np.array([s.slid for s in self.seqs], dtype=np.int64)      # (B,)
        bs = self.cache.books.block_size
        return first, int((positions.max(axis=1) + 1 - first * bs).max())

    def slots(self, positions: np.ndarray):
        """Where positions (B, T) go and where each row's blocks are, worked out once per
        forward pass -> (blocks (B, T), offsets (B, T), block tables (B, nb), S) on the device:
        each row's table from its first block held (``held``)."""
        books = self.cache.books
        bs, N = books.block_size, books.num_blocks
        first, S = self.held(positions)
        table = block_table(self.seqs, books.blocks_for(S))                  # (B, nb)
        # Checked here: CuPy would wrap a bad id around silently.
        if table.min() < 0 or table.max() >= N:
            raise ValueError(f"block ids {table.min()}..{table.max()} outside a pool of {N}")
        if (positions // bs < first[:, None]).any():
            raise RuntimeError("a write into a block that slid out of the window")
        blocks = np.take_along_axis(table, positions // bs - first[:, None], axis=1)  # (B, T)
        if not all(map(books.may_write, blocks.ravel())):  # shared or named: never changed
            raise RuntimeError("write into a shared or named block: make_room copies it first")
        return to_device(blocks), to_device(positions % bs), to_device(table), S

    def mask(self, positions: np.ndarray, window: int | None = None):
        """Rows laid out as the contiguous cache's once gathered (slot j holds position j):
        its causal mask, or with a window the sliding-window layers' (model.Batch.windowed:
        a query at p sees p - window + 1 .. p). A row whose first blocks slid out holds
        position first * bs + j in slot j (``held``): the same rules over those positions."""
        first, S = self.held(positions)
        if not first.any():
            if window is None:
                return causal(positions, self.cache.attention)
            return sliding(positions, xp.arange(S)[None], window)
        held = to_device(first[:, None] * self.cache.books.block_size + np.arange(S))  # (B, S)
        return sliding(positions, held, int(positions.max()) + 1 if window is None else window)

    def attend(self, q, k, v, visible):
        return self.cache.way(q.shape[1]).attend(q, k, v, visible)

    def update(self, layer: int, k, v, slots=None):
        """Write k, v (B, T, Hkv, d) into their slots -> k, v (B, Hkv, S, d), S longest row:
        where they lie (InPlace), or gathered (``PagedCache.reads_in_place``)."""
        cache = self.cache
        blocks, offsets, table, S = self.slots(self.positions(k.shape[1])) if slots is None \
            else slots
        # pool[blocks[b, t], :, offsets[b, t]] = k[b, t]: advanced indices on axes 0 and 2
        cache.k[layer][blocks, :, offsets] = k
        cache.v[layer][blocks, :, offsets] = v
        held = InPlace if cache.reads_in_place(k.shape[1]) else gather
        return held(cache.k[layer], table, S), held(cache.v[layer], table, S)

    def advance(self, T: int) -> None:
        """Called by forward after every layer has stored its T new tokens. A plan's rows
        were counted when it was made, and the scheduler marks them written when it commits
        the step; a view made without a plan counts its tokens here."""
        if not self.counted:
            self.cache.books.written(self.ids, self.starts, T)
            for s in self.seqs:
                s.length += T
        self.starts = self.starts + T


class RaggedView:
    """Several groups of new tokens flattened into one row of R tokens, as vLLM and
    Sarathi-Serve batch a step: group i is len(ids) rows of T tokens each, row b sequence
    ids[b] from position starts[b] (the decodes: B rows of one token; a prompt chunk: one row
    of many), laid out row after row. Every product of the pass takes the R tokens at once, so
    each weight is read once for the decodes and the chunks together; attention is per group,
    each a PagedView over its rows' own blocks, causal within a row. For a plan that has
    counted the tokens (``append``); no sequence twice."""

    def __init__(self, cache: PagedCache, groups):
        self.cache = cache
        self.parts = [(cache.view(ids, starts), len(ids), T) for ids, starts, T in groups]
        self.edges = np.cumsum([0] + [B * T for _, B, T in self.parts])   # group i's tokens

    def _groups(self, flat) -> list:
        """(1, R, ...) -> per group, its (B_i, T_i, ...) rows (views)."""
        return [flat[0, a:b].reshape(B, T, *flat.shape[2:]) for (_, B, T), a, b in
                zip(self.parts, self.edges[:-1], self.edges[1:], strict=True)]

    def positions(self, T: int) -> np.ndarray:
        """(1, R): each token its own position."""
        if T != self.edges[-1]:
            raise ValueError(f"a ragged view of {self.edges[-1]} tokens was given {T}")
        return np.concatenate([view.positions(T).reshape(1, -1) for view, _, T in self.parts],
                              axis=1)

    def slots(self, positions: np.ndarray) -> list:
        return [view.slots(p)
                for (view, _, _), p in zip(self.parts, self._groups(positions), strict=True)]

    def mask(self, positions: np.ndarray, window: int | None = None) -> list:
        return [view.mask(p, window)
                for (view, _, _), p in zip(self.parts, self._groups(positions), strict=True)]

    def update(self, layer: int, k, v, slots):
        """k, v (1, R, Hkv, d) into each group's slots -> per group, its rows' keys and
        values (B_i, Hkv, S_i, d) (each written before it is read)."""
        held = [view.update(layer, k_i, v_i, s) for (view, _, _), k_i, v_i, s in
                zip(self.parts, self._groups(k), self._groups(v), slots, strict=True)]
        return [k for k, _ in held], [v for _, v in held]

    def attend(self, q, k, v, visible):
        """q (1, R, H, d), per group its keys, values and mask -> (1, R, H*d)."""
        out = [view.attend(q_i, k_i, v_i, m_i) for (view, _, _), q_i, k_i, v_i, m_i in
               zip(self.parts, self._groups(q), k, v, visible, strict=True)]   # (B_i, T_i, H*d)
        return xp.concatenate([o.reshape(1, -1, o.shape[-1]) for o in out], axis=1)

    def advance(self, T: int) -> None:
        for view, _, T_i in self.parts:
            view.advance(T_i)


def block_table(seqs, nb: int) -> np.ndarray:
    """The rows' block tables from their first block held (the ones before slid out of the
    window) as one (B, nb) host array. Short rows are padded with their own first block:
    slots past a row's length, which the attention mask hides."""
    return np.array([(s.held + s.held[:1] * nb)[:nb] for s in seqs])


def on_host(held):
    """A copy in host memory (codes and scales of a quantized cache alike)."""
    return held.apply(to_numpy) if isinstance(held, QuantizedArray) else to_numpy(held)


def on_device(held):
    return held.apply(to_device) if isinstance(held, QuantizedArray) else to_device(held)


class InPlace:
    """A layer's keys (or values) of B rows left where they lie in the pool, read as gather's
    (B, Hkv, S, d) would be, a slice of slots at a time: ``[:, :, j:j + n]`` gathers only the
    blocks slots j..j+n-1 lie in (what tiled_attention and two_pass_attention ask for, tile
    by tile); ``[r0:r1, h0:h1]`` is rows r0:r1's kv heads h0:h1, still in place.

    >>> pool = xp.arange(4 * 1 * 2 * 1, dtype=xp.float32).reshape(4, 1, 2, 1)  # slot = value
    >>> table = xp.asarray([[3, 1, 0], [2, 2, 2]])           # row 0: blocks 3, 1, 0; row 1: 2
    >>> keys = InPlace(pool, table, 5)
    >>> keys.shape, to_numpy(keys[:, :, 1:4])[:, 0, :, 0].tolist()          # slots 1..3
    ((2, 1, 5, 1), [[7.0, 2.0, 3.0], [5.0, 4.0, 5.0]])
    >>> to_numpy(keys[1:, :][:, :, 1:4])[:, 0, :, 0].tolist()                 # row 1 alone
    [[5.0, 4.0, 5.0]]
    """

    def __init__(self, pool, table, S: int):
        self.pool, self.table, self.S = pool, table, S           # (N, Hkv, bs, d), (B, nb)
        _, Hkv, _, d = pool.shape
        self.shape = (table.shape[0], Hkv, S, d)

    def __getitem__(self, index):
        if len(index) == 2:              # [rows, kv heads]: a part of a pass (kernels/attention.py)
            rows, heads = index
            return InPlace(self.pool[:, heads], self.table[rows], self.S)
        rows, heads, slots = index
        if (rows, heads) != (slice(None), slice(None)) or slots.step is not None:
            raise IndexError(f"InPlace reads [:, :, start:stop] or [rows, heads], not {index}")
        bs = self.pool.shape[2]
        start, stop = slots.start or 0, min(self.S, self.S if slots.stop is None else slots.stop)
        first, last = start // bs, -(-stop // bs)                     # the blocks they lie in
        return gather(self.pool, self.table[:, first:last], stop - first * bs)[
            :, :, start - first * bs:]                                # (B, Hkv, stop-start, d)


def gather(pool, table, S: int):
    """Pool (N, Hkv, bs, d), tables (B, nb) -> (B, Hkv, S, d): each row's blocks end to end.
    A quantized pool gathers its codes and scales, each the same way."""
    if isinstance(pool, QuantizedArray):
        return pool.apply(lambda a: gather(a, table, S))
    B, nb = table.shape
    _, Hkv, bs, d = pool.shape
    heads = xp.arange(Hkv)[None, :, None]                                # (1, Hkv, 1)
    # One gather straight into the contiguous cache's layout, keys d floats apart. (A
    # transpose-and-reshape view instead leaves them Hkv*d apart when bs = 1, and numpy then
    # computes q @ k.T by another path that rounds differently: measured, and enough to make
    # a batched row differ from the same row alone.)
    blocks = pool[table[:, None, :], heads]                              # (B, Hkv, nb, bs, d)
    return blocks.reshape(B, Hkv, nb * bs, d)[:, :, :S]
