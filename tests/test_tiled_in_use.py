"""attention="tiled" is in use where it is asked for: the tiled function runs (and the plain
one does not) in every layer of forward, generate and the engine, and a forward pass holds far
less than one layer's score matrix, where the plain one holds more.

test_tiled.py shows the tiled function computes the plain one's numbers; those tests pass just
as well if forward quietly ran the plain attention. These observe which function ran (Python's
profiler hook, by code object) and what the pass allocated (tracemalloc's peak: NumPy's
allocations, counted exactly, the same figure on every run; no timing).
"""
import sys
from collections import Counter

import numpy as np
import pytest

import minitransformer as mt
from minitransformer import model as model_module
from minitransformer import tiled
from minitransformer.backend import xp
from minitransformer.checkpoints.synth import make_checkpoint, qwen2_config
from minitransformer.kvcache import KVCache
from minitransformer.measure.timing import peak_bytes
from minitransformer.model import forward
from minitransformer.serve.config import EngineConfig
from minitransformer.serve.engine import Engine
from minitransformer.serve.records import Request

WATCHED = {"plain": model_module.plain_attention.__code__,
           "tiled": tiled.tiled_attention.__code__,
           "tile of mask": tiled.CausalTiles.__getitem__.__code__,
           "whole mask": model_module.causal_mask.__code__}


def calls(fn) -> Counter:
    """Run fn(); -> how many times each WATCHED function was entered meanwhile."""
    entered = Counter()
    names = {code: name for name, code in WATCHED.items()}

    def profile(frame, event, arg):
        if event == "call" and frame.f_code in names:
            entered[names[frame.f_code]] += 1
    profiler = sys.getprofile()                 # a profiler's or a debugger's, put back after
    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(profiler)
    return entered


def test_forward_runs_the_tiled_function_in_every_layer(tiny_model):
    """Prefill of two rows (a causal mask, made a tile at a time), then one decode step over a
    cache of rows of different lengths; each pass enters tiled_attention once per layer."""
    L = tiny_model.config.num_hidden_layers
    ids = np.random.default_rng(0).integers(0, tiny_model.config.vocab_size, (2, 9))
    tiled_run = calls(lambda: forward(tiny_model, ids, way=tiled.TILED))
    assert tiled_run["tiled"] == L and tiled_run["plain"] == 0
    assert tiled_run["tile of mask"] > 0 and tiled_run["whole mask"] == 0
    plain_run = calls(lambda: forward(tiny_model, ids))          # the observation can tell
    assert plain_run["plain"] == L and plain_run["tiled"] == 0 and plain_run["whole mask"] == 1

    cache = KVCache.allocate(tiny_model.config, 2, 16, attention="tiled")
    cache.lengths[:] = [0, 3]
    forward(tiny_model, ids[:, :5], cache)
    step = calls(lambda: forward(tiny_model, ids[:, 5:6], cache))
    assert step["tiled"] == L and step["plain"] == 0


def test_a_causal_prefill_computes_only_the_tiles_it_can_see(monkeypatch):
    """256 queries over 256 keys in tiles of 64: of the 4 x 4 (query, key) tiles, the 6 above
    the diagonal are every query's future and are skipped; each of the 10 others is computed,
    making its tile of the mask. One decode query at the last position sees all 4 key tiles."""
    made = []
    make = tiled.CausalTiles.__getitem__
    monkeypatch.setattr(tiled.CausalTiles, "__getitem__",
                        lambda self, index: made.append(index[1:]) or make(self, index))
    rng = np.random.default_rng(0)
    n, d = 256, 8
    k, v = (xp.asarray(rng.standard_normal((1, 1, n, d), dtype=np.float32)) for _ in "kv")
    for T in (n, 1):
        made.clear()
        q = xp.asarray(rng.standard_normal((1, T, 1, d), dtype=np.float32))
        positions = xp.arange(n - T, n)[None]                               # (1, T)
        tiled.tiled_attention(q, k, v, tiled.CausalTiles(positions, n))
        tiles = sorted((queries.start // 64, keys.start // 64) for queries, keys in made)
        assert tiles == ([(i, j) for i in range(4) for j in range(i + 1)] if T == n else
                         [(0, j) for j in range(4)])


def test_generate_and_the_engine_pass_it_down(tiny_model):
    """Every forward pass generate and the engine make runs the tiled function, none the
    plain one: prefill and each decode step, with and without the cache."""
    prompt, n = [5, 6, 7, 8, 9], 4
    L = tiny_model.config.num_hidden_layers
    for cache in (True, False):
        run = calls(lambda: mt.generate(tiny_model, prompt, n, eos_token_id=[], cache=cache,
                                        attention="tiled"))
        assert run["plain"] == 0 and run["tiled"] == n * L      # n passes: prefill + n-1 steps
    engine = Engine(tiny_model, EngineConfig(max_num_seqs=2, num_gpu_blocks_override=8,
                                             block_size=4, attention="tiled"))
    run = calls(lambda: engine.run([Request(tuple(prompt), n, eos_token_id=[])]))
    assert run["plain"] == 0 and run["tiled"] >= n * L


# One layer of a tiny Qwen2 (4 query heads over 2 kv heads, head_dim 8) with room for 512
# positions: a causal prefill of T = 512 tokens makes scores of 4 x 512 x 512 float32 = 4 MiB.
T = 512


@pytest.fixture(scope="module")
def long_model(tmp_path_factory):
    config = qwen2_config(max_position_embeddings=T, num_hidden_layers=1)
    return mt.load(make_checkpoint(tmp_path_factory.mktemp("long") / "m", config, seed=3))


@pytest.mark.skipif(xp is not np, reason="tracemalloc sees NumPy's allocations only")
def test_a_tiled_forward_never_holds_the_score_matrix(long_model):
    """The plain pass holds the scores and their softmax at once (measured 13.3 MB, > 3 x the
    4 MiB of scores); the tiled one measured 0.76 MB, which is the pass's other activations
    (qkv, the MLP's 512 x 128 gate_up, the residual stream: each O(T), together ~0.5 MB) and
    tiles of 4 x 64 x 64 floats (64 KB). The bound, a quarter of the score matrix, sits between
    the two with room for an allocator's rounding; holding the scores once breaks it."""
    c = long_model.config
    scores = c.num_attention_heads * T * T * 4                     # one layer's, float32
    ids = (np.arange(T) % c.vocab_size)[None]                      # (1, T)
    plain = peak_bytes(lambda: forward(long_model, ids)).peak_bytes
    tiled_peak = peak_bytes(lambda: forward(long_model, ids, way=tiled.TILED)).peak_bytes
    assert plain > 2 * scores                                      # plain: scores + weights
    assert tiled_peak < scores / 4
