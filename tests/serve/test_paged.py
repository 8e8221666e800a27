"""The paged pool (serve/paged.py: the arrays the books point into): keys read through a block
table equal the contiguous cache's, a prompt held in full copied before its write, swapping
bit-exact, a trimmed sequence's named block copied before a write, the moves done in the order
the books decided, the contiguous copy of several rows; and at its edges: the memory check at
exactly the bytes there are, the smallest pool, a one-layer model, the attention a cache keeps,
views written without precomputed slots or used for two passes, a row of a planned view alone,
and the refusals' words (a write without room, a block id past the pool, a write into a shared
block, a ragged view given the wrong number of tokens)."""
import numpy as np
import pytest

import minitransformer.serve.paged as paged
from minitransformer.backend import to_numpy, xp
from minitransformer.checkpoints.synth import qwen2_config, random_model
from minitransformer.config import ModelConfig
from minitransformer.kvcache import KVCache
from minitransformer.kvquant import cache_bytes_per_token
from minitransformer.model import forward
from minitransformer.serve.blocks import PoolExhausted, blocks_for
from minitransformer.serve.paged import PagedCache, RaggedView, check_fits
from minitransformer.tiled import CausalTiles

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]                       # two full blocks of 4


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


def keys_of(cache, seq_id):
    """(L, Hkv, length, d) a sequence's keys, read through its block table."""
    seq = cache.books.seqs[seq_id]
    held = [to_numpy(k[np.array(seq.blocks)]) for k in cache.k]          # (nb, Hkv, bs, d)
    return np.stack([np.concatenate(list(h), axis=1)[:, :seq.length] for h in held])


def contiguous(model, *chunks):
    """A contiguous cache fed the chunks pass by pass (the same calls as the paged side, so
    the same bits)."""
    kv = KVCache.allocate(model.config, 1, sum(map(len, chunks)))
    for chunk in chunks:
        forward(model, np.array([chunk]), kv)
    return kv


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


def test_a_prompt_held_in_full_copies_its_last_block_on_write(tiny_model):
    prompt = list(range(1, 13))  # three full blocks of 4
    cache = PagedCache.allocate(tiny_model.config, 10, 4)
    prefill(tiny_model, cache, "a", prompt)
    before = [k.copy() for k in cache.k]
    assert prefill(tiny_model, cache, "b", prompt) == 11  # the last token is recomputed
    a, b = cache.books.seqs["a"].blocks, cache.books.seqs["b"].blocks
    assert a[:2] == b[:2] and a[2] != b[2]                 # two shared, the third copied
    assert cache.books.refcount[a[:2]].tolist() == [2, 2] and cache.books.refcount[b[2]] == 1
    for k, k0 in zip(cache.k, before, strict=True):                     # a's blocks untouched
        assert np.array_equal(to_numpy(k[np.array(a)]), to_numpy(k0[np.array(a)]))
    np.testing.assert_allclose(keys(cache, "b"), keys(cache, "a"), rtol=1e-5, atol=1e-6)
    check_invariants(cache)


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


def test_the_pool_does_the_moves_in_the_order_the_books_decided(tiny_model):
    """a is swapped out; b takes a's freed blocks and is written; a comes back: a's keys
    are read out before b's write, and written back after."""
    cache = PagedCache.allocate(tiny_model.config, 2, 4)
    cache.books.add("a", PROMPT)
    forward(tiny_model, np.array([PROMPT]), cache.view(["a"]))
    before = keys_of(cache, "a")
    swapped = cache.books.swap_out("a")                       # decided; nothing copied yet
    other = [7, 7, 7, 7, 8, 8, 8, 8]
    cache.books.add("b", other)                               # a's two blocks
    assert swapped.k is None                                  # reading the pool moves nothing
    cache.do(cache.books.take_moves())                        # the swap out goes first
    forward(tiny_model, np.array([other]), cache.view(["b"]))
    assert swapped.k is not None
    cache.books.free_seq("b")
    cache.books.swap_in("a", swapped)
    cache.do(cache.books.take_moves())
    np.testing.assert_array_equal(keys_of(cache, "a"), before)     # bit for bit
    cache.books.swap_in("a2", cache.books.swap_out("a"))      # out and in, both pending
    assert len(cache.books.moves) == 2
    cache.do(cache.books.take_moves())                        # in order
    np.testing.assert_array_equal(keys_of(cache, "a2"), before)


