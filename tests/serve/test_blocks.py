"""The block manager's promises (serve/blocks.py: the books, host integers, no array), in one
place: what it holds and counts (stats worked out by hand, every block back in the pool, a
shared prefix holding fewer blocks, waste under a block per sequence), what it refuses and
leaves unchanged (an exhausted pool, a taken id, a smaller pool than one block), its check
naming each broken rule, forks and swaps keeping a sequence's books, copies and swaps queued as
moves for the pool, a readied block written once and then never, and the prefix index's names
and kept blocks (found again, evicted least recently released first, counted when revived).
Random operations on the books: here, and as a state machine (BlockBooks, below); on stamped
blocks, the prefix cache's defining properties in test_prefix_cache.py; the pool doing the
moves, in test_paged.py."""
import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from minitransformer.backend import to_numpy
from minitransformer.serve.blocks import (
    SLID,
    BlockManager,
    Copy,
    PoolExhausted,
    SwapIn,
    SwapOut,
    blocks_for,
)
from minitransformer.serve.paged import PagedCache
from stamps import Stamps, block_stamps, expected, holders, pool, read, write
from test_paged import check_invariants, prefill

PROMPT = [3, 1, 4, 1, 5, 9]                             # a full block of 4 and half of one

TWO_BLOCKS = [3, 1, 4, 1, 5, 9, 2, 6]                       # two full blocks of 4


def sealed(max_len=10):
    """A sequence "a" of PROMPT written and sealed: block 0 full and named, block 1 half."""
    books = BlockManager(num_blocks=6, block_size=4)
    books.add("a", PROMPT, max_len)
    books.written(["a"], books.append(["a"], len(PROMPT)), len(PROMPT))
    books.seal("a", PROMPT)
    return books


def figures(books):
    s = books.stats()
    return (s.block_size, s.bytes_per_token, s.blocks_total, s.blocks_held, s.blocks_shared,
            s.sequences, s.slots_filled, s.tokens_logical, s.tokens_reserved, s.blocks_cached)


def test_stats_by_hand():
    books = BlockManager(num_blocks=6, block_size=4)
    books.add("c", [7, 7, 7, 7, 7], max_len=9)     # 2 blocks readied, nothing written yet
    assert figures(books) == (4, 0, 6, 2, 0, 1, 0, 0, 9, 0)
    books.free_seq("c")
    books = sealed()
    books.fork("a", "b")                            # both blocks shared, 6 tokens each
    assert figures(books) == (4, 0, 6, 2, 2, 2, 6, 12, 20, 0)
    books.trim("b", 3)                              # b: 3 tokens in block 0, which a fills
    assert figures(books) == (4, 0, 6, 2, 1, 2, 6, 9, 20, 0)
    books.free_seq("a")
    books.free_seq("b")                             # block 0 named: kept, counted cached
    assert figures(books) == (4, 0, 6, 0, 0, 0, 0, 0, 0, 1)


def broken(books, how):
    how(books)
    with pytest.raises(RuntimeError) as caught:
        books.check()
    return str(caught.value)


def test_check_names_each_broken_rule_alone():
    books = sealed()
    books.check()
    named = books.seqs["a"].blocks[0]
    name = books.index.name_of[named]
    rules = {
        "a refcount differs from its block tables":
            lambda b: b.refcount.__setitem__(named, 2),
        "the free list and the kept blocks are not exactly the unheld blocks":
            lambda b: b.free.append(b.free[-1]),
        "a block on the free list still has a name":
            lambda b: (b.index.name_of.__setitem__(b.free[-1], b"n"),
                       b.index.block_of.__setitem__(b"n", b.free[-1])),
        "the index's maps are not inverse":             # as many entries, one pointing wrong
            lambda b: b.index.name_of.__setitem__(named, b"other"),
        "a sequence holds a block named for another prefix":
            lambda b: b.seqs["a"].names.__setitem__(0, b"other"),
        "a sequence names a block it has not filled":
            lambda b: b.seqs["a"].names.append(b"half"),
    }
    for message, how in rules.items():
        assert broken(sealed(), how) == f"paged cache books: {message}"
    assert books.index.block_of[name] == named


WINDOWED = list(range(1, 14))      # 13 tokens: the query at 13 sees 8..13, in blocks 2 and 3


