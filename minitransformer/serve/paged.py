"""The paged KV cache: every sequence's keys and values in fixed-size blocks (experiment 14).

Sequences come and go, and nobody knows how long each will grow: a contiguous cache reserves
each one's longest possible context, and most of it is never filled. PagedAttention (Kwon et
al., 2023; vLLM) borrows the operating system's answer:

    pool         per layer, one array of N blocks; a block holds block_size (bs) token slots
    free list    the blocks nobody holds
    block table  per sequence, the blocks holding its tokens in order: position p lives in
                 block table[p // bs] at offset p % bs, so the cache of a sequence is scattered
                 in memory and contiguous to the model
    refcount     how many block tables hold each block

A sequence wastes at most the unfilled slots of its last block. Room is made first (``add``,
``make_room``): allocation can fail, and a failure changes nothing. ``view(seq_ids)`` is what
``model.forward`` talks to: ``positions``, ``update`` (write the new keys/values into their
slots, return all held, gathered through the block tables) and ``advance``.

Prefix caching (vLLM's automatic prefix caching): a full block gets a name, a hash of its
parent's name and its own tokens, so equal names mean equal whole prefixes (``block_names``).
``seal`` offers a sequence's full blocks to the ``PrefixIndex``; ``add`` looks a new prompt's
leading names up there and holds the blocks found instead of computing them again. When its
last holder goes, a named block is kept (refcount 0, counted free) and given out again, its
name forgotten, only when the free list is empty, least recently released first: so a chat's
next turn, or any prompt starting with a kept one, finds its start already computed. A named
block is never written: a sequence that must write into one (or into a block someone else
holds) copies it first (copy on write). ``fork`` gives a new sequence another's block table,
its partly filled last block too (parallel samples of one prompt): whichever of them writes
into a block first copies it.

Shapes: N blocks in the pool, bs slots per block, nb blocks in a table; B, T, S, Hkv, d as in
model.py. Leaves out: kernels that read blocks in place (we gather a copy per layer and step),
naming partial blocks, and the extra keys vLLM hashes in (adapters, images).

Example: blocks of 4 slots. Sequence "a" holds 6 tokens in 2 blocks, one of them full; "b"
starts with the same 4 tokens, so its block table starts with a's first block:

>>> from minitransformer.config import ModelConfig
>>> from minitransformer.checkpoints.synth import qwen2_config
>>> cache = PagedCache.allocate(ModelConfig.from_dict(qwen2_config()), 8, block_size=4)
>>> a = [5, 6, 7, 8, 9, 10]
>>> cache.add("a", a)                 # -> prompt tokens already held: none
0
>>> cache.view(["a"]).advance(6)      # (what forward does once every layer wrote them)
>>> cache.seal("a", a)                # name a's full blocks: offered to later prompts
>>> cache.add("b", [5, 6, 7, 8, 42])  # b's first 4 tokens are a's first block
4
>>> cache.seqs["a"].blocks, cache.seqs["b"].blocks      # the block tables
([0, 1], [0, 2])
>>> cache.refcount[:3].tolist(), cache.num_free         # block 0 has two holders
([2, 1, 1], 5)
>>> p = 5                             # a's token at position 5 lives in block 1, slot 1:
>>> cache.seqs["a"].blocks[p // cache.block_size], p % cache.block_size
(1, 1)

Both end; block 0 stays cached, free but named, and a later prompt finds it:

>>> cache.free_seq("a"); cache.free_seq("b")
>>> cache.num_free, list(cache.index.unheld)            # every block free, block 0 kept
(8, [0])
>>> cache.add("c", [5, 6, 7, 8, 11, 12]), cache.seqs["c"].blocks
(4, [0, 2])
"""
import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from minitransformer.backend import to_device, to_numpy, xp
from minitransformer.kvquant import (KVDims, QuantizedArray, cache_bytes_per_token, kv_dtype_of,
                                     zeros)
from minitransformer.shape import ceil_div

