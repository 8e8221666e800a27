"""The prefix cache's defining properties, one test each, on stamped blocks (tests/stamps.py: a
block's contents say which prefix it holds, exactly): a name stands for the whole prefix (its
parent's name and every token of its own), eviction takes kept blocks least recently released
first and only once the free list is empty, a named or shared block is never written (copy on
write), and a block's refcount is the number of block tables holding it."""
import pytest

from minitransformer.serve.blocks import ROOT, block_names
from minitransformer.serve.config import EngineConfig
from minitransformer.serve.engine import Engine
from minitransformer.serve.records import Request
from stamps import Stamps, block_stamps, expected, holders, pool, read, write


def prefilled(cache, stamps, seq_id, prompt, seal=True) -> int:
    """add a prompt, write the tokens not found cached, name its full blocks -> tokens found."""
    held = cache.books.add(seq_id, prompt)
    write(cache, stamps, {seq_id: prompt}, len(prompt) - held)
    if seal:
        cache.books.seal(seq_id, prompt)
    return held


def found_prefix(cache, stamps, prompt) -> int:
    """Prompt tokens whose blocks the index finds; each found block holds the prompt's own
    prefix (checked by its stamps)."""
    _, found, _ = cache.books.cached_prefix(prompt)
    bs = cache.books.block_size
    for i, block in enumerate(found):
        assert block_stamps(cache, block).tolist() == \
            expected(stamps, prompt)[i * bs:(i + 1) * bs], f"block {i} holds another prefix"
    return len(found) * bs


# --- names ---------------------------------------------------------------------------------
def test_a_name_chains_its_parents_name_and_every_token_of_its_block():
    X, Y = [1, 2, 3, 4], [5, 6, 7, 8]
    xy, zy = block_names(X + Y, 4), block_names([9, 2, 3, 4] + Y, 4)
    assert xy[1] != zy[1]                      # same tokens, another parent: another name
    assert block_names(Y, 4)[0] != xy[1]       # the same block first: another name
    assert block_names(Y, 4, parent=xy[0]) == xy[1:]
    for i in range(4):                         # every token of the block counts
        changed = Y.copy()
        changed[i] += 1
        assert block_names(X + changed, 4)[1] != xy[1]
    assert block_names(X + Y, 4) == xy and block_names(X, 4, parent=ROOT) == xy[:1]


def test_a_block_is_found_only_after_the_same_whole_prefix():
    """a holds X Y; a prompt starting with Y (a's second block, at the start) finds nothing,
    one with X Y' (Y changed in one token) finds X only, one with X Y all of it."""
    stamps, cache = Stamps(), pool(12, 4)
    X, Y = [1, 2, 3, 4], [5, 6, 7, 8]
    prefilled(cache, stamps, "a", X + Y + [9])
    assert found_prefix(cache, stamps, Y + [9]) == 0
    assert prefilled(cache, stamps, "y", Y + [9]) == 0
    assert found_prefix(cache, stamps, X + [5, 6, 7, 0, 9]) == 4
    assert found_prefix(cache, stamps, X + Y + [0]) == 8
    assert found_prefix(cache, stamps, [0] + X + Y) == 0
    assert read(cache, "y") == expected(stamps, Y + [9])


def test_blocks_named_as_decoding_fills_them_are_found_by_the_whole_text():
    """Named one block at a time (a prompt, then tokens decoded one by one): the names chain
    the sequence's earlier ones, so the next turn finds every full block."""
    stamps, cache = Stamps(), pool(16, 4)
    text = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7]
    prefilled(cache, stamps, "a", text[:5])
    for n in range(6, len(text) + 1):
        write(cache, stamps, {"a": text[:n]}, 1)
        cache.books.seal("a", text[:n])
    cache.books.free_seq("a")
    assert found_prefix(cache, stamps, text + [0]) == 12
    assert prefilled(cache, stamps, "b", text + [0]) == 12
    assert read(cache, "b") == expected(stamps, text + [0])