def slid():
    """A sequence "a" of WINDOWED written and sealed in books of a window of 6, then slid: its
    blocks 0 and 1 (positions 0..7) released, named, so kept by the prefix cache."""
    books = BlockManager(num_blocks=8, block_size=4, window=6)
    books.add("a", WINDOWED)
    books.written(["a"], books.append(["a"], 13), 13)
    books.seal("a", WINDOWED)
    assert books.slide("a") == 2 and books.slide("a") == 0           # once
    return books


def test_blocks_that_slid_out_of_the_window_leave_holes_the_books_keep():
    """Released as a finished sequence's are (named: kept, found again by a later prompt),
    the table's entries SLID, counted in slid_out; a fork holds only the blocks held; a swap
    copies only those and brings the holes back; a trim whose next query would read a
    released block is refused, changing nothing; every rule of check holds."""
    books = slid()
    seq = books.seqs["a"]
    assert (seq.blocks, seq.slid, seq.held, books.slid_out) == ([SLID, SLID, 2, 3], 2, [2, 3], 2)
    stats = books.stats()
    assert (stats.blocks_held, stats.blocks_cached, stats.slots_filled, books.num_free) == \
        (2, 2, 5, 6)
    books.check()
    with pytest.raises(ValueError, match="reach back into blocks released"):
        books.trim("a", 1)                      # the query at 12 would see 7..12: block 1
    assert seq.length == 13
    books.fork("a", "b")
    assert books.seqs["b"].blocks == seq.blocks and books.refcount[[2, 3]].tolist() == [2, 2]
    books.free_seq("b")
    out = books.swap_out("a")
    assert (out.blocks, out.slid) == (2, 2) and books.take_moves()[0].blocks == (2, 3)
    assert books.swap_in_cost(out, then=4) == 3           # positions 8..16: blocks 2, 3, 4
    books.swap_in("a", out)
    books.seal("a", WINDOWED)                              # names again, offers no hole
    assert books.seqs["a"].blocks[:2] == [SLID, SLID] and SLID not in books.index.name_of
    books.check()
    assert books.add("c", WINDOWED[:9]) == 8              # the kept blocks found by name
    books.check()


def test_a_full_layer_releases_nothing_and_check_names_a_hole_out_of_place():
    books = BlockManager(num_blocks=8, block_size=4)     # window None: a layer attends fully
    books.add("a", WINDOWED)
    books.append(["a"], 13)
    assert books.slide("a") == 0 and books.window_blocks is None
    rules = {
        "a block table's holes are not exactly its first entries":
            lambda b: setattr(b.seqs["a"], "slid", 1),
        "a sequence released a block its next query's window still reads":
            lambda b: setattr(b.seqs["a"], "length", 12),    # the query at 12 sees 7..12
    }
    for message, how in rules.items():
        assert broken(slid(), how) == f"paged cache books: {message}"


def test_a_fork_is_its_parents_books_and_a_taken_id_is_refused():
    books = sealed(max_len=10)
    books.fork("a", "b")
    assert books.seqs["b"] == books.seqs["a"]       # blocks, length, max_len, names
    assert books.seqs["b"].blocks is not books.seqs["a"].blocks
    with pytest.raises(ValueError) as refused:
        books.fork("a", "b")
    assert str(refused.value) == "sequence 'b' is already in the cache"


def test_append_adds_to_the_length_and_says_where_each_append_starts():
    books = sealed()
    assert books.append(["a"], 1) == [6] and books.append(["a"], 2) == [7]
    assert books.seqs["a"].length == 9


def test_a_swap_keeps_the_sequences_books_and_a_full_pool_is_named():
    books = sealed(max_len=10)
    before = books.seqs["a"].length, books.seqs["a"].max_len, len(books.seqs["a"].blocks)
    swapped = books.swap_out("a")
    books.swap_in("a", swapped)
    seq = books.seqs["a"]
    assert (seq.length, seq.max_len, len(seq.blocks)) == before
    books.add("big", [1] * 13)                      # 4 blocks: none left but 0
    out = books.swap_out("a")
    books.add("more", [2] * 8)
    with pytest.raises(PoolExhausted) as full:
        books.swap_in("a", out)
    assert str(full.value) == "2 blocks needed, 0 free"


