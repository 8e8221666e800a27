"""The block manager and the prefix index as a state machine (Hypothesis): random sequences of
add (a prefix lookup, then the prompt with or without reuse), fork, write, seal, trim, release
and swap on a small pool, every block written with stamps (tests/stamps.py: a slot's contents
say which prefix it holds).
After every rule the books are checked here, not by the cache's own ``check``:

  - every sequence reads back exactly its own tokens' stamps (no write reached another's
    block: copy on write), and holds exactly the blocks its length needs;
  - a refcount is the number of block tables holding the block; the free list and the kept
    blocks are, together and without overlap, exactly the blocks nobody holds; free blocks
    have no name, kept ones have one;
  - names are unique both ways, and a named block holds the full prefix it was named for and
    is never written while named;
  - a kept block leaves the kept ones only when revived by a hit or evicted, and evicted are
    the least recently released, only once the free list is empty; releases join in order;
  - a lookup finds exactly the longest leading run of full blocks whose whole
    prefix some named block holds, and only blocks holding the prompt's own prefix;
  - a PoolExhausted changes nothing.

Deterministic (derandomize, no example database) and a few seconds long; failing, Hypothesis
shrinks to a short sequence of rules and prints it.
"""
import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from minitransformer.backend import to_numpy
from minitransformer.serve.blocks import PoolExhausted, blocks_for
from stamps import Stamps, block_stamps, expected, holders, pool, read, write

TOKENS = st.lists(st.integers(0, 2), max_size=6)       # few ids: prompts share prefixes
PICK = st.integers(0, 63)                               # which sequence (modulo how many)
DROP = st.integers(0, 4)                                # tokens cut off a text seen before


