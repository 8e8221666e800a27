"""Attention on the threads (kernels/attention.py): in parts across sequences or kv heads, bit for
bit the whole, on the pool's threads with BLAS at one, and cut only where measured faster.
Nothing here depends on the machine's cores or on a clock: the counts are set, and the clock of
the measured choice is the test's own."""
import functools
import threading

import numpy as np
import pytest
import threadpoolctl

from minitransformer.backend import to_device, to_numpy, xp
from minitransformer.kernels import attention, blas, threads
from minitransformer.kvquant import QuantizedArray, dequantize, on_floats, quantize
from minitransformer.model import causal_mask, plain_attention
from minitransformer.serve.paged import InPlace
from minitransformer.tiled import CausalTiles, tiled_attention, two_pass_attention

# (B, T, H, Hkv, S): sequences enough for a part each, or one sequence cut by kv heads (3 of
# them into 2 parts: 2 and 1, SmolLM2's), a decode and a prompt's several queries
SHAPES = [(3, 1, 6, 3, 40), (1, 1, 6, 3, 40), (4, 5, 4, 2, 37), (1, 7, 9, 3, 30)]
WAYS = {
    "plain": (plain_attention, causal_mask),
    "two-pass": (functools.partial(two_pass_attention, tile=16), causal_mask),  # several tiles
    "tiled": (functools.partial(tiled_attention, block=8), CausalTiles),
}


def operands(B, T, H, Hkv, S, d=8, seed=0):
    """q, k, v and the queries' positions (the last T of S, each row a different length)."""
    g = np.random.default_rng(seed)
    q, k, v = (to_device(g.standard_normal(s, dtype=np.float32))
               for s in ((B, T, H, d), (B, Hkv, S, d), (B, Hkv, S, d)))
    lengths = S - np.arange(B) % 3                                   # rows of 3 lengths
    positions = to_device(lengths[:, None] - T + np.arange(T))       # (B, T)
    return q, k, v, positions