def test_no_block_stays_readied_once_written_or_let_go():
    """A written block shared by a fork is not writable in place; and a block readied by a
    plan whose sequence then went (cancelled before its pass) is, once named and held again
    by a prompt that finds it cached, not writable either."""
    books = sealed()
    books.fork("a", "b")
    half = books.seqs["a"].blocks[1]
    assert not books.may_write(half)                # written, then shared: copy on write
    books = BlockManager(num_blocks=6, block_size=4)
    prompt = PROMPT + [2, 6]                         # two full blocks
    books.add("a", prompt)
    books.append(["a"], len(prompt))                 # planned, never written
    books.seal("a", prompt)
    first = books.seqs["a"].blocks[0]
    books.free_seq("a")                              # named: kept by the index
    assert books.add("b", prompt) == 7 and books.seqs["b"].blocks[0] == first
    assert not books.may_write(first)               # named and cached: never written


def test_the_smallest_pool_and_the_refusals_of_a_smaller_one():
    BlockManager(num_blocks=1, block_size=1).check()
    for blocks, size in ((0, 4), (4, 0)):
        with pytest.raises(ValueError) as refused:
            BlockManager(num_blocks=blocks, block_size=size)
        assert str(refused.value) == ("a paged cache needs num_blocks >= 1 and block_size >= 1, "
                                      f"got {blocks}, {size}")


def test_add_refuses_by_name_and_counts_the_cached_prefix_it_holds():
    """A pool of 3 blocks, 2 of them a sealed 8-token prompt's: the same prompt again fits
    (its first block held, its last copied: 1 block), which counting it uncached would not."""
    books = BlockManager(num_blocks=3, block_size=4)
    prompt = PROMPT + [2, 6]
    books.add("a", prompt)
    books.written(["a"], books.append(["a"], 8), 8)
    books.seal("a", prompt)
    assert books.add_cost(prompt) == 1 and books.add_cost(prompt, then=1) == 1
    assert books.add_cost([9] * 6, then=3) == 3      # 9 tokens in all, nothing cached
    assert books.add("b", prompt) == 7
    assert books.seqs["b"].names == books.seqs["a"].names[:1]   # the block it holds, named
    with pytest.raises(ValueError) as refused:
        books.add("b", prompt)
    assert str(refused.value) == "sequence 'b' is already in the cache"
    with pytest.raises(ValueError) as refused:
        books.add("c", [])
    assert str(refused.value) == "a sequence needs a prompt of at least one token"
    with pytest.raises(PoolExhausted) as full:
        books.add("c", [5] * 13)
    assert str(full.value) == "a prompt of 13 tokens needs 4 blocks, 0 free"


def test_a_swapped_sequences_cost_counts_the_tokens_to_come():
    books = BlockManager(num_blocks=6, block_size=4)
    books.add("a", PROMPT + [2, 6])
    books.append(["a"], 8)                          # two full blocks
    swapped = books.swap_out("a")
    assert books.swap_in_cost(swapped) == 2
    assert books.swap_in_cost(swapped, then=1) == 3 and books.swap_in_cost(swapped, 4) == 3


def test_a_blocks_name_is_its_tokens_whatever_holds_them():
    import numpy as np

    from minitransformer.serve.blocks import block_names
    names = block_names(PROMPT + [2, 6], 4)
    assert block_names(np.array(PROMPT + [2, 6], np.int32), 4) == names
    assert block_names(np.array(PROMPT + [2, 6], np.int16), 4) == names


def test_the_books_queue_copies_and_swaps_and_hold_no_array():
    books = BlockManager(num_blocks=6, block_size=4)
    books.add("a", TWO_BLOCKS)
    books.append(["a"], len(TWO_BLOCKS))
    books.seal("a", TWO_BLOCKS)
    assert books.take_moves() == []
    assert books.add("b", TWO_BLOCKS) == 7                  # held in full: the last block copied
    a, b = books.seqs["a"].blocks, books.seqs["b"].blocks
    assert books.take_moves() == [Copy(a[1], b[1])] and a[0] == b[0]
    swapped = books.swap_out("a")
    books.swap_in("a", swapped)
    out, back = books.take_moves()
    assert isinstance(out, SwapOut) and out.blocks == tuple(a) and out.into is swapped
    assert isinstance(back, SwapIn) and back.source is swapped and swapped.k is None
    assert not any(isinstance(value, (list, np.ndarray)) and len(value) and
                   isinstance(value[0], np.ndarray) for value in vars(books).values())


