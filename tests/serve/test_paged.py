"""The paged cache: block tables, reference counts, the prefix cache (naming, keeping, LRU
eviction), copy on write, swapping."""
import numpy as np
import pytest

from minitransformer.backend import to_numpy
from minitransformer.kvcache import KVCache
from minitransformer.model import forward
from minitransformer.serve.blocks import PoolExhausted, blocks_for
from minitransformer.serve.paged import PagedCache


def prefill(model, cache, seq_id, prompt, seal=True):
    held = cache.books.add(seq_id, prompt)
    cache.do(cache.books.take_moves())                  # the pool does what the books decided
    forward(model, np.array([prompt[held:]]), cache.view([seq_id]))
    if seal:
        cache.books.seal(seq_id, prompt)
    return held


def keys(cache, seq_id, layer=0):
    """A sequence's keys read back through its block table: (Hkv, length, d)."""
    seq = cache.books.seqs[seq_id]
    blocks = to_numpy(cache.k[layer][np.array(seq.blocks)])           # (nb, Hkv, bs, d)
    return np.concatenate(list(blocks), axis=1)[:, :seq.length]


def check_invariants(cache):
    """The cache's own books (PagedCache.check), and no block held beyond a sequence's need."""
    cache.books.check()
    for seq in cache.books.seqs.values():
        assert len(seq.blocks) == cache.books.blocks_for(seq.length) or seq.length == 0


@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_keys_through_the_block_table_equal_the_contiguous_cache(tiny_model, block_size):
    prompt = list(range(1, 30))
    kv = KVCache.allocate(tiny_model.config, 1, len(prompt))
    forward(tiny_model, np.array([prompt]), kv)
    cache = PagedCache.allocate(tiny_model.config, 40, block_size)
    cache.books.add("other", [7] * 5)  # so the sequence's blocks are not 0, 1, 2, ...
    prefill(tiny_model, cache, "s", prompt)
    for layer in range(tiny_model.config.num_hidden_layers):
        assert np.array_equal(keys(cache, "s", layer), to_numpy(kv.k[layer][0]))
    assert len(cache.books.seqs["s"].blocks) == blocks_for(29, block_size)
    check_invariants(cache)


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


def test_a_prompt_held_in_full_copies_its_last_block_on_write(tiny_model):
    prompt = list(range(1, 13))  # three full blocks of 4
    cache = PagedCache.allocate(tiny_model.config, 10, 4)
    prefill(tiny_model, cache, "a", prompt)
    before = [k.copy() for k in cache.k]
    assert prefill(tiny_model, cache, "b", prompt) == 11  # the last token is recomputed
    a, b = cache.books.seqs["a"].blocks, cache.books.seqs["b"].blocks
    assert a[:2] == b[:2] and a[2] != b[2]                 # two shared, the third copied
    assert cache.books.refcount[a[:2]].tolist() == [2, 2] and cache.books.refcount[b[2]] == 1
    for k, k0 in zip(cache.k, before):                     # a's blocks untouched
        assert np.array_equal(to_numpy(k[np.array(a)]), to_numpy(k0[np.array(a)]))
    np.testing.assert_allclose(keys(cache, "b"), keys(cache, "a"), rtol=1e-5, atol=1e-6)
    check_invariants(cache)


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


def test_writing_without_room_or_with_a_bad_table_is_refused(tiny_model):
    cache = PagedCache.allocate(tiny_model.config, 4, 4)
    prefill(tiny_model, cache, "a", [1, 2, 3, 4])
    with pytest.raises(ValueError, match="make_room"):
        forward(tiny_model, np.array([[5]]), cache.view(["a"]))
    cache.books.make_room(["a"], 1)
    cache.books.seqs["a"].blocks[1] = 9                    # corrupted: not a block of the pool
    with pytest.raises(ValueError, match="outside a pool of 4"):
        forward(tiny_model, np.array([[5]]), cache.view(["a"]))
    with pytest.raises(ValueError, match="already in the cache"):
        cache.books.add("a", [1])
    with pytest.raises(ValueError, match="num_blocks >= 1"):
        PagedCache.allocate(tiny_model.config, 0, 4)


def test_swap_out_and_in_is_bit_exact(tiny_model):
    cache = PagedCache.allocate(tiny_model.config, 6, 4)
    prefill(tiny_model, cache, "a", list(range(1, 11)))
    saved = [keys(cache, "a", layer) for layer in range(tiny_model.config.num_hidden_layers)]
    swapped = cache.books.swap_out("a")
    assert cache.books.num_free == 6 and swapped.blocks == 3 and swapped.length == 10
    prefill(tiny_model, cache, "b", [9] * 9)               # reuses the freed blocks
    cache.books.swap_in("a", swapped)
    cache.do(cache.books.take_moves())
    for layer, k in enumerate(saved):
        assert np.array_equal(keys(cache, "a", layer), k)
    check_invariants(cache)
    with pytest.raises(PoolExhausted):
        cache.books.swap_in("c", swapped)                        # 3 blocks needed, 0 free


def test_trim_frees_blocks_and_a_named_block_it_keeps_is_copied_before_a_write(tiny_model):
    cache = PagedCache.allocate(tiny_model.config, 8, 4)
    prompt = list(range(1, 11))
    prefill(tiny_model, cache, "a", prompt)                # blocks of 4, 4, 2; two named
    assert len(cache.books.index.name_of) == 2
    cache.books.trim("a", 5)                                     # 5 tokens left: 2 blocks
    assert len(cache.books.seqs["a"].blocks) == 2 and cache.books.num_free == 6
    assert len(cache.books.seqs["a"].names) == 1                 # block 1 is no longer all a's
    named = cache.books.seqs["a"].blocks[1]
    before = to_numpy(cache.k[0][named]).copy()
    assert cache.books.blocks_needed("a", 1) == 1                # a copy before writing slot 5
    cache.books.make_room(["a"], 1)
    forward(tiny_model, np.array([[77]]), cache.view(["a"]))
    assert cache.books.seqs["a"].blocks[1] != named and np.array_equal(to_numpy(cache.k[0][named]),
                                                                 before)
    assert cache.books.index.find(cache.books.cached_prefix(prompt)[0]) == [0, named]  # whole
    check_invariants(cache)
    with pytest.raises(ValueError, match="cannot trim 7"):
        cache.books.trim("a", 7)


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