class BlockBooks(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(2, 10), block_size=st.sampled_from([1, 2, 3, 4]))
    def start(self, num_blocks, block_size):
        self.cache, self.stamps = pool(num_blocks, block_size), Stamps()
        self.tokens = {}            # seq id -> the tokens it holds (written)
        self.swapped = {}           # seq id -> (Swapped, its tokens)
        self.texts = [[]]           # every token list seen: sources of shared prefixes
        self.named = {}             # block -> (its name, its stamps) while it keeps that name
        self.next_id = 0

    # --- helpers -----------------------------------------------------------------------------
    def pick(self, i):
        return sorted(self.tokens)[i % len(self.tokens)]

    def prompt(self, source, drop, extra):
        """A text seen before (a prompt, a sequence grown), less its last tokens, + extra."""
        text = self.texts[source % len(self.texts)]
        return text[:max(len(text) - drop, 0)] + extra

    def new_id(self):
        self.next_id += 1
        return self.next_id

    def snapshot(self):
        c = self.cache.books
        return (list(c.free), list(c.index.unheld), c.refcount.tolist(),
                {s: (list(q.blocks), q.length) for s, q in c.seqs.items()},
                dict(c.index.name_of), [to_numpy(a).copy() for a in self.cache.k])

    def assert_unchanged(self, before):
        after = self.snapshot()
        assert before[:5] == after[:5], "a refused operation changed the books"
        assert all(np.array_equal(a, b) for a, b in zip(before[5], after[5], strict=True))

    def named_prefixes(self) -> set:
        """The prefix each named block holds, read from its stamps."""
        bs, held = self.cache.books.block_size, set()
        for block in self.cache.books.index.name_of:
            slots = block_stamps(self.cache, block)
            assert slots.all(), f"named block {block} is not full"
            prefix = self.stamps.prefix_of[int(slots[-1])]
            assert len(prefix) % bs == 0 and slots.tolist() == expected(self.stamps,
                                                                        prefix)[-bs:]
            held.add(prefix)
        return held

    def expected_hits(self, prompt) -> int:
        """Leading full blocks of prompt whose whole prefix a named block holds."""
        bs, held, hits = self.cache.books.block_size, self.named_prefixes(), 0
        while (hits + 1) * bs <= len(prompt) and tuple(prompt[:(hits + 1) * bs]) in held:
            hits += 1
        return hits

    def check_kept_order(self, before, revived=(), moved=(), released=None):
        """The kept blocks after a rule: the ones kept before, less those revived and moved,
        the oldest evicted (only once the free list is empty), then the released ones in
        the order given (``released``: None when any order is right), then ``moved``."""
        old_names, unheld = before[4], list(self.cache.books.index.unheld)
        rest = [b for b in before[1] if b not in revived and b not in moved]
        evicted = [b for b in rest if b not in unheld]
        assert rest[:len(evicted)] == evicted, f"evicted {evicted}, oldest first was {rest}"
        for b in evicted:
            assert self.cache.books.index.name_of.get(b) != old_names[b], \
                f"{b} evicted, still named"
        if evicted:
            assert not self.cache.books.free, "a kept block evicted while the free list had one"
        kept = rest[len(evicted):]
        assert unheld[:len(kept)] == kept, f"kept blocks reordered: {unheld} after {kept}"
        tail = unheld[len(kept):]
        if released is not None:
            assert tail == list(released) + list(moved), f"released in order {tail}"
        else:
            assert tail[len(tail) - len(moved):] == list(moved)

    def released_order(self, blocks, before):
        """Of blocks released in this order, those left unheld and named: kept, in order."""
        refcount = before[2]
        gone = {}
        for b in blocks:
            gone[b] = gone.get(b, 0) + 1
        return [b for b in blocks if refcount[b] == gone[b] and b in before[4]]

    # --- rules -------------------------------------------------------------------------------
    @rule(source=PICK, drop=DROP, extra=TOKENS, reuse=st.booleans())
    def add(self, source, drop, extra, reuse):
        prompt = self.prompt(source, drop, extra)
        if not prompt:
            return
        s, cache, before = self.new_id(), self.cache, self.snapshot()
        hits = self.expected_hits(prompt)                  # a lookup, whether reused or not
        found, bs = cache.books.cached_prefix(prompt)[1], cache.books.block_size
        assert len(found) == hits
        for j, block in enumerate(found):
            assert block_stamps(cache, block).tolist() == \
                expected(self.stamps, prompt)[j * bs:(j + 1) * bs], "a hit on another prefix"
        self.assert_unchanged(before)                      # a lookup changes nothing
        if not reuse:
            hits, found = 0, []
        try:
            held = cache.books.add(s, prompt, reuse=reuse)
        except PoolExhausted:
            self.assert_unchanged(before)
            return
        assert held == min(hits * cache.books.block_size, len(prompt) - 1)
        cache.do(cache.books.take_moves())                 # the copy of a block held in full
        assert read(cache, s) == expected(self.stamps, prompt)[:held]
        copied = held < len(found) * cache.books.block_size
        moved = [found[-1]] if copied and before[2][found[-1]] == 0 else []
        self.check_kept_order(before, revived=found, moved=moved, released=[])
        write(cache, self.stamps, {s: prompt}, len(prompt) - held)   # the prefill: no new block
        self.tokens[s] = list(prompt)
        self.texts.append(list(prompt))
        cache.books.seal(s, prompt)

    @precondition(lambda self: self.tokens)
    @rule(i=PICK, token=st.none() | st.integers(0, 2))
    def fork(self, i, token):
        """A fork takes no block; with a token, it writes it at once (a parallel sample's
        first decode: into the shared last block, when that one is partly filled)."""
        s, child, before = self.pick(i), self.new_id(), self.snapshot()
        self.cache.books.fork(s, child)
        self.tokens[child] = list(self.tokens[s])
        assert self.cache.books.num_free == len(before[0]) + len(before[1])
        self.check_kept_order(before, released=[])
        if token is not None:
            self.extend([child], 1, [token], seal=True)

    @precondition(lambda self: self.tokens)
    @rule(picks=st.lists(PICK, min_size=1, max_size=3), T=st.integers(1, 3),
          new=st.lists(st.integers(0, 2), min_size=3, max_size=3), seal=st.booleans())
    def grow(self, picks, T, new, seal):
        self.extend(sorted({self.pick(i) for i in picks}), T, new[:T], seal)

    def extend(self, ids, T, new, seal):
        """Append the same T new tokens to each sequence of ids, in one write."""
        before = self.snapshot()
        extended = {s: self.tokens[s] + new for s in ids}
        try:
            write(self.cache, self.stamps, extended, T)
        except PoolExhausted:
            self.assert_unchanged(before)
            return
        self.check_kept_order(before)
        for s in ids:
            self.tokens[s] = extended[s]
            self.texts.append(extended[s])
            if seal:
                self.cache.books.seal(s, extended[s])

    @precondition(lambda self: self.tokens)
    @rule(i=PICK, n=st.integers(0, 6))
    def trim(self, i, n):
        s, before = self.pick(i), self.snapshot()
        n = min(n, len(self.tokens[s]))
        tail = before[3][s][0][blocks_for(len(self.tokens[s]) - n, self.cache.books.block_size):]
        self.cache.books.trim(s, n)
        self.tokens[s] = self.tokens[s][:len(self.tokens[s]) - n]
        self.check_kept_order(before, released=self.released_order(tail[::-1], before))

    @precondition(lambda self: self.tokens)
    @rule(i=PICK)
    def release(self, i):
        s, before = self.pick(i), self.snapshot()
        self.cache.books.free_seq(s)
        del self.tokens[s]
        self.check_kept_order(before, released=self.released_order(before[3][s][0], before))

    @precondition(lambda self: self.tokens)
    @rule(i=PICK)
    def swap_out(self, i):
        s, before = self.pick(i), self.snapshot()
        self.swapped[s] = (self.cache.books.swap_out(s), self.tokens.pop(s))
        self.cache.do(self.cache.books.take_moves())    # the pool copies it out now
        self.check_kept_order(before, released=self.released_order(before[3][s][0], before))

    @precondition(lambda self: self.swapped)
    @rule(i=PICK)
    def swap_in(self, i):
        s = sorted(self.swapped)[i % len(self.swapped)]
        before = self.snapshot()
        try:
            self.cache.books.swap_in(s, self.swapped[s][0])
        except PoolExhausted:
            self.assert_unchanged(before)
            return
        self.cache.do(self.cache.books.take_moves())
        self.tokens[s] = self.swapped.pop(s)[1]
        self.check_kept_order(before, released=[])

    # --- the books, after every rule -------------------------------------------------------
    @invariant()
    def each_sequence_holds_its_own_tokens(self):
        if not hasattr(self, "cache"):
            return
        cache = self.cache
        assert set(cache.books.seqs) == set(self.tokens)
        for s, tokens in self.tokens.items():
            assert cache.books.seqs[s].length == len(tokens)
            assert len(cache.books.seqs[s].blocks) == blocks_for(len(tokens),
                                                                cache.books.block_size)
            assert read(cache, s) == expected(self.stamps, tokens)

    @invariant()
    def refcounts_and_free_blocks_add_up(self):
        if not hasattr(self, "cache"):
            return
        cache, index = self.cache, self.cache.books.index
        held = holders(cache)
        assert (cache.books.refcount == held).all()
        free, kept = list(cache.books.free), list(index.unheld)
        assert len(set(free)) == len(free) and not set(free) & set(kept)
        assert sorted(free + kept) == np.flatnonzero(held == 0).tolist()
        assert cache.books.num_free == len(free) + len(kept)
        assert not any(b in index.name_of for b in free) and all(b in index.name_of
                                                                 for b in kept)

    @invariant()
    def names_are_unique_and_named_blocks_unwritten(self):
        if not hasattr(self, "cache"):
            return
        index = self.cache.books.index
        assert len(index.block_of) == len(index.name_of)
        assert all(index.name_of[b] == name for name, b in index.block_of.items())
        self.named_prefixes()
        for b in list(self.named):
            if index.name_of.get(b) != self.named[b][0]:
                del self.named[b]           # evicted: its name forgotten, free to write
        for b, name in index.name_of.items():
            slots = block_stamps(self.cache, b)
            if b in self.named:
                assert np.array_equal(slots, self.named[b][1]), f"named block {b} written"
            else:
                self.named[b] = (name, slots.copy())


TestBlockBooks = BlockBooks.TestCase
TestBlockBooks.settings = settings(max_examples=100, stateful_step_count=30, derandomize=True,
                                   database=None, deadline=None,
                                   suppress_health_check=[HealthCheck.too_slow])