ROOT = b""                  # the parent name of a sequence's first block


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks that hold `tokens` tokens: the last one may be partly filled.

    >>> blocks_for(16, 16), blocks_for(17, 16), blocks_for(0, 16)
    (1, 2, 0)
    """
    return ceil_div(tokens, block_size)


def block_names(tokens, block_size: int, parent: bytes = ROOT) -> list:
    """Names of the full blocks of tokens: block i's name is SHA-256(name of block i-1, its
    token ids), so a name stands for the whole prefix up to the block's end, as in vLLM.

    A cryptographic hash, not Python's ``hash``: that one is made to be fast, not to resist
    collisions (``hash(n) == n`` for small ints), and a collision here would hand one
    request another's keys and values.
    >>> a, b = block_names([1, 2, 3, 4, 5], 2), block_names([1, 2, 3, 9], 2)
    >>> len(a), a[0] == b[0], a[1] == b[1]       # 2 full blocks; the second ones differ
    (2, True, False)
    >>> block_names([3, 4], 2, parent=a[0]) == a[1:]        # a name chains its parent's
    True
    """
    names = []
    for end in range(block_size, len(tokens) + 1, block_size):
        block = np.asarray(tokens[end - block_size:end], dtype=np.int64)
        parent = hashlib.sha256(parent + block.tobytes()).digest()
        names.append(parent)
    return names


class PoolExhausted(RuntimeError):
    """Too few free blocks; nothing was changed. The caller waits, preempts or rejects."""


@dataclass
class PrefixIndex:
    """The prefix cache's book: full blocks by name, and those nobody holds, oldest first.

    It keeps, and only its methods change:
      - ``block_of`` and ``name_of`` are inverse maps, one block per name, one name per block;
      - ``unheld`` is exactly the named blocks with no holder (refcount 0), least recently
        released first: free to take, their keys and values intact until ``evict``;
      - a named block is never written (the cache copies it first), so its slots hold the
        tokens its name stands for as long as it is named.
    """
    block_of: dict = field(default_factory=dict)    # name -> block
    name_of: dict = field(default_factory=dict)     # block -> name
    unheld: OrderedDict = field(default_factory=OrderedDict)  # block -> None, LRU first
    evicted: int = 0        # blocks given out again, their names forgotten, since the start

    def find(self, names) -> list:
        """The blocks of the leading names found, in order (a miss ends the prefix)."""
        found = []
        for name in names:
            if name not in self.block_of:
                break
            found.append(self.block_of[name])
        return found

    def offer(self, name, block: int) -> None:
        """Name a full, written block, unless the name or the block is already taken."""
        if name not in self.block_of and block not in self.name_of:
            self.block_of[name], self.name_of[block] = block, name

    def held(self, block: int) -> None:
        """A block gets a holder: if it was kept unheld, it is no longer evictable."""
        self.unheld.pop(block, None)

    def released(self, block: int) -> bool:
        """Its last holder went: a named block is kept (True), an unnamed one is not."""
        if block in self.name_of:
            self.unheld[block] = None
            return True
        return False

    def evict(self) -> int:
        """The least recently released kept block, its name forgotten, to be reused."""
        block, _ = self.unheld.popitem(last=False)
        del self.block_of[self.name_of.pop(block)]
        self.evicted += 1
        return block


@dataclass
class SeqBlocks:
    blocks: list            # the block table: physical block ids, in position order
    length: int = 0         # tokens written
    max_len: int = 0        # the most it may grow to (what a reservation would hold)
    names: list = field(default_factory=list)   # names of its first full blocks (see seal)


@dataclass(frozen=True)
class Swapped:
    """A preempted sequence's cache, in host memory: (blocks, Hkv, bs, d) per layer."""
    length: int
    max_len: int
    k: list
    v: list

    @property
    def blocks(self) -> int:
        return len(self.k[0])


