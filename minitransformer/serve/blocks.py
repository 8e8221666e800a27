"""The block manager: who holds which block of the paged cache, in host integers (experiment 14).

The books of PagedAttention (Kwon et al., 2023; vLLM), apart from the arrays they describe:

    free list    the blocks nobody holds
    block table  per sequence, the blocks holding its tokens in order: position p lives in
                 block table[p // bs] at offset p % bs
    refcount     how many block tables hold each block
    index        the prefix cache: full blocks by name, kept after their last holder goes

Room is made first (``add``, ``make_room``): allocation can fail, and a failure changes
nothing. What the books decide that the arrays must follow (copy a shared block before a
write, swap a preempted sequence out or back in) is queued as ``moves``, host integers the
device pool (paged.py) carries out in order; the scheduler takes them into its plan. The books
never hold a key or a value. docs/serving.md has prefix caching and copy on write in full.

Sliding windows (``window``: a model whose every layer slides, config.ModelConfig.cache_window):
a query at position p reads p - W + 1 .. p only, so once a sequence's next query is at position
L, a block whose last slot is before L - W + 1 is read by no later query of it. ``slide``
releases such blocks from the front of its block table, whose entries become SLID (a hole:
the table stays indexed by position, p in entry p // bs), so what a sequence holds stops
growing at the blocks of one window, ceil((W - 1) / bs) + 1 (``window_blocks``), however long
it runs. Released is what a finished sequence's blocks are: an unnamed block goes back to the
free list, a named one is kept by the prefix cache (its keys intact until evicted, so a later
prompt with the same prefix still finds it by name; evicted, its name goes with it). The
scheduler slides each sequence at the commit, from the tokens it kept: a rejected draft's
slots lie past them, so no trim ever needs a released block (``trim`` refuses one that
would), and the books need no spare slots for speculation as a rotating cache does. When a
layer attends fully (``window`` None: Qwen2 with windows from layer 1 on), its queries read
back to position 0 and nothing is released.

Shapes: N blocks, bs slots per block. Leaves out: naming partial blocks, the extra keys vLLM
hashes in (adapters, images).

>>> books = BlockManager(num_blocks=8, block_size=4)
>>> a = [5, 6, 7, 8, 9, 10]
>>> books.add("a", a), books.append(["a"], 6)   # none cached; a plan counts all 6 as held
(0, [0])
>>> books.seal("a", a)                      # a's full block named: offered to later prompts
>>> books.add("b", [5, 6, 7, 8, 42])        # b's first 4 tokens are a's first block
4
>>> books.seqs["a"].blocks, books.seqs["b"].blocks, books.refcount[:3].tolist()
([0, 1], [0, 2], [2, 1, 1])
"""
import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from minitransformer.shape import ceil_div

ROOT = b""                  # the parent name of a sequence's first block
SLID = -1                   # a block table's entry for a block released as it slid out of
#                             the window: no key of those positions is read again


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks that hold `tokens` tokens: the last one may be partly filled.

    >>> blocks_for(16, 16), blocks_for(17, 16), blocks_for(0, 16)
    (1, 2, 0)
    """
    return ceil_div(tokens, block_size)


def pool_blocks(slots: int, tokens: int, block_size: int) -> int:
    """Blocks of a pool in which each of `slots` sequences can hold `tokens` tokens at once:
    what a contiguous cache would reserve, rounded up to blocks. The one sizing of a pool:
    EngineConfig's default, ``paged.pool_for``'s for a workload, the chat's for its context.

    >>> pool_blocks(slots=2, tokens=1024, block_size=16), pool_blocks(1, 17, 16)
    (128, 2)
    """
    return slots * blocks_for(tokens, block_size)


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

    def forget(self, block: int) -> None:
        """A held block's name goes (its slots will not hold what the name stands for)."""
        name = self.name_of.pop(block, None)
        if name is not None:
            del self.block_of[name]

    def evict(self) -> int:
        """The least recently released kept block, its name forgotten, to be reused."""
        block, _ = self.unheld.popitem(last=False)
        del self.block_of[self.name_of.pop(block)]
        self.evicted += 1
        return block


@dataclass
class SeqBlocks:
    blocks: list            # the block table: physical block ids, in position order
    length: int = 0         # tokens held (written, or counted by a plan that writes them)
    max_len: int = 0        # the most it may grow to (what a reservation would hold)
    names: list = field(default_factory=list)   # names of its first full blocks (see seal)
    slid: int = 0           # its first entries released as they slid out of the window (SLID)

    @property
    def held(self) -> list:
        """The blocks it holds: its table past the entries that slid out."""
        return self.blocks[self.slid:]