def test_a_readied_block_is_written_once_even_when_shared_then_never():
    """A plan counts a's prompt at once and names its full block; b, admitted in the same
    plan, holds it. a's own write into it is the one allowed; after it, none is."""
    from stamps import pool
    cache = pool(num_blocks=6, block_size=4)
    cache.books.add("a", TWO_BLOCKS[:5])
    starts = cache.books.append(["a"], 5)
    cache.books.seal("a", TWO_BLOCKS[:5])
    assert cache.books.add("b", TWO_BLOCKS[:4] + [0]) == 4        # b holds a's first block
    view = cache.view(["a"], starts)
    positions = view.positions(5)
    view.slots(positions)                               # a may write: room was made for it
    view.advance(5)
    cache.books.written(["a"], starts, 5)               # as the scheduler's commit does
    again = cache.view(["a"], [0])
    with pytest.raises(RuntimeError, match="shared or named"):
        again.slots(again.positions(4))


def test_every_block_returns_to_the_pool(tiny_model):
    cache = PagedCache.allocate(tiny_model.config, 20, 4)
    for i, n in enumerate([1, 4, 5, 13]):
        prefill(tiny_model, cache, i, list(range(n)))
    check_invariants(cache)
    for i in range(4):
        cache.books.free_seq(i)
    assert cache.books.num_free == 20 and not cache.books.refcount.any()
    # kept: the full blocks, [0..3] (computed once, held by three) and 13 tokens' next two
    assert list(cache.books.index.unheld) == list(cache.books.index.name_of) == [1, 3, 4]
    check_invariants(cache)