@dataclass(frozen=True)
class PagedStats:
    """A snapshot of the pool. Token counts are slots; bytes = slots x bytes_per_token."""
    block_size: int
    bytes_per_token: int
    blocks_total: int
    blocks_held: int        # blocks with refcount > 0
    blocks_shared: int      # blocks held by more than one sequence
    sequences: int
    slots_filled: int       # slots holding a token, each physical block counted once
    tokens_logical: int     # sum of sequence lengths (a shared prefix counted per sequence)
    tokens_reserved: int    # sum of max_len: what reserving each sequence's maximum would hold
    blocks_cached: int = 0  # unheld but kept for the prefix cache (counted free)

    @property
    def slots_wasted(self) -> int:
        """Held but unfilled: the free tail of each sequence's last block."""
        return self.blocks_held * self.block_size - self.slots_filled


@dataclass
class PagedCache:
    k: list                 # L arrays (N, Hkv, bs, d): a block is a small (Hkv, bs, d) cache
    #                         (float, or a QuantizedArray of codes and scales: kvquant.py)
    v: list
    block_size: int
    refcount: np.ndarray    # (N,) host ints
    free: list              # unheld, unnamed block ids, used as a stack
    seqs: dict = field(default_factory=dict)      # seq id -> SeqBlocks
    index: PrefixIndex = field(default_factory=PrefixIndex)     # named full blocks

    @classmethod
    def allocate(cls, config, num_blocks: int, block_size: int, kv_dtype: str = "f32"):
        """kv_dtype: f32, f16, q8_0 or q4_0 (kvquant.KV_DTYPES)."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a paged cache needs num_blocks >= 1 and block_size >= 1, "
                             f"got {num_blocks}, {block_size}")
        shape = (num_blocks, config.num_key_value_heads, block_size, config.head_dim)
        L = config.num_hidden_layers
        return cls(k=[zeros(shape, kv_dtype) for _ in range(L)],
                   v=[zeros(shape, kv_dtype) for _ in range(L)], block_size=block_size,
                   refcount=np.zeros(num_blocks, dtype=np.int64),
                   free=list(range(num_blocks - 1, -1, -1)))  # pop() hands out 0, 1, 2, ...

    @property
    def num_blocks(self) -> int:
        return self.k[0].shape[0]

    @property
    def num_free(self) -> int:
        """Blocks nobody holds: the free list and the kept blocks of the prefix cache."""
        return len(self.free) + len(self.index.unheld)

    @property
    def kv_dtype(self) -> str:
        return kv_dtype_of(self.k[0])

    @property
    def bytes_per_token(self) -> int:
        _, Hkv, _, d = self.k[0].shape
        return cache_bytes_per_token(KVDims(len(self.k), Hkv, d), self.kv_dtype)

    def blocks_for(self, tokens: int) -> int:
        return blocks_for(tokens, self.block_size)

    # --- allocation --------------------------------------------------------------------------
    def _take(self) -> int:
        """A block for one holder: from the free list, else the least recently used kept one."""
        block = self.free.pop() if self.free else self.index.evict()
        self.refcount[block] = 1
        return block

    def _hold(self, block: int) -> None:
        self.refcount[block] += 1
        self.index.held(block)

    def _release(self, block: int) -> None:
        self.refcount[block] -= 1
        if self.refcount[block] == 0 and not self.index.released(block):
            self.free.append(block)     # unnamed: back to the pool (named: kept, see index)

    def _writable(self, block: int) -> bool:
        """One holder and no name: writing into it changes nobody else's tokens."""
        return self.refcount[block] == 1 and block not in self.index.name_of

    def _copy_block(self, src: int) -> int:
        """Copy on write: a private copy of a shared or named block, one holder less for it."""
        dst = self._take()
        for k, v in zip(self.k, self.v):
            k[dst], v[dst] = k[src], v[src]
        self._release(src)
        return dst

    def cached_prefix(self, prompt) -> tuple:
        """-> (names of the prompt's full blocks, the blocks found cached for the leading
        ones) and how many prompt tokens they hold: all but the last prompt token, at most,
        since its logits pick the first new token."""
        names = block_names(prompt, self.block_size)
        found = self.index.find(names)
        return names, found, min(len(found) * self.block_size, len(prompt) - 1)

    def add_cost(self, prompt, then: int = 0) -> int:
        """Free blocks ``add(prompt)`` would take, and ``then`` more tokens after it (the
        engine asks before it admits): new blocks, a copy of a cached block it must write
        into, and the kept blocks it revives (they leave the free count)."""
        _, found, held = self.cached_prefix(prompt)
        copies = 1 if held < len(found) * self.block_size else 0   # held in full: see add
        revived = sum(self.refcount[b] == 0 for b in found)
        # the copy lives only until the prompt's last block is written: by then its source is
        # free again, so it and the blocks for ``then`` more tokens are never needed together
        return max(self.blocks_for(len(prompt)) + copies,
                   self.blocks_for(len(prompt) + then)) - len(found) + revived

    def add(self, seq_id, prompt, max_len: int = 0, reuse: bool = True) -> int:
        """Give a new sequence blocks for its prompt, holding the cached ones it starts with
        (unless ``reuse`` is False: a caller that needs every prompt position computed).

        -> how many prompt tokens are already in the cache; the caller prefills the rest. The
        last prompt token is always left to compute (its logits pick the first new token), so
        a prompt cached in full gets its last block copied, to be overwritten at that slot.
        """
        if seq_id in self.seqs:
            raise ValueError(f"sequence {seq_id!r} is already in the cache")
        if len(prompt) < 1:
            raise ValueError("a sequence needs a prompt of at least one token")
        cost = self.add_cost(prompt) if reuse else self.blocks_for(len(prompt))
        if cost > self.num_free:
            raise PoolExhausted(f"a prompt of {len(prompt)} tokens needs {cost} blocks, "
                                f"{self.num_free} free")
        names, found, held = self.cached_prefix(prompt) if reuse else ([], [], 0)
        for block in found:
            self._hold(block)
        self.seqs[seq_id] = SeqBlocks(list(found), held, max(max_len, len(prompt)),
                                      names[:held // self.block_size])
        self.make_room([seq_id], len(prompt) - held)  # cannot fail: counted above
        return held

    def fork(self, seq_id, child_id) -> None:
        """A new sequence holding the same blocks as seq_id, partly filled last block included
        (parallel samples of one prompt): it takes no free block now; whichever of the two
        writes first into a shared block copies it (``make_room``)."""
        if child_id in self.seqs:
            raise ValueError(f"sequence {child_id!r} is already in the cache")
        seq = self.seqs[seq_id]
        for block in seq.blocks:
            self._hold(block)
        self.seqs[child_id] = SeqBlocks(list(seq.blocks), seq.length, seq.max_len,
                                        list(seq.names))

    def blocks_needed(self, seq_id, T: int) -> int:
        """Free blocks that appending T tokens to a sequence takes (new ones, copies)."""
        return self.room_needed([seq_id], T)

    def room_needed(self, seq_ids, T: int) -> int:
        """Free blocks that appending T tokens to each of seq_ids takes: new blocks, and a
        copy for every writer of a named or shared block, but for the last writer of an
        unnamed block that only the writers hold (the others copied it: it is its own now,
        as for the samples of one prompt writing their first tokens into its last block)."""
        new, writers = 0, {}
        for s in seq_ids:
            seq = self.seqs[s]
            new += max(self.blocks_for(seq.length + T) - len(seq.blocks), 0)
            for b in seq.blocks[seq.length // self.block_size:]:   # about to be written
                writers[b] = writers.get(b, 0) + 1
        copies = sum(w - int(self.refcount[b] == w and b not in self.index.name_of)
                     for b, w in writers.items())
        return new + copies

    def make_room(self, seq_ids, T: int) -> None:
        """Blocks for T more tokens in each sequence: all of it, or PoolExhausted and nothing."""
        need = self.room_needed(seq_ids, T)
        if need > self.num_free:
            raise PoolExhausted(f"{need} blocks needed, {self.num_free} free")
        for s in seq_ids:
            seq = self.seqs[s]
            for i in range(seq.length // self.block_size, len(seq.blocks)):
                if not self._writable(seq.blocks[i]):   # about to be written: copy on write
                    seq.blocks[i] = self._copy_block(seq.blocks[i])
            while len(seq.blocks) < self.blocks_for(seq.length + T):
                seq.blocks.append(self._take())

    def seal(self, seq_id, tokens) -> None:
        """Name the sequence's full blocks not named yet and offer them to the index; tokens:
        its token ids, at least as many as it holds (call once they are written)."""
        seq, bs = self.seqs[seq_id], self.block_size
        named, full = len(seq.names), seq.length // bs
        if full > named:
            parent = seq.names[-1] if seq.names else ROOT
            seq.names += block_names(tokens[named * bs:full * bs], bs, parent)
            for name, block in zip(seq.names[named:], seq.blocks[named:full]):
                self.index.offer(name, block)

    def trim(self, seq_id, n: int) -> None:
        """Forget a sequence's last n tokens (rejected drafts, a benchmark's rollback)."""
        seq = self.seqs[seq_id]
        if not 0 <= n <= seq.length:
            raise ValueError(f"cannot trim {n} tokens from a sequence of {seq.length}")
        seq.length -= n
        del seq.names[seq.length // self.block_size:]   # a named block it keeps is copied
        while len(seq.blocks) > self.blocks_for(seq.length):   # before it is written again
            self._release(seq.blocks.pop())

    def free_seq(self, seq_id) -> None:
        """Drop a sequence: each of its blocks loses a holder; unheld ones are free (kept
        for the prefix cache if named)."""
        for block in self.seqs.pop(seq_id).blocks:
            self._release(block)

    def check(self) -> None:
        """The books, checked (tests and the engine fuzz call it after every step); a
        RuntimeError names the first broken rule:
        every block's refcount is the number of block tables holding it; every unheld block
        is on the free list or kept by the index, once; a free-listed block has no name; the
        index's two maps are inverse; a sequence's named blocks carry its own prefix's names."""
        holders = np.zeros(self.num_blocks, dtype=np.int64)
        for seq in self.seqs.values():
            np.add.at(holders, seq.blocks, 1)
        index = self.index
        rules = [
            ((self.refcount == holders).all(), "a refcount differs from its block tables"),
            (sorted(self.free + list(index.unheld)) == np.flatnonzero(holders == 0).tolist(),
             "the free list and the kept blocks are not exactly the unheld blocks"),
            (not any(block in index.name_of for block in self.free),
             "a block on the free list still has a name"),
            (len(index.block_of) == len(index.name_of) and
             all(index.name_of.get(block) == name for name, block in index.block_of.items()),
             "the index's maps are not inverse"),
            (all(index.name_of.get(block, name) == name for seq in self.seqs.values()
                 for name, block in zip(seq.names, seq.blocks)),
             "a sequence holds a block named for another prefix"),
            (all(len(seq.names) <= seq.length // self.block_size for seq in self.seqs.values()),
             "a sequence names a block it has not filled")]
        for holds, broken in rules:
            if not holds:
                raise RuntimeError(f"paged cache books: {broken}")

    # --- preemption by swapping --------------------------------------------------------------
    def swap_out(self, seq_id) -> "Swapped":
        """Copy a sequence's keys/values to host memory and free its blocks."""
        seq = self.seqs[seq_id]
        index = to_device(np.array(seq.blocks, dtype=np.int64))
        swapped = Swapped(seq.length, seq.max_len, [on_host(k[index]) for k in self.k],
                          [on_host(v[index]) for v in self.v])
        self.free_seq(seq_id)
        return swapped

    def swap_in_cost(self, swapped: "Swapped", then: int = 0) -> int:
        """Free blocks ``swap_in(swapped)`` would take, and ``then`` more tokens after it."""
        return max(swapped.blocks, self.blocks_for(swapped.length + then))

    def swap_in(self, seq_id, swapped: "Swapped") -> None:
        """Bring a swapped-out sequence back, bit for bit, into fresh private blocks."""
        if swapped.blocks > self.num_free:
            raise PoolExhausted(f"{swapped.blocks} blocks needed, {self.num_free} free")
        blocks = [self._take() for _ in range(swapped.blocks)]
        index = to_device(np.array(blocks, dtype=np.int64))  # host-made ids, in range
        for layer in range(len(self.k)):
            self.k[layer][index] = on_device(swapped.k[layer])
            self.v[layer][index] = on_device(swapped.v[layer])
        self.seqs[seq_id] = SeqBlocks(blocks, swapped.length, swapped.max_len)  # unnamed:
        # seal names its blocks again (the copies are private; the index may keep originals)

    # --- what the forward pass sees ----------------------------------------------------------
    def view(self, seq_ids) -> "PagedView":
        """The sequences seq_ids as one batch for model.forward (row b = seq_ids[b])."""
        return PagedView(self, [self.seqs[s] for s in seq_ids])

    def stats(self) -> PagedStats:
        filled = {}  # physical block -> slots filled in it (a shared block counted once)
        for seq in self.seqs.values():
            for i, block in enumerate(seq.blocks):
                used = min(self.block_size, max(seq.length - i * self.block_size, 0))
                filled[block] = max(filled.get(block, 0), used)
        return PagedStats(self.block_size, self.bytes_per_token, self.num_blocks,
                          int((self.refcount > 0).sum()), int((self.refcount > 1).sum()),
                          len(self.seqs), sum(filled.values()),
                          sum(s.length for s in self.seqs.values()),
                          sum(s.max_len for s in self.seqs.values()),
                          len(self.index.unheld))


@dataclass
class PagedView:
    cache: PagedCache
    seqs: list

    def positions(self, T: int) -> np.ndarray:
        """Positions (B, T) of T new tokens per row: where they go, and their RoPE angle."""
        lengths = np.array([s.length for s in self.seqs])
        rooms = np.array([len(s.blocks) for s in self.seqs]) * self.cache.block_size
        if (lengths + T > rooms).any():
            raise ValueError(f"no room for {T} token(s) in rows of {lengths.tolist()} "
                             f"(slots {rooms.tolist()}): call make_room first")
        return lengths[:, None] + np.arange(T)

    def slots(self, positions: np.ndarray):
        """Where positions (B, T) go and where each row's blocks are, worked out once per
        forward pass -> (blocks (B, T), offsets (B, T), block tables (B, nb), S) on the device.
        """
        cache, bs = self.cache, self.cache.block_size
        S, N = int(positions.max()) + 1, cache.num_blocks
        nb = cache.blocks_for(S)
        # Short rows are padded with their own first block: slots past a row's length, which
        # the attention mask hides. Checked here: CuPy would wrap a bad id around silently.
        table = np.array([(s.blocks + s.blocks[:1] * nb)[:nb] for s in self.seqs])  # (B, nb)
        if table.min() < 0 or table.max() >= N:
            raise ValueError(f"block ids {table.min()}..{table.max()} outside a pool of {N}")
        blocks = np.take_along_axis(table, positions // bs, axis=1)       # (B, T)
        if not all(map(cache._writable, blocks.ravel())):  # shared or named: never changed
            raise RuntimeError("write into a shared or named block: make_room copies it first")
        return to_device(blocks), to_device(positions % bs), to_device(table), S

    def update(self, layer: int, k, v, slots=None):
        """Write k, v (B, T, Hkv, d) into their slots -> k, v (B, Hkv, S, d), S longest row."""
        cache = self.cache
        blocks, offsets, table, S = self.slots(self.positions(k.shape[1])) if slots is None \
            else slots
        # pool[blocks[b, t], :, offsets[b, t]] = k[b, t]: advanced indices on axes 0 and 2
        cache.k[layer][blocks, :, offsets] = k
        cache.v[layer][blocks, :, offsets] = v
        return gather(cache.k[layer], table, S), gather(cache.v[layer], table, S)

    def advance(self, T: int) -> None:
        """Called by forward after every layer has stored its T new tokens."""
        for s in self.seqs:
            s.length += T


def on_host(held):
    """A copy in host memory (codes and scales of a quantized cache alike)."""
    return held.apply(to_numpy) if isinstance(held, QuantizedArray) else to_numpy(held)


def on_device(held):
    return held.apply(to_device) if isinstance(held, QuantizedArray) else to_device(held)


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