def test_the_engine_reuses_a_block_only_after_its_own_prefix(tiny_model):
    """Through the engine: after X Y, a prompt starting with Y finds nothing cached (Y's
    block was computed after X), one starting with X Y finds both blocks."""
    engine = Engine(tiny_model, EngineConfig(max_num_seqs=1, block_size=4))
    X, Y = (1, 2, 3, 4), (5, 6, 7, 8)
    run = engine.run([Request(X + Y + (9,), 1, eos_token_id=[]),
                      Request(Y + (9,), 1, eos_token_id=[]),
                      Request(X + Y + (0,), 1, eos_token_id=[])])
    assert [r.cached_tokens for r in run.results] == [0, 0, 8]


# --- keeping and eviction ------------------------------------------------------------------
def test_kept_blocks_go_least_recently_released_first_and_only_when_nothing_is_free():
    """Four prompts of one full block + 1 token fill a pool of 8. Released c, a, d, b, then a
    revived and released again: the kept order is c, d, b, a. A pool with free blocks evicts
    none; past them, one kept block per block taken, the oldest first, the rest still found."""
    stamps, cache = Stamps(), pool(8, 2)
    prompts = {s: [10 * i, 10 * i + 1, 10 * i + 2] for i, s in enumerate("abcd", start=1)}
    for s, prompt in prompts.items():
        prefilled(cache, stamps, s, prompt)
    assert cache.books.num_free == 0
    for s in "cadb":
        cache.books.free_seq(s)
    assert prefilled(cache, stamps, "a2", prompts["a"]) == 2     # revived, 1 free block taken
    cache.books.free_seq("a2")                       # a's block: now the most recently released

    def still_found():
        return [s for s in "abcd" if found_prefix(cache, stamps, prompts[s])]
    prefilled(cache, stamps, "new1", [90] * 7)                   # 4 blocks: the 4 free ones
    assert still_found() == list("abcd") and cache.books.index.evicted == 0
    write(cache, stamps, {"new1": [90] * 9}, 2)                  # a 5th: one kept goes
    assert still_found() == list("abd")
    prefilled(cache, stamps, "new2", [80] * 3)                   # 2 more: the next two
    assert still_found() == ["a"]
    assert cache.books.index.evicted == 3
    assert read(cache, "new1") == expected(stamps, [90] * 9)


# --- never written, copy on write ----------------------------------------------------------
def test_a_named_block_is_never_written_even_by_its_only_holder():
    """Trimmed back into its second (named) block, a writes other tokens there: it writes a
    copy; the named block still holds a's old prefix, and a later prompt finds it."""
    stamps, cache = Stamps(), pool(8, 4)
    old = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    prefilled(cache, stamps, "a", old)
    named = cache.books.seqs["a"].blocks[1]
    assert cache.books.refcount[named] == 1 and named in cache.books.index.name_of
    cache.books.trim("a", 3)                                           # 6 tokens left
    new = old[:6] + [60, 61]
    write(cache, stamps, {"a": new}, 2)                          # slots 6, 7 of block 1
    assert read(cache, "a") == expected(stamps, new)
    assert block_stamps(cache, named).tolist() == expected(stamps, old)[4:8]
    assert found_prefix(cache, stamps, old) == 8


def test_a_prompt_cached_in_full_writes_its_last_token_into_a_copy():
    """Every full block of the prompt cached, its holder gone: the prompt's last token is
    written again, into a copy; the named blocks stay as they were."""
    stamps, cache = Stamps(), pool(6, 4)
    prompt = list(range(1, 9))
    prefilled(cache, stamps, "a", prompt)
    named = list(cache.books.seqs["a"].blocks)
    cache.books.free_seq("a")
    assert prefilled(cache, stamps, "b", prompt) == 7
    b = cache.books.seqs["b"].blocks
    assert b[0] == named[0] and b[1] != named[1]
    assert all(b in cache.books.index.name_of for b in named)
    assert read(cache, "b") == expected(stamps, prompt)