@pytest.mark.parametrize("common", [0, 3, 4, 9, 12])
def test_shared_prefix_holds_fewer_blocks_by_the_expected_count(tiny_model, common):
    bs = 4
    a = list(range(1, 1 + common)) + [50] * 7
    b = list(range(1, 1 + common)) + [60] * 6
    held = {}
    for share in (True, False):
        cache = PagedCache.allocate(tiny_model.config, 30, bs)
        prefill(tiny_model, cache, "a", a, seal=share)
        got = prefill(tiny_model, cache, "b", b)
        assert got == (common // bs * bs if share else 0)
        held[share] = cache.stats().blocks_held
        assert cache.stats().blocks_shared == (common // bs if share else 0)
        check_invariants(cache)
    assert held[False] - held[True] == common // bs


def test_exhaustion_raises_and_changes_nothing(tiny_model):
    cache = PagedCache.allocate(tiny_model.config, 3, 4)
    prefill(tiny_model, cache, "a", list(range(8)))        # two blocks
    books = cache.books
    state = (list(books.free), books.refcount.copy(), list(books.seqs["a"].blocks))
    with pytest.raises(PoolExhausted, match="2 blocks"):
        cache.books.add("b", list(range(20, 28)))
    cache.books.seqs["a"].length = 8
    with pytest.raises(PoolExhausted):
        cache.books.make_room(["a"], 9)                          # needs 3 more, 1 free
    assert "b" not in cache.books.seqs
    assert (list(books.free), books.refcount.tolist(), books.seqs["a"].blocks) == \
        (state[0], state[1].tolist(), state[2])
    cache.books.make_room(["a"], 4)                              # exactly the last free block
    assert cache.books.num_free == 0


def test_kept_blocks_are_found_again_and_evicted_least_recently_released_first(tiny_model):
    cache = PagedCache.allocate(tiny_model.config, 6, 2)
    for i, first in enumerate((10, 20, 30)):               # 3 prompts of one full block + 1
        prefill(tiny_model, cache, i, [first, first + 1, first + 2])
    saved = to_numpy(cache.k[0][cache.books.seqs[1].blocks[0]]).copy()
    for i in (1, 0, 2):                                    # released in this order
        cache.books.free_seq(i)
    assert list(cache.books.index.unheld) == [2, 0, 4] and cache.books.num_free == 6
    assert prefill(tiny_model, cache, "again", [20, 21, 90]) == 2    # 1's block, revived
    assert cache.books.seqs["again"].blocks[0] == 2 and 2 not in cache.books.index.unheld
    assert np.array_equal(to_numpy(cache.k[0][2]), saved)  # the very keys, not recomputed
    assert cache.books.index.evicted == 0                        # the free list is used first
    prefill(tiny_model, cache, "big", list(range(40, 47)))  # 4 blocks: 2 free + 2 evicted
    assert cache.books.index.evicted == 2 and list(cache.books.index.unheld) == []
    assert cache.books.cached_prefix([10, 11, 12])[1] == []      # the oldest kept ones went
    check_invariants(cache)


def test_add_counts_the_kept_blocks_it_revives_and_overcommits_nothing(tiny_model):
    cache = PagedCache.allocate(tiny_model.config, 4, 2)
    prefill(tiny_model, cache, "a", [1, 2, 3, 4, 5, 6, 7, 8])   # 4 full blocks, all named
    cache.books.free_seq("a")
    assert cache.books.num_free == 4 and len(cache.books.index.unheld) == 4
    # 3 cached blocks held again + 1 copy of the third (written at the last token) = 4; the
    # copy evicts [7, 8], and the third goes back to the kept ones: 1 free after all
    assert cache.books.add_cost([1, 2, 3, 4, 5, 6]) == 4
    assert cache.books.add("b", [1, 2, 3, 4, 5, 6]) == 5 and cache.books.num_free == 1
    assert cache.books.index.evicted == 1 and cache.books.cached_prefix([7, 8, 9])[1] == []
    with pytest.raises(PoolExhausted, match="needs 2 blocks, 1 free"):
        cache.books.add("c", [7, 8, 9])
    check_invariants(cache)


def test_check_names_a_broken_rule(tiny_model):
    cache = PagedCache.allocate(tiny_model.config, 6, 2)
    prefill(tiny_model, cache, "a", [1, 2, 3])
    cache.books.check()
    cache.books.refcount[0] += 1
    with pytest.raises(RuntimeError, match="refcount differs"):
        cache.books.check()
    cache.books.refcount[0] -= 1
    cache.books.free.append(cache.books.seqs["a"].blocks[0])
    with pytest.raises(RuntimeError, match="not exactly the unheld blocks"):
        cache.books.check()


def test_waste_is_under_one_block_per_sequence_and_reservation_is_the_max(tiny_model):
    cache = PagedCache.allocate(tiny_model.config, 50, 8)
    lengths = [1, 7, 8, 9, 30]
    for i, n in enumerate(lengths):
        cache.books.add(i, list(range(100, 100 + n)), max_len=64)
        cache.books.seqs[i].length = n                           # as if prefilled
    s = cache.stats()
    assert s.slots_filled == s.tokens_logical == sum(lengths)
    assert s.slots_wasted == sum(-n % 8 for n in lengths) < 8 * len(lengths)
    assert s.tokens_reserved == 64 * len(lengths)
    assert s.bytes_per_token == 2 * tiny_model.config.num_hidden_layers * \
        tiny_model.config.num_key_value_heads * tiny_model.config.head_dim * 4


def test_random_operations_keep_the_books(tiny_model):
    """Random adds (with shared prefixes), growth, swaps and frees: the invariants hold and
    the pool is whole at the end."""
    rng = np.random.default_rng(0)
    cache = PagedCache.allocate(tiny_model.config, 24, 3)
    stem = list(range(1, 10))
    live, swapped = [], {}
    for step in range(300):
        op = rng.integers(4)
        if op == 0:
            prompt = stem[:rng.integers(0, 10)] + rng.integers(20, 40, rng.integers(1, 6)).tolist()
            try:
                cache.books.add(step, prompt)
                cache.books.seqs[step].length = len(prompt)      # as if prefilled
                cache.books.seal(step, prompt)
                live.append(step)
            except PoolExhausted:
                pass
        elif op == 1 and live:
            s = live[rng.integers(len(live))]
            try:
                cache.books.make_room([s], 1)
                cache.books.seqs[s].length += 1
            except PoolExhausted:
                pass
        elif op == 2 and live:
            s = live.pop(rng.integers(len(live)))
            swapped[s] = cache.books.swap_out(s)
        elif op == 3 and (live or swapped):
            if swapped and rng.integers(2):
                s, handle = swapped.popitem()
                try:
                    cache.books.swap_in(s, handle)
                    live.append(s)
                except PoolExhausted:
                    pass
            elif live:
                cache.books.free_seq(live.pop(rng.integers(len(live))))
        check_invariants(cache)
    for s in live:
        cache.books.free_seq(s)
    assert cache.books.num_free == 24 and not cache.books.refcount.any()
    assert set(cache.books.index.unheld) == set(cache.books.index.name_of)


# ---- the books as a state machine ----------------------------------------------------------------
TOKENS = st.lists(st.integers(0, 2), max_size=6)       # few ids: prompts share prefixes
PICK = st.integers(0, 63)                               # which sequence (modulo how many)
DROP = st.integers(0, 4)                                # tokens cut off a text seen before


class BlockBooks(RuleBasedStateMachine):
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
    shrinks to a short sequence of rules and prints it."""

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