def held(k, kind: str):
    """k as a cache holds it: floats, q8_0 codes and scales, or a pool's blocks left in place."""
    if kind == "floats":
        return k
    if kind == "q8_0":
        return quantize(k, "q8_0")
    B, Hkv, S, d = k.shape
    bs = 4
    nb = -(-S // bs)
    blocks = xp.zeros((B * nb + 1, Hkv, bs, d), xp.float32)          # block 0 unused
    table = 1 + np.arange(B * nb)[::-1].reshape(B, nb)               # rows' blocks, out of order
    padded = xp.zeros((B, Hkv, nb * bs, d), xp.float32)
    padded[:, :, :S] = k
    blocks[to_device(table)] = padded.reshape(B, Hkv, nb, bs, d).transpose(0, 2, 1, 3, 4)
    return InPlace(blocks, to_device(table), S)


def same_bits(a, b) -> bool:
    a, b = to_numpy(a), to_numpy(b)
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


# what each way is given: the plain one floats or a quantized cache (a pool's blocks it reads
# gathered), the tiled ones those or a pool's blocks in place too
@pytest.mark.parametrize("way, kind", [(way, kind) for way in sorted(WAYS)
                                       for kind in ("floats", "q8_0", "in place")
                                       if (way, kind) != ("plain", "in place")])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("count", [2, 3])
def test_attention_in_parts_is_the_whole_bit_for_bit(shape, way, kind, count):
    """Every part makes the whole's calls on its sequences or kv heads: the same bits, whatever
    the cut (2 or 3 parts, equal or not), the way, and what holds the keys."""
    attend, mask = WAYS[way]
    if kind != "floats" and way == "plain":
        attend = on_floats(attend)                   # as tiled.ATTENTIONS['plain'] reads a cache
    q, k, v, positions = operands(*shape)
    k, v = held(k, kind), held(v, kind)
    visible = mask(positions, shape[-1])
    whole = attend(q, k, v, visible)
    assert same_bits(attention.in_parts(attend, q, k, v, visible, count), whole)


@pytest.mark.parametrize("shape", SHAPES[:2], ids=["sequences", "kv heads"])
def test_on_threads_runs_the_parts_on_the_pool_with_blas_at_one_thread(step_threads, shape):
    """At 2 threads (step_threads: MT_SPLIT=parts) the parts run on the caller's thread and the
    pool's worker, BLAS at one thread in each; at 1, whole on the caller's. The same bits."""
    libraries = threadpoolctl.ThreadpoolController().select(user_api="blas").lib_controllers
    seen = []

    def spy(q, k, v, visible):
        seen.append((threading.current_thread().name, q.shape,
                     {lib.get_num_threads() for lib in libraries}))
        return plain_attention(q, k, v, visible)
    q, k, v, positions = operands(*shape)
    visible = causal_mask(positions, shape[-1])
    got = attention.on_threads(spy)(q, k, v, visible)
    assert same_bits(got, plain_attention(q, k, v, visible))
    names = sorted(name for name, _, _ in seen)
    here = threading.current_thread().name
    assert names == ([here] if step_threads == 1 else sorted([here, "product-part-1"]))
    assert all(counts <= {1} for _, _, counts in seen)
    if step_threads == 2:
        B, T, H, Hkv, _ = shape
        parts = sorted(q_shape for _, q_shape, _ in seen)
        assert parts == ([(1, T, H, 8), (2, T, H, 8)] if B == 3 else   # 3 sequences: 2 and 1
                         [(1, T, H // Hkv, 8), (1, T, 2 * H // Hkv, 8)])  # 3 kv heads


class Clock:
    """A clock that moves only when attention runs: a whole pass costs `whole`, each part
    `part` (the parts' costs summed: what the measured choice compares is the test's own)."""
    def __init__(self, whole, part):
        self.now, self.whole, self.part = 0.0, whole, part
        self.lock = threading.Lock()

    def perf_counter(self):
        return self.now

    def attend(self, q, k, v, visible):
        with self.lock:                                   # parts run on two threads
            self.now += self.whole if q.shape[0] == 3 else self.part
        return plain_attention(q, k, v, visible)


@pytest.mark.parametrize("whole, part, kept", [(10.0, 4.0, 2), (10.0, 6.0, 1)])
def test_a_kind_of_pass_is_cut_only_where_measured_faster(monkeypatch, whole, part, kept):
    """The first TRIALS passes of a kind alternate whole and in parts (threads.whole_or_parts),
    then the faster is kept (the parts only at SPLIT_GAIN of the whole's or less: 8 of 10 is,
    12 of 10 is not), and every later pass of that kind is made so, measuring no more."""
    clock = Clock(whole, part)
    monkeypatch.setattr(threads, "time", clock)
    monkeypatch.setattr(blas, "FIXED_SPLIT", None)
    monkeypatch.setattr(threads, "taken", {})
    monkeypatch.setattr(threads, "timings", {})
    attend = attention.on_threads(clock.attend)
    q, k, v, positions = operands(3, 1, 6, 3, 40)
    visible = causal_mask(positions, 40)
    with threads.using(2):
        made = []
        for _ in range(2 * threads.TRIALS + 3):
            before = clock.now
            assert same_bits(attend(q, k, v, visible), plain_attention(q, k, v, visible))
            made.append(1 if clock.now - before == whole else 2)
    assert made[:2 * threads.TRIALS] == [1, 2] * threads.TRIALS      # alternating, timed
    assert made[2 * threads.TRIALS:] == [kept] * 3
    assert list(threads.taken.values()) == [kept] and threads.timings == {}


def test_one_blas_thread_nests_and_puts_blas_back_once_the_last_closes():
    libraries = threadpoolctl.ThreadpoolController().select(user_api="blas").lib_controllers
    if not libraries:
        pytest.skip("no BLAS library loaded")

    def counts():
        return {lib.get_num_threads() for lib in libraries}

    with threadpoolctl.threadpool_limits(2, user_api="blas"):
        with threads.one_blas_thread():
            with threads.one_blas_thread():
                assert counts() == {1}
            assert counts() == {1}, "an inner block closing put BLAS back while the outer held it"
        assert counts() == {2}


def test_a_quantized_cache_and_a_pool_in_place_are_cut_as_arrays():
    """What a part takes of the keys: rows and kv heads of codes and scales alike, of a pool's
    block table and its blocks' heads; never a copy of the context."""
    k = operands(2, 1, 4, 2, 9)[1]
    for kind in ("q8_0", "in place"):
        part = held(k, kind)[1:2, 1:2]
        assert isinstance(part, QuantizedArray if kind == "q8_0" else InPlace)
        assert part.shape == (1, 1, 9, 8)
        got = dequantize(part if kind == "q8_0" else part[:, :, 0:9])
        np.testing.assert_allclose(to_numpy(got), to_numpy(k[1:2, 1:2]), atol=0.05)


def test_a_hold_in_a_thread_not_the_main_one_holds_blas_at_one_there_and_in_its_parts():
    """A server's engine loop runs in a thread of its own: a hold there, and the parts it hands
    the pool, run BLAS at one thread while BLAS's own count is 2 (OpenBLAS 0.3.31 ignores
    openblas_set_num_threads called from such a thread: every product ran on BLAS's own
    threads, 5-10x slower at 2 threads than at 1), and BLAS's count is as it was after."""
    libraries = threadpoolctl.ThreadpoolController().select(user_api="blas").lib_controllers
    if not libraries:
        pytest.skip("no BLAS library loaded")
    counts = lambda: {lib.get_num_threads() for lib in libraries}  # noqa: E731
    seen = {}

    def loop():
        with threads.one_blas_thread():
            seen["held"] = counts()
            threads.pool.run([lambda: seen.setdefault("caller's part", counts()),
                              lambda: seen.setdefault("worker's part", counts())])
        seen["after"] = counts()
    with threads.using(2):
        thread = threading.Thread(target=loop)
        thread.start()
        thread.join()
        assert counts() == {2}
    assert seen == {"held": {1}, "caller's part": {1}, "worker's part": {1}, "after": {2}}
