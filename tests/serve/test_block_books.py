"""The block manager's books field by field: every figure of stats on states worked out by
hand, each rule of check broken alone and named by its whole message, a fork and a swap that
keep a sequence's books whole, and no block left readied for a write once its holders are gone
or its write is done. Each test kills mutants of serve/blocks.py that the other block tests let
through (scripts/mutation.py blocks)."""
import pytest

from minitransformer.serve.blocks import BlockManager, PoolExhausted

PROMPT = [3, 1, 4, 1, 5, 9]                             # a full block of 4 and half of one


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
    for rule, how in rules.items():
        assert broken(sealed(), how) == f"paged cache books: {rule}"
    assert books.index.block_of[name] == named


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
