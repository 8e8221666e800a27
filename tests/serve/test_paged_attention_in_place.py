"""The tiled attention reads a paged pool's blocks where they lie (paged.InPlace): each tile
of 64 slots gathers only the blocks its slots are in, never a row's whole context, and the
result is the gathered copy's, bit for bit (the same tiles, laid out alike: the same products
in the same shapes). The plain attention still reads a gathered copy (its bits unchanged);
tiled and plain agree within test_tiled's tolerance, and their tokens by the near-tie rule
(test_tiled.test_the_engine_and_generate_take_it)."""
import numpy as np
import pytest

from minitransformer.backend import to_numpy, xp
from minitransformer.measure.timing import peak_bytes
from minitransformer.model import forward
from minitransformer.serve import paged
from minitransformer.serve.config import EngineConfig
from minitransformer.serve.engine import Engine
from minitransformer.serve.paged import PagedCache, RaggedView
from minitransformer.serve.records import Request
from test_tiled import assert_close

LENGTHS = (150, 70, 9)   # rows over 3, 2 and 1 tiles of 64 slots


def passes(model, cache, rng) -> list:
    """The same passes on a pool -> each pass's hidden states: three prompts prefilled (the
    causal tiles of a prefill), a decode step of rows of different lengths, and a ragged pass
    of two decodes beside a 5-token chunk of the third row."""
    V, out = model.config.vocab_size, []
    for s, n in enumerate(LENGTHS):
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
        cache = PagedCache.allocate(tiny_model.config, 400 // block_size + 8, block_size,
                                    kv_dtype, attention, in_place)
        cache.books.add("first", [2] * 7)          # so the rows' blocks are not 0, 1, 2, ...
        assert cache.in_place == (attention == "tiled" and in_place)
        return passes(tiny_model, cache, np.random.default_rng(0))
    in_place, gathered = run("tiled", True), run("tiled", False)
    for a, b in zip(in_place, gathered):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(in_place, run("plain", True)):    # the plain one: a gathered copy
        assert_close(a, b, xp.ones(1))


def gathers(model, cache, monkeypatch) -> list:
    """One decode step of the pool's rows -> the width (blocks) of every gather it made."""
    widths, gather = [], paged.gather
    monkeypatch.setattr(paged, "gather",
                        lambda pool, table, S: widths.append(table.shape[1]) or
                        gather(pool, table, S))
    ids = list(cache.books.seqs)
    forward(model, np.array([[3]] * len(ids)), cache.view(ids, cache.books.append(ids, 1)))
    monkeypatch.undo()
    return widths


@pytest.mark.parametrize("block_size", [4, 48])
def test_a_tile_gathers_only_the_blocks_its_slots_lie_in(tiny_model, block_size, monkeypatch):
    """A decode step over rows of 150 and 70 tokens: in place, every gather covers one tile's
    blocks (64 slots: at most 64 / bs + 1 blocks); gathered, one per layer covers every
    row's whole table."""
    L = tiny_model.config.num_hidden_layers
    for in_place in (True, False):
        cache = PagedCache.allocate(tiny_model.config, 200, block_size, attention="tiled",
                                    in_place=in_place)
        for s, n in enumerate(LENGTHS[:2]):
            cache.books.add(s, [1] * n, reuse=False)
            forward(tiny_model, np.ones((1, n), dtype=np.int64), cache.view([s]))
        widths = gathers(tiny_model, cache, monkeypatch)
        whole = cache.books.blocks_for(151)
        if in_place:
            assert max(widths) <= 64 // block_size + 1 < whole
            assert len(widths) == 2 * L * -(-151 // 64)       # K and V, every tile, every layer
        else:
            assert widths == [whole] * (2 * L)


def decode_peak(model, rows: int, n: int, in_place: bool) -> int:
    """Peak bytes a decode step allocates over `rows` rows of n tokens (held as if prefilled:
    the keys' values are moot here)."""
    cache = PagedCache.allocate(model.config, rows * 16 + 8, 16, attention="tiled",
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
def test_a_decode_in_place_holds_as_much_at_any_context(tiny_model):
    """8 rows of 120, then of 240 tokens. Gathered, the step's peak grows by at least the
    120 more tokens' keys and values of a layer (2 x 8 x Hkv x 120 x d floats: it holds them
    all at once); in place, by under a quarter of that (measured: under 1 KB, the block tables;
    its tiles are 64 slots whatever the context)."""
    c = tiny_model.config
    more = 2 * 8 * c.num_key_value_heads * 120 * c.head_dim * 4       # bytes, one layer
    growth = {in_place: decode_peak(tiny_model, 8, 240, in_place) -
              decode_peak(tiny_model, 8, 120, in_place) for in_place in (True, False)}
    assert growth[False] >= more
    assert growth[True] < more / 4


def test_the_engine_reads_in_place_when_it_attends_tile_by_tile(tiny_model, monkeypatch):
    """EngineConfig(attention="tiled"): its pool hands the blocks where they lie; the default,
    plain, gathers them."""
    for attention, in_place in (("tiled", True), ("plain", False)):
        engine = Engine(tiny_model, EngineConfig(max_num_seqs=2, num_gpu_blocks_override=40,
                                                 block_size=4, attention=attention))
        assert engine.cache.in_place is in_place
        seen, update = [], paged.PagedView.update
        monkeypatch.setattr(paged.PagedView, "update",
                            lambda *a: seen.append(update(*a)) or seen[-1])
        engine.run([Request(tuple(range(1, 90)), 3, eos_token_id=[])])
        monkeypatch.undo()
        assert seen and all(isinstance(k, paged.InPlace) is in_place for k, _ in seen)