def test_a_fork_writing_into_the_shared_last_block_copies_it_first():
    """a and its fork b share a half-filled block; each writes its own token at the same
    position, in one step: each reads back its own, the prompt's slots intact in both."""
    stamps, cache = Stamps(), pool(8, 4)
    prompt = list(range(1, 11))                                  # blocks of 4, 4, 2
    prefilled(cache, stamps, "a", prompt)
    cache.books.fork("a", "b")
    free = cache.books.num_free
    assert cache.books.room_needed(["a", "b"], 1) == 1   # one copy: then b's block is a's own
    written = write(cache, stamps, {"a": prompt + [70], "b": prompt + [80]}, 1)
    assert written[0] != written[1] and cache.books.num_free == free - 1
    assert read(cache, "a") == expected(stamps, prompt + [70])
    assert read(cache, "b") == expected(stamps, prompt + [80])
    assert cache.books.seqs["a"].blocks[:2] == cache.books.seqs["b"].blocks[:2]


# --- refcounts -----------------------------------------------------------------------------
def test_refcounts_are_the_holders_through_forks_writes_and_releases():
    """A prompt forked twice: every block held by 3, no block taken; writes copy only the
    shared half block; a block stays held (and unlent) until its last holder goes."""
    stamps, cache = Stamps(), pool(10, 4)
    prompt = list(range(1, 11))
    prefilled(cache, stamps, "a", prompt)
    blocks, free = list(cache.books.seqs["a"].blocks), cache.books.num_free
    cache.books.fork("a", "b")
    cache.books.fork("b", "c")
    assert cache.books.refcount[blocks].tolist() == [3, 3, 3] and cache.books.num_free == free
    assert (cache.books.refcount == holders(cache)).all()
    assert cache.books.room_needed(["b", "c"], 1) == 2          # a holds it too: both copy
    write(cache, stamps, {"b": prompt + [1], "c": prompt + [2]}, 1)   # two copies of block 2
    assert cache.books.refcount[blocks].tolist() == [3, 3, 1] and cache.books.num_free == free - 2
    assert (cache.books.refcount == holders(cache)).all()
    cache.books.free_seq("a")
    assert cache.books.refcount[blocks].tolist() == [2, 2, 0]
    assert (cache.books.refcount == holders(cache)).all()
    prefilled(cache, stamps, "big", [50] * 23)   # takes every free block (the kept ones too)
    assert cache.books.num_free == 0
    assert read(cache, "b") == expected(stamps, prompt + [1])   # b's blocks were not lent
    assert read(cache, "c") == expected(stamps, prompt + [2])
    for s in ("b", "c", "big"):
        cache.books.free_seq(s)
    assert not cache.books.refcount.any() and cache.books.num_free == cache.books.num_blocks
    books = cache.books
    assert sorted(books.free + list(books.index.unheld)) == list(range(books.num_blocks))


@pytest.mark.parametrize("n", [2, 3])
def test_a_trimmed_fork_releases_only_its_own_hold(n):
    stamps, cache = Stamps(), pool(8, 2)
    prompt = [4, 5, 6, 7, 8]
    prefilled(cache, stamps, "a", prompt)
    for i in range(1, n):
        cache.books.fork("a", i)
    cache.books.trim(1, 3)                                            # 2 tokens: 1 block
    assert (cache.books.refcount == holders(cache)).all()
    assert cache.books.refcount[cache.books.seqs["a"].blocks].tolist() == [n, n - 1, n - 1]
    assert read(cache, "a") == expected(stamps, prompt)


def test_a_sequence_trimmed_to_nothing_swaps_out_and_back_in():
    stamps, cache = Stamps(), pool(4, 2)
    prefilled(cache, stamps, "a", [1, 2, 3])
    cache.books.trim("a", 3)
    swapped = cache.books.swap_out("a")
    assert swapped.blocks == 0 and cache.books.num_free == 4
    cache.books.swap_in("a", swapped)
    assert cache.books.seqs["a"].blocks == [] and cache.books.num_free == 4
    write(cache, stamps, {"a": [7]}, 1)
    assert read(cache, "a") == expected(stamps, [7])