@pytest.mark.parametrize("kv_dtype", ["f32", "q8_0"])
def test_to_contiguous_holds_each_rows_keys_and_values_bit_for_bit(tiny_model, kv_dtype):
    cache = PagedCache.allocate(tiny_model.config, 8, 4, kv_dtype)
    prompts = {"long": PROMPT + [5, 3], "short": PROMPT[:3]}
    alone = {}
    for seq_id, prompt in prompts.items():
        cache.books.add(seq_id, prompt)
        forward(tiny_model, np.array([prompt]), cache.view([seq_id]))
        alone[seq_id] = KVCache.allocate(tiny_model.config, 1, len(prompt), kv_dtype)
        forward(tiny_model, np.array([prompt]), alone[seq_id])
    kv = cache.to_contiguous(["short", "long"], max_len=12)
    assert kv.lengths.tolist() == [3, 10] and kv.max_len == 12
    for row, seq_id in enumerate(["short", "long"]):
        n = len(prompts[seq_id])
        for mine, theirs in zip(kv.k + kv.v, alone[seq_id].k + alone[seq_id].v, strict=True):
            np.testing.assert_array_equal(to_numpy(unpack(mine)[row, :, :n]),
                                          to_numpy(unpack(theirs)[0, :, :n]))
            assert not to_numpy(unpack(mine)[row, :, n:]).any()  # nothing past the row
    with pytest.raises(ValueError, match="shorter than the longest row"):
        cache.to_contiguous(["long"], max_len=9)


def unpack(held):
    """A float cache as it is; a quantized one's codes (its scales follow them)."""
    return getattr(held, "codes", held)


def test_the_memory_check_passes_at_exactly_the_bytes_there_are_and_names_the_gib(monkeypatch):
    """A pool of 5 GiB and 8 slots (8 bytes each): refused with one byte fewer, the figure
    shown as 5.0 GiB; accepted with exactly that many."""
    config = ModelConfig.from_dict(qwen2_config())
    per_token = cache_bytes_per_token(config, "f32")
    num_blocks = 5 * 2**30 // (16 * per_token)
    assert num_blocks * 16 * per_token == 5 * 2**30
    need = 5 * 2**30 + 64
    monkeypatch.setattr(paged, "memory_bytes", lambda: (need, "the test"))
    check_fits(config, 8, num_blocks, 16)
    monkeypatch.setattr(paged, "memory_bytes", lambda: (need - 1, "the test"))
    with pytest.raises(ValueError, match=r"need 5,368,709,184 bytes \(5\.0 GiB\), more than "
                                         r"the 5,368,709,183 bytes of the test"):
        check_fits(config, 8, num_blocks, 16)


def test_the_smallest_pool_is_one_block_of_one_slot_and_neither_may_be_zero(tiny_model):
    cache = PagedCache.allocate(tiny_model.config, 1, 1)
    assert cache.books.num_blocks == 1 and cache.books.block_size == 1
    for num_blocks, block_size in ((0, 4), (4, 0)):
        with pytest.raises(ValueError, match="num_blocks >= 1 and block_size >= 1"):
            PagedCache.allocate(tiny_model.config, num_blocks, block_size)


def test_a_one_layer_model_pages_its_cache():
    model = random_model(qwen2_config(num_hidden_layers=1))
    prompt = [3, 1, 4, 1, 5, 9]
    cache = PagedCache.allocate(model.config, 4, 4)
    cache.books.add("a", prompt)
    forward(model, np.array([prompt]), cache.view(["a"]))
    kv, ref = cache.to_contiguous(["a"]), contiguous(model, prompt)
    assert np.array_equal(to_numpy(kv.k[0]), to_numpy(ref.k[0]))
    assert np.array_equal(to_numpy(kv.v[0]), to_numpy(ref.v[0]))


def test_a_cache_made_from_its_arrays_attends_plainly_by_default(tiny_model):
    pool = PagedCache.allocate(tiny_model.config, 4, 4)
    assert PagedCache(pool.books, pool.k, pool.v).attention == "plain"


def test_a_tiled_cache_keeps_tiled_in_its_views_masks_and_its_contiguous_copy(tiny_model):
    """Tiled attention never makes the (B, T, S) mask: its views hand forward CausalTiles,
    and the contiguous copy attends tiled too."""
    cache = PagedCache.allocate(tiny_model.config, 8, 4, attention="tiled")
    assert cache.attention == "tiled"
    cache.books.add("a", [1, 2, 3, 4, 5])
    view = cache.view(["a"])
    assert isinstance(view.mask(view.positions(5)), CausalTiles)
    forward(tiny_model, np.array([[1, 2, 3, 4, 5]]), view)
    assert cache.to_contiguous(["a"]).attention == "tiled"


