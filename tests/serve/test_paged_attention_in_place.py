"""A paged pool's passes read its blocks where they lie (paged.InPlace): each tile gathers only
the blocks its slots are in, never a row's whole context. The tiled attention reads every pass
so, and its result is the gathered copy's, bit for bit (the same tiles, laid out alike: the
same products in the same shapes). The plain attention, the default, reads its decodes so
(tiled.two_pass_attention, at most paged.FEW_QUERIES queries a row, 256-slot tiles, a short
tail joining the tile before): rows within one tile are the gathered copy's bits; longer rows
within float32 rounding, their logits within the near-tie window of generate's and their
tokens by the near-tie rule; its prompts still read a gathered copy (their bits unchanged).
The batch-invariant engine reads every pass gathered: a row's logits are generate's, bit for
bit, at any context."""
from dataclasses import replace

import numpy as np
import pytest

import minitransformer as mt
from conftest import NEAR_TIE, assert_like_solo, solo_cached
from minitransformer.backend import to_numpy, xp
from minitransformer.measure.timing import peak_bytes
from minitransformer.model import forward
from minitransformer.serve import paged
from minitransformer.serve.config import EngineConfig
from minitransformer.serve.engine import Engine
from minitransformer.serve.paged import PagedCache, RaggedView
from minitransformer.serve.records import Request
from minitransformer.tiled import DECODE_TILE
from test_tiled import assert_close

LENGTHS = (150, 70, 9)   # rows over 3, 2 and 1 tiles of 64 slots; within one of 256
TAILS = (300, 256, 9)    # one tile of 256 too: a tail under half a tile joins the tile before
LONG = (900, 500, 9)     # rows over 4, 2 and 1 tiles of 256 slots


@pytest.fixture
def long_model(tiny_model):
    """The tiny model with room for rows over several tiles of 256 slots (it has 256
    positions; its RoPE takes any)."""
    return replace(tiny_model, config=replace(tiny_model.config, max_position_embeddings=2048))


def passes(model, cache, rng, lengths=LENGTHS) -> list:
    """The same passes on a pool -> each pass's hidden states: three prompts prefilled (the
    causal tiles of a prefill), a decode step of rows of different lengths, and a ragged pass
    of two decodes beside a 5-token chunk of the third row."""
    V, out = model.config.vocab_size, []
    for s, n in enumerate(lengths):
        cache.books.add(s, [1] * n, reuse=False)
        out.append(forward(model, rng.integers(0, V, (1, n)), cache.view([s])))
    out.append(forward(model, rng.integers(0, V, (3, 1)),
                       cache.view([0, 1, 2], cache.books.append([0, 1, 2], 1))))
    starts = cache.books.append([0, 1], 1) + cache.books.append([2], 5)
    ragged = RaggedView(cache, [([0, 1], starts[:2], 1), ([2], starts[2:], 5)])
    out.append(forward(model, rng.integers(0, V, (1, 7)), ragged))
    return [to_numpy(h) for h in out]


@pytest.mark.parametrize("block_size", [1, 4, 16, 48, 100])
@pytest.mark.parametrize("kv_dtype", ["f32", "q8_0"])
def test_in_place_is_the_gathered_copy_bit_for_bit(tiny_model, block_size, kv_dtype):
    """Block sizes that divide a tile, that straddle tiles (48) and that hold more than one
    (100); a float and a quantized pool (its codes and scales indexed alike)."""
    def run(attention, in_place):
        return on_a_pool(tiny_model, block_size, kv_dtype, attention, in_place, LENGTHS)
    in_place, gathered = run("tiled", True), run("tiled", False)
    for a, b in zip(in_place, gathered, strict=True):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(in_place, run("plain", True), strict=True):    # the plain one: its own softmax
        assert_close(a, b, xp.ones(1))


def on_a_pool(model, block_size, kv_dtype, attention, in_place, lengths) -> list:
    """``passes`` on a fresh pool whose rows' blocks are not 0, 1, 2, ..."""
    cache = PagedCache.allocate(model.config, 2 * sum(lengths) // block_size + 8, block_size,
                                kv_dtype, attention, in_place)
    cache.books.add("first", [2] * 7)
    return passes(model, cache, np.random.default_rng(0), lengths)


