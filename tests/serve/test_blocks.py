"""The books decide, the pool does: copy on write and swapping queued as moves by the block
manager (host integers, no array), carried out by the pool in the order decided; a block a
plan has readied may be written once though a later prompt of the plan shares it; a paged
sequence copied into a contiguous cache."""
import numpy as np
import pytest

from minitransformer.backend import to_numpy
from minitransformer.kvcache import KVCache
from minitransformer.model import forward
from minitransformer.serve.blocks import BlockManager, Copy, SwapIn, SwapOut
from minitransformer.serve.paged import PagedCache

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]                       # two full blocks of 4


def test_the_books_queue_copies_and_swaps_and_hold_no_array():
    books = BlockManager(num_blocks=6, block_size=4)
    books.add("a", PROMPT)
    books.append(["a"], len(PROMPT))
    books.seal("a", PROMPT)
    assert books.take_moves() == []
    assert books.add("b", PROMPT) == 7                  # held in full: the last block copied
    a, b = books.seqs["a"].blocks, books.seqs["b"].blocks
    assert books.take_moves() == [Copy(a[1], b[1])] and a[0] == b[0]
    swapped = books.swap_out("a")
    books.swap_in("a", swapped)
    out, back = books.take_moves()
    assert isinstance(out, SwapOut) and out.blocks == tuple(a) and out.into is swapped
    assert isinstance(back, SwapIn) and back.source is swapped and swapped.k is None
    assert not any(isinstance(value, (list, np.ndarray)) and len(value) and
                   isinstance(value[0], np.ndarray) for value in vars(books).values())


def keys_of(cache, seq_id):
    """(L, Hkv, length, d) a sequence's keys, read through its block table."""
    seq = cache.books.seqs[seq_id]
    held = [to_numpy(k[np.array(seq.blocks)]) for k in cache.k]          # (nb, Hkv, bs, d)
    return np.stack([np.concatenate(list(h), axis=1)[:, :seq.length] for h in held])


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


def test_a_readied_block_is_written_once_even_when_shared_then_never():
    """A plan counts a's prompt at once and names its full block; b, admitted in the same
    plan, holds it. a's own write into it is the one allowed; after it, none is."""
    from stamps import pool
    cache = pool(num_blocks=6, block_size=4)
    cache.books.add("a", PROMPT[:5])
    starts = cache.books.append(["a"], 5)
    cache.books.seal("a", PROMPT[:5])
    assert cache.books.add("b", PROMPT[:4] + [0]) == 4        # b holds a's first block
    view = cache.view(["a"], starts)
    positions = view.positions(5)
    view.slots(positions)                               # a may write: room was made for it
    view.advance(5)
    again = cache.view(["a"], [0])
    with pytest.raises(RuntimeError, match="shared or named"):
        again.slots(again.positions(4))


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
        for mine, theirs in zip(kv.k + kv.v, alone[seq_id].k + alone[seq_id].v):
            np.testing.assert_array_equal(to_numpy(unpack(mine)[row, :, :n]),
                                          to_numpy(unpack(theirs)[0, :, :n]))
            assert not to_numpy(unpack(mine)[row, :, n:]).any()  # nothing past the row
    with pytest.raises(ValueError, match="shorter than the longest row"):
        cache.to_contiguous(["long"], max_len=9)


def unpack(held):
    """A float cache as it is; a quantized one's codes (its scales follow them)."""
    return getattr(held, "codes", held)