def test_the_contiguous_copy_holds_each_rows_own_keys_and_zeros_past_its_length(tiny_model):
    """Rows of 9, 3 and 6 tokens (the longest first), copied into 12 positions: row b is
    sequence b's keys and values as a contiguous cache computes them, zeros after its
    length; its lengths are the rows'. A max_len under the longest row is refused."""
    prompts = {"long": list(range(1, 10)), "short": [20, 21, 22], "mid": list(range(30, 36))}
    cache = PagedCache.allocate(tiny_model.config, 16, 4)
    for name, prompt in prompts.items():
        cache.books.add(name, prompt)
        forward(tiny_model, np.array([prompt]), cache.view([name]))
    kv = cache.to_contiguous(list(prompts), max_len=12)
    assert kv.lengths.tolist() == [9, 3, 6]
    for layer in range(tiny_model.config.num_hidden_layers):
        for held, expect in ((kv.k, "k"), (kv.v, "v")):
            rows = to_numpy(held[layer])
            assert rows.shape[0] == 3 and rows.shape[2] == 12
            for b, prompt in enumerate(prompts.values()):
                ref = to_numpy(getattr(contiguous(tiny_model, prompt), expect)[layer][0])
                assert np.array_equal(rows[b, :, :len(prompt)], ref)
                assert not rows[b, :, len(prompt):].any()
    with pytest.raises(ValueError, match=r"max_len=8 is shorter than the longest row \(9\)"):
        cache.to_contiguous(list(prompts), max_len=8)


def test_a_view_written_without_precomputed_slots_stores_and_returns_the_keys(tiny_model):
    """update(layer, k, v) alone (no slots from the pass): 3 new tokens of a 2-token row go
    to positions 2..4, and the keys and values returned are the row's 5 positions."""
    config = tiny_model.config
    cache = PagedCache.allocate(config, 8, 2)
    cache.books.add("a", [1, 2])
    forward(tiny_model, np.array([[1, 2]]), cache.view(["a"]))
    cache.books.make_room(["a"], 3)
    Hkv, d = config.num_key_value_heads, config.head_dim
    assert Hkv != 3
    rng = np.random.default_rng(0)
    k, v = (rng.standard_normal((1, 3, Hkv, d)).astype(np.float32) for _ in range(2))
    before = to_numpy(cache.to_contiguous(["a"]).k[0])[0, :, :2]
    held_k, held_v = cache.view(["a"]).update(0, xp.asarray(k), xp.asarray(v))
    held_k, held_v = to_numpy(held_k[:, :, :]), to_numpy(held_v[:, :, :])   # in place, read
    assert held_k.shape == (1, Hkv, 5, d)
    assert np.array_equal(held_k[0, :, :2], before)
    assert np.array_equal(held_k[0, :, 2:], k[0].transpose(1, 0, 2))
    assert np.array_equal(held_v[0, :, 2:], v[0].transpose(1, 0, 2))


def test_one_view_used_for_two_passes_continues_where_the_first_ended(tiny_model):
    prompt = [5, 6, 7, 8, 9]
    cache = PagedCache.allocate(tiny_model.config, 8, 2)
    cache.books.add("a", prompt[:3])
    view = cache.view(["a"])
    forward(tiny_model, np.array([prompt[:3]]), view)
    cache.books.make_room(["a"], 2)
    forward(tiny_model, np.array([prompt[3:]]), view)
    assert cache.books.seqs["a"].length == 5
    kv, ref = cache.to_contiguous(["a"]), contiguous(tiny_model, prompt[:3], prompt[3:])
    for layer in range(tiny_model.config.num_hidden_layers):
        assert np.array_equal(to_numpy(kv.k[layer]), to_numpy(ref.k[layer]))