@pytest.mark.parametrize("block_size", [1, 16, 48, 100])
@pytest.mark.parametrize("kv_dtype", ["f32", "q8_0"])
@pytest.mark.parametrize("lengths", [LENGTHS, TAILS], ids=["short", "tails"])
def test_plain_decodes_in_place_within_a_tile_are_the_gathered_copy_bit_for_bit(
        long_model, block_size, kv_dtype, lengths):
    """Rows within one tile (up to 256 slots, and rows of 257 to 302 whose tail joins it):
    the prefills read a gathered copy, the decodes and the ragged pass (the 5-token chunk
    too: few queries) one tile in place, plain's very calls."""
    in_place = on_a_pool(long_model, block_size, kv_dtype, "plain", True, lengths)
    for a, b in zip(in_place, on_a_pool(long_model, block_size, kv_dtype, "plain", False,
                                        lengths), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("block_size", [16, 48])
@pytest.mark.parametrize("kv_dtype", ["f32", "q8_0"])
def test_plain_decodes_in_place_past_a_tile_are_the_gathered_copy_within_rounding(
        long_model, block_size, kv_dtype):
    """Rows of 900 and 500 slots: the prefills (gathered both ways) bit for bit; the decode
    and the ragged pass, their weights @ v summed a tile at a time, within the tolerance."""
    assert LONG[1] > 1.5 * DECODE_TILE
    in_place = on_a_pool(long_model, block_size, kv_dtype, "plain", True, LONG)
    gathered = on_a_pool(long_model, block_size, kv_dtype, "plain", False, LONG)
    for a, b in zip(in_place[:3], gathered[:3], strict=True):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(in_place[3:], gathered[3:], strict=True):
        assert_close(a, b, xp.ones(1))


@pytest.mark.parametrize("block_size", [4, 48])
@pytest.mark.parametrize("attention, lengths, tile", [("tiled", LENGTHS, 64),
                                                      ("plain", LONG, DECODE_TILE)])
def test_a_tile_gathers_only_the_blocks_its_slots_lie_in(long_model, block_size, attention,
                                                         lengths, tile, monkeypatch):
    """A decode step over rows of two lengths: in place, every gather covers one tile's
    blocks (at most tile / bs + 1 blocks); gathered, one per layer covers every row's whole
    table. A plain prompt reads its blocks gathered, in place or not."""
    L = long_model.config.num_hidden_layers
    for in_place in (True, False):
        cache = PagedCache.allocate(long_model.config, 2 * sum(lengths) // block_size + 8,
                                    block_size, attention=attention, in_place=in_place)
        for s, n in enumerate(lengths[:2]):
            cache.books.add(s, [1] * n, reuse=False)
            forward(long_model, np.ones((1, n), dtype=np.int64), cache.view([s]))
        ids = list(cache.books.seqs)
        widths = gathered(lambda: forward(long_model, np.array([[3]] * len(ids)), cache.view(
            ids, cache.books.append(ids, 1))), monkeypatch)
        longest = lengths[0] + 1
        whole = cache.books.blocks_for(longest)
        if in_place:
            assert max(widths) <= tile // block_size + 1 < whole
            assert len(widths) == 2 * L * -(-longest // tile)   # K and V, every tile and layer
        else:
            assert widths == [whole] * (2 * L)
        if attention == "plain":                    # a prompt: many queries, gathered
            cache.books.add("p", [1] * 40, reuse=False)
            assert gathered(lambda: forward(long_model, np.ones((1, 40), dtype=np.int64),
                                            cache.view(["p"])), monkeypatch) == \
                [cache.books.blocks_for(40)] * (2 * L)


def gathered(run, monkeypatch) -> list:
    """run() -> the width (blocks) of every gather it made."""
    widths, gather = [], paged.gather
    monkeypatch.setattr(paged, "gather",
                        lambda pool, table, S: widths.append(table.shape[1]) or
                        gather(pool, table, S))
    run()
    monkeypatch.undo()
    return widths


def decode_peak(model, rows: int, n: int, attention: str, in_place: bool) -> int:
    """Peak bytes a decode step allocates over `rows` rows of n tokens (held as if prefilled:
    the keys' values are moot here)."""
    cache = PagedCache.allocate(model.config, rows * (n // 16 + 2), 16, attention=attention,
                                in_place=in_place)
    for s in range(rows):
        cache.books.add(s, [1] * n, reuse=False)
        cache.books.written([s], cache.books.append([s], n), n)
    ids = np.array([[3]] * rows)
    forward(model, ids, cache.view(range(rows), cache.books.append(range(rows), 1)))  # warm: a
    for s in range(rows):                          # first product of a shape may measure it
        cache.books.trim(s, 1)
    view = cache.view(range(rows), cache.books.append(range(rows), 1))
    return peak_bytes(lambda: forward(model, ids, view)).peak_bytes


@pytest.mark.skipif(xp is not np, reason="tracemalloc sees NumPy's allocations only")
@pytest.mark.parametrize("attention, n", [("tiled", 120), ("plain", 600)])
def test_a_decode_in_place_holds_no_copy_of_the_context(long_model, attention, n):
    """8 rows of n, then of 2n tokens (past a tile). Gathered, the step's peak grows by at
    least the n more tokens' keys and values of a layer (2 x 8 x Hkv x n x d floats: it holds
    them all at once); in place, by under a quarter of that for the tiled attention (measured:
    under 1 KB, the block tables; its tiles are 64 slots whatever the context), and for the
    plain one by no more than its n more scores a query head, a few arrays of them (4 x 8 x H
    x n floats: the softmax's rows, which the gathered copy's step holds as well)."""
    c = long_model.config
    more = 2 * 8 * c.num_key_value_heads * n * c.head_dim * 4          # bytes, one layer
    scores = 8 * c.num_attention_heads * n * 4
    growth = {in_place: decode_peak(long_model, 8, 2 * n, attention, in_place) -
              decode_peak(long_model, 8, n, attention, in_place) for in_place in (True, False)}
    assert growth[False] >= more
    if attention == "tiled":
        assert growth[True] < more / 4
    else:
        assert growth[True] <= 4 * scores
        assert growth[False] - growth[True] >= more * 3 / 4


@pytest.mark.parametrize("attention", ["plain", "tiled"])
@pytest.mark.parametrize("batch_invariant", [False, True])
def test_the_engine_reads_its_decodes_in_place_unless_batch_invariant(
        tiny_model, attention, batch_invariant, monkeypatch):
    """The default engine's decodes read the blocks where they lie, its prompts too when it
    attends tile by tile (bit for bit the same), a plain prompt gathered; the batch-invariant
    engine reads every pass gathered (so that its rows are generate's bits)."""
    engine = Engine(tiny_model, EngineConfig(max_num_seqs=2, num_gpu_blocks_override=40,
                                             block_size=4, attention=attention,
                                             batch_invariant=batch_invariant))
    assert engine.cache.in_place is not batch_invariant
    seen, update = [], paged.PagedView.update

    def watched(view, layer, k, v, slots=None):             # -> (T, the keys handed over)
        held = update(view, layer, k, v, slots)
        seen.append((k.shape[1], held[0]))
        return held
    monkeypatch.setattr(paged.PagedView, "update", watched)
    engine.run([Request(tuple(range(1, 90)), 3, eos_token_id=[])])
    monkeypatch.undo()
    assert {T for T, _ in seen} == {89, 1}
    for T, k in seen:
        in_place = not batch_invariant and (T == 1 or attention == "tiled")
        assert isinstance(k, paged.InPlace) is in_place


class Recording(Engine):
    """The engine, keeping the logits it picked each token from, by request (as
    scripts/dev/measure_rounding.py does)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen = {}

    def _sample(self, seq, logits, token=None):
        self.seen.setdefault(seq.result.id, []).append(np.array(logits))
        super()._sample(seq, logits, token)


@pytest.mark.parametrize("batch_invariant", [True, False])
def test_past_a_tile_the_engine_keeps_the_exactness_policy(long_model, batch_invariant):
    """Two prompts of 450 and 400 tokens decoding together over two tiles of 256 slots. The
    batch-invariant engine: each row's logits are generate's, bit for bit. The default one:
    within the near-tie window (a quarter of it: the rounding it was measured from) of
    generate's logits, so its tokens obey the near-tie rule."""
    rng = np.random.default_rng(3)
    V = long_model.config.vocab_size
    prompts = [tuple(rng.integers(0, V, n).tolist()) for n in (450, 400)]
    engine = Recording(long_model, EngineConfig(max_num_seqs=2, num_gpu_blocks_override=240,
                                                block_size=4,
                                                batch_invariant=batch_invariant))
    run = engine.run([Request(p, 12, eos_token_id=[]) for p in prompts])
    for prompt, result in zip(prompts, run.results, strict=True):
        alone = solo_cached(long_model, list(prompt), result.tokens)        # (12, V)
        mine = np.array(engine.seen[result.id])
        if batch_invariant:
            np.testing.assert_array_equal(mine, alone)
            assert result.tokens == mt.generate(long_model, list(prompt), 12, eos_token_id=[])
        else:
            scale = np.abs(alone).max(axis=-1, keepdims=True)
            assert (np.abs(mine - alone) / scale).max() <= NEAR_TIE / 4
            assert_like_solo(long_model, result.tokens,
                             mt.generate(long_model, list(prompt), 12, eos_token_id=[]),
                             list(prompt), eos_token_id=[])