@dataclass
class Swapped:
    """A preempted sequence, out of the pool: its books, and its keys and values in host
    memory, (blocks, Hkv, bs, d) per layer, which the pool fills when it does the move."""
    length: int
    max_len: int
    blocks: int                     # blocks held (copied out); ``slid`` holes before them
    k: list | None = None           # None until the pool does the swap-out
    v: list | None = None
    slid: int = 0


@dataclass(frozen=True)
class Copy:                 # copy on write: block src's slots into block dst
    src: int
    dst: int


@dataclass(frozen=True)
class SwapOut:              # blocks' keys and values into host memory, before they are reused
    blocks: tuple
    into: Swapped


@dataclass(frozen=True)
class SwapIn:               # a swapped-out sequence's keys and values into fresh blocks
    blocks: tuple
    source: Swapped


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


class BlockManager:
    """The books of a pool of num_blocks blocks of block_size slots (host integers only);
    window: the W of a model whose every layer slides (``slide``), None when a layer does not."""

    def __init__(self, num_blocks: int, block_size: int, window: int | None = None):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a paged cache needs num_blocks >= 1 and block_size >= 1, "
                             f"got {num_blocks}, {block_size}")
        if window is not None and window < 1:
            raise ValueError(f"a sliding window is at least 1 position, got {window}")
        self.num_blocks, self.block_size, self.window = num_blocks, block_size, window
        self.slid_out = 0               # blocks released as they slid out, since the start
        self.refcount = np.zeros(num_blocks, dtype=np.int64)   # (N,) host ints
        self.free = list(range(num_blocks - 1, -1, -1))  # unheld, unnamed; pop() gives 0, 1 ..
        self.seqs: dict = {}            # seq id -> SeqBlocks
        self.index = PrefixIndex()      # named full blocks
        self.moves: list = []           # Copy / SwapOut / SwapIn decided, not yet done
        self.filling: set[int] = set()  # blocks readied for a write not yet made (make_room)

    @property
    def num_free(self) -> int:
        """Blocks nobody holds: the free list and the kept blocks of the prefix cache."""
        return len(self.free) + len(self.index.unheld)

    def blocks_for(self, tokens: int) -> int:
        return blocks_for(tokens, self.block_size)

    @property
    def window_blocks(self) -> int | None:
        """The most blocks a sequence holds once it slides (None: it never does): the window
        of its next query, W positions ending at it, lies in ceil((W - 1) / bs) + 1 blocks.

        >>> BlockManager(8, 4, window=6).window_blocks     # positions 3..8: blocks 0, 1, 2
        3
        """
        return None if self.window is None else self.blocks_for(self.window - 1) + 1

    def take_moves(self) -> list:
        """The moves decided since the last call, in order, for the pool to carry out."""
        moves, self.moves = self.moves, []
        return moves

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
        if self.refcount[block] == 0:
            self.filling.discard(block)
            if not self.index.released(block):
                self.free.append(block)  # unnamed: back to the pool (named: kept, see index)

    def _writable(self, block: int) -> bool:
        """One holder and no name: writing into it changes nobody else's tokens."""
        return self.refcount[block] == 1 and block not in self.index.name_of

    def may_write(self, block: int) -> bool:
        """True when this step may write into the block: it has one holder and no name, or
        ``make_room`` reserved it for this step's write before a later prompt came to share it
        (or the prefix index named it)."""
        return self._writable(block) or block in self.filling

    def _copy_block(self, src: int) -> int:
        """Copy on write: a private copy of a shared or named block, one holder less for it."""
        dst = self._take()
        self.moves.append(Copy(src, dst))
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
        for block in seq.held:
            self._hold(block)
        self.seqs[child_id] = SeqBlocks(list(seq.blocks), seq.length, seq.max_len,
                                        list(seq.names), seq.slid)

    def blocks_needed(self, seq_id, T: int) -> int:
        """Free blocks that appending T tokens to a sequence takes (new ones, copies)."""
        return self.room_needed([seq_id], T)

    def room_needed(self, seq_ids, T: int) -> int:
        """Free blocks that appending T tokens to each of seq_ids takes: new blocks, and a
        copy for every writer of a named or shared block, but for the last writer of an
        unnamed block that only the writers hold (the others copied it: it is its own now,
        as for the samples of one prompt writing their first tokens into its last block)."""
        new = 0
        writers: dict[int, int] = {}    # block -> the rows about to write it
        for s in seq_ids:
            seq = self.seqs[s]
            new += max(self.blocks_for(seq.length + T) - len(seq.blocks), 0)
            for b in seq.blocks[seq.length // self.block_size:]:   # about to be written
                writers[b] = writers.get(b, 0) + 1
        copies = sum(w - int(self.refcount[b] == w and b not in self.index.name_of)
                     for b, w in writers.items())
        return new + copies

    def free_room(self, seq_id) -> int:
        """Tokens a sequence can grow by in its own blocks and the free list's, without a
        kept block of the prefix cache (those hold cached turns; taking one evicts it)."""
        seq = self.seqs[seq_id]
        return (len(seq.blocks) + len(self.free)) * self.block_size - seq.length

    def make_room(self, seq_ids, T: int) -> None:
        """Blocks for T more tokens in each sequence: all of it, or PoolExhausted and nothing.
        The blocks the T tokens go to are then private, and marked as being filled."""
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
            self.filling.update(seq.blocks[seq.length // self.block_size:
                                           self.blocks_for(seq.length + T)])

    def append(self, seq_ids, T: int) -> list:
        """Room for T more tokens in each sequence, counted as held now, for a forward pass
        that writes them later in the same step (a plan) -> where each one's tokens start."""
        self.make_room(seq_ids, T)
        starts = [self.seqs[s].length for s in seq_ids]
        for s in seq_ids:
            self.seqs[s].length += T
        return starts

    def written(self, seq_ids, starts, T: int) -> None:
        """A forward pass wrote T tokens from starts into each sequence: no longer filling."""
        bs = self.block_size
        for s, start in zip(seq_ids, starts, strict=True):
            self.filling.difference_update(self.seqs[s].blocks[start // bs:
                                                               self.blocks_for(start + T)])

    def drop_unwritten(self) -> None:
        """A pass that was to fill blocks failed: every block still being filled loses its
        name (a plan names the full blocks its tokens fill before they are written), so no
        later prompt finds keys and values that were never written."""
        for block in self.filling:
            self.index.forget(block)

    def seal(self, seq_id, tokens) -> None:
        """Name the sequence's full blocks not named yet and offer them to the index; tokens:
        its token ids, at least as many as it holds (call once they are written, or planned)."""
        seq, bs = self.seqs[seq_id], self.block_size
        named, full = len(seq.names), seq.length // bs
        if full > named:
            parent = seq.names[-1] if seq.names else ROOT
            seq.names += block_names(tokens[named * bs:full * bs], bs, parent)
            for name, block in zip(seq.names[named:], seq.blocks[named:full], strict=True):
                if block != SLID:       # (swapped back in, its table keeps its holes)
                    self.index.offer(name, block)

    def trim(self, seq_id, n: int) -> None:
        """Forget a sequence's last n tokens (rejected drafts, a benchmark's rollback)."""
        seq = self.seqs[seq_id]
        if not 0 <= n <= seq.length:
            raise ValueError(f"cannot trim {n} tokens from a sequence of {seq.length}")
        if seq.slid > self.gone(seq.length - n):
            raise ValueError(f"cannot trim {n} tokens from a sequence of {seq.length}: the "
                             f"window of its next query would reach back into blocks released")
        seq.length -= n
        del seq.names[seq.length // self.block_size:]   # a named block it keeps is copied
        while len(seq.blocks) > self.blocks_for(seq.length):   # before it is written again
            self._release(seq.blocks.pop())

    def free_seq(self, seq_id) -> None:
        """Drop a sequence: each of its blocks loses a holder; unheld ones are free (kept
        for the prefix cache if named)."""
        for block in self.seqs.pop(seq_id).held:
            self._release(block)

    # --- sliding windows ---------------------------------------------------------------------
    def gone(self, length: int) -> int:
        """Leading blocks of a sequence of `length` tokens that no later query reads: its next
        query, at position length, sees length - W + 1 on; a block lies wholly before that
        when its last slot does (0 without a window).

        >>> books = BlockManager(8, 4, window=6)
        >>> [books.gone(n) for n in (8, 9, 12, 13)]      # 13 tokens: the query at 13 sees 8..13
        [0, 1, 1, 2]
        """
        if self.window is None:
            return 0
        return max(0, length - self.window + 1) // self.block_size

    def slide(self, seq_id) -> int:
        """Release the blocks of a sequence that slid out of its next query's window (the
        module's docstring) -> how many. Called once the tokens it holds are the ones it
        keeps (the scheduler's commit): a later trim would need them back otherwise.

        >>> books = BlockManager(8, 4, window=6)
        >>> _ = books.add("a", list(range(1, 14))), books.append(["a"], 13)  # in blocks 0..3
        >>> books.slide("a"), books.seqs["a"].blocks, books.num_free      # 0, 1: read no more
        (2, [-1, -1, 2, 3], 6)
        """
        seq = self.seqs[seq_id]
        gone = self.gone(seq.length)
        for i in range(seq.slid, gone):
            self._release(seq.blocks[i])
            seq.blocks[i] = SLID
        released, seq.slid = max(0, gone - seq.slid), max(seq.slid, gone)
        self.slid_out += released
        return released

    # --- preemption by swapping --------------------------------------------------------------
    def swap_out(self, seq_id) -> Swapped:
        """Free a sequence's blocks, its keys and values to be copied to host memory first
        (a SwapOut move) -> its record, to bring it back with ``swap_in``."""
        seq = self.seqs[seq_id]
        swapped = Swapped(seq.length, seq.max_len, len(seq.held), slid=seq.slid)
        self.moves.append(SwapOut(tuple(seq.held), swapped))
        self.free_seq(seq_id)
        return swapped

    def swap_in_cost(self, swapped: Swapped, then: int = 0) -> int:
        """Free blocks ``swap_in(swapped)`` would take, and ``then`` more tokens after it."""
        return max(swapped.blocks, self.blocks_for(swapped.length + then) - swapped.slid)

    def swap_in(self, seq_id, swapped: Swapped) -> None:
        """Bring a swapped-out sequence back, bit for bit, into fresh private blocks."""
        if swapped.blocks > self.num_free:
            raise PoolExhausted(f"{swapped.blocks} blocks needed, {self.num_free} free")
        blocks = [self._take() for _ in range(swapped.blocks)]
        self.moves.append(SwapIn(tuple(blocks), swapped))
        self.seqs[seq_id] = SeqBlocks([SLID] * swapped.slid + blocks, swapped.length,
                                      swapped.max_len, slid=swapped.slid)  # unnamed:
        # seal names its blocks again (the copies are private; the index may keep originals)

    # --- the books, checked ------------------------------------------------------------------
    def check(self) -> None:
        """The books, checked (tests and the engine fuzz call it after every step); a
        RuntimeError names the first broken rule:
        every block's refcount is the number of block tables holding it; every unheld block
        is on the free list or kept by the index, once; a free-listed block has no name; the
        index's two maps are inverse; a sequence's named blocks carry its own prefix's names;
        its table's holes are its first ``slid`` entries, none still in its next query's window.
        """
        holders = np.zeros(self.num_blocks, dtype=np.int64)
        for seq in self.seqs.values():
            np.add.at(holders, seq.held, 1)
        index = self.index
        rules = [   # its holes first: a hole held would count as block -1
            (all(seq.blocks[:seq.slid] == [SLID] * seq.slid and SLID not in seq.held
                 for seq in self.seqs.values()),
             "a block table's holes are not exactly its first entries"),
            ((self.refcount == holders).all(), "a refcount differs from its block tables"),
            (sorted(self.free + list(index.unheld)) == np.flatnonzero(holders == 0).tolist(),
             "the free list and the kept blocks are not exactly the unheld blocks"),
            (not any(block in index.name_of for block in self.free),
             "a block on the free list still has a name"),
            (len(index.block_of) == len(index.name_of) and
             all(index.name_of.get(block) == name for name, block in index.block_of.items()),
             "the index's maps are not inverse"),
            (all(index.name_of.get(block, name) == name for seq in self.seqs.values()
                 for name, block in zip(seq.names, seq.blocks, strict=False)),  # full ones named
             "a sequence holds a block named for another prefix"),
            (all(len(seq.names) <= seq.length // self.block_size for seq in self.seqs.values()),
             "a sequence names a block it has not filled"),
            (all(seq.slid <= self.gone(seq.length) for seq in self.seqs.values()),
             "a sequence released a block its next query's window still reads")]
        for holds, broken in rules:
            if not holds:
                raise RuntimeError(f"paged cache books: {broken}")

    def stats(self, bytes_per_token: int = 0) -> PagedStats:
        filled: dict[int, int] = {}  # physical block -> slots filled (a shared one counted once)
        for seq in self.seqs.values():
            for i, block in enumerate(seq.held, seq.slid):
                used = min(self.block_size, max(seq.length - i * self.block_size, 0))
                filled[block] = max(filled.get(block, 0), used)
        return PagedStats(self.block_size, bytes_per_token, self.num_blocks,
                          int((self.refcount > 0).sum()), int((self.refcount > 1).sum()),
                          len(self.seqs), sum(filled.values()),
                          sum(s.length for s in self.seqs.values()),
                          sum(s.max_len for s in self.seqs.values()),
                          len(self.index.unheld))