def test_a_row_of_a_planned_view_writes_that_sequence_alone(tiny_model):
    """Two sequences' next tokens counted in the books (append), run row by row through
    view.row(b) as a batch-invariant pass does: each row's block is written (once the
    scheduler marks the plan's slots written, none is left waiting for a write), and each
    sequence holds the keys of its own token."""
    cache = PagedCache.allocate(tiny_model.config, 8, 2)
    for name, prompt in (("a", [1, 2]), ("b", [3, 4])):
        cache.books.add(name, prompt)
        forward(tiny_model, np.array([prompt]), cache.view([name]))
    starts = cache.books.append(["a", "b"], 1)
    view = cache.view(["a", "b"], starts)
    for b, token in enumerate((7, 8)):
        row = view.row(b)
        assert row.ids == [["a", "b"][b]]
        forward(tiny_model, np.array([[token]]), row)
    assert cache.books.filling                          # the view writes no book
    cache.books.written(["a", "b"], starts, 1)          # the scheduler's commit
    assert not cache.books.filling
    cache.books.check()
    for name, prompt, token in (("a", [1, 2], 7), ("b", [3, 4], 8)):
        ref = contiguous(tiny_model, prompt, [token])
        got = cache.to_contiguous([name])
        for layer in range(tiny_model.config.num_hidden_layers):
            assert np.array_equal(to_numpy(got.k[layer]), to_numpy(ref.k[layer]))
            assert np.array_equal(to_numpy(got.v[layer]), to_numpy(ref.v[layer]))


def test_a_block_id_just_past_the_pool_is_refused(tiny_model):
    cache = PagedCache.allocate(tiny_model.config, 4, 4)
    cache.books.add("a", [1, 2, 3, 4])
    forward(tiny_model, np.array([[1, 2, 3, 4]]), cache.view(["a"]))
    cache.books.make_room(["a"], 1)
    cache.books.seqs["a"].blocks[1] = 4                       # the pool's ids are 0..3
    with pytest.raises(ValueError, match="block ids 0..4 outside a pool of 4"):
        forward(tiny_model, np.array([[5]]), cache.view(["a"]))


def test_a_write_into_a_shared_block_is_refused_by_name(tiny_model):
    """A fork shares its parent's half-filled last block: writing into it without make_room's
    copy is refused, and the message says what to call."""
    cache = PagedCache.allocate(tiny_model.config, 8, 4)
    cache.books.add("a", [1, 2, 3, 4, 5])
    forward(tiny_model, np.array([[1, 2, 3, 4, 5]]), cache.view(["a"]))
    cache.books.fork("a", "b")
    with pytest.raises(RuntimeError, match="^write into a shared or named block: make_room "
                                           "copies it first$"):
        forward(tiny_model, np.array([[6]]), cache.view(["b"]))


def test_a_ragged_view_given_the_wrong_number_of_tokens_says_how_many_it_holds(tiny_model):
    cache = PagedCache.allocate(tiny_model.config, 8, 4)
    for name in "abc":
        cache.books.add(name, [1])
    starts = cache.books.append(["a", "b"], 1) + cache.books.append(["c"], 3)
    ragged = RaggedView(cache, [(["a", "b"], starts[:2], 1), (["c"], starts[2:], 3)])
    assert ragged.positions(5).shape == (1, 5)
    with pytest.raises(ValueError, match="^a ragged view of 5 tokens was given 4$"):
        ragged.positions(4)


@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "gathered"])
def test_a_pass_over_tables_with_holes_reads_each_row_from_its_first_block_held(in_place):
    """Mistral with a window of 6, blocks of 4: rows of 13 and 9 tokens, their blocks that slid
    out of the window released (2 and 1), decode together, each row's table from its own
    first block held: their logits are those of the same pool with nothing released (the
    window's mask hides those positions either way), and the contiguous copy holds zeros where
    the released blocks were, the same keys after."""
    from minitransformer.checkpoints.synth import mistral_config
    from minitransformer.model import head
    model = random_model(mistral_config(sliding_window=6), seed=3)

    def decode(release):
        cache = PagedCache.allocate(model.config, 16, block_size=4, in_place=in_place)
        for seq_id, prompt in (("a", list(range(1, 14))), ("b", list(range(20, 29)))):
            prefill(model, cache, seq_id, prompt, seal=False)
        if release:
            assert (cache.books.slide("a"), cache.books.slide("b")) == (2, 1)
        logits = head(model, forward(model, np.array([[7], [8]]), cache.view(["a", "b"])))
        check_invariants(cache)
        return cache, to_numpy(logits)

    (slid, with_holes), (whole, without) = decode(True), decode(False)
    np.testing.assert_allclose(with_holes, without, rtol=1e-5, atol=1e-5)
    short, full = slid.to_contiguous(["a", "b"]), whole.to_contiguous(["a", "b"])
    for layer in range(model.config.num_hidden_layers):
        mine, theirs = to_numpy(short.k[layer]), to_numpy(full.k[layer])
        assert not mine[0, :, :8].any() and not mine[1, :, :4].any()
        assert (mine[0, :, 8:14] == theirs[0, :, 8:14]).all()
        assert (mine[1, :, 4:10] == theirs[1, :, 4:10]).all()
