"""n parallel samples of one prompt: prefilled once, its blocks shared copy-on-write, sample i
the tokens a single request seeded seed + i gets (== in batch-invariant mode), each recording
its choice number. The blocks they may hold at once (``pool_need``) are the longest sequence's
or the prompt's with each sample's copy of its last block; more than the pool, and every
sample is refused."""
import importlib

import numpy as np
import pytest

import minitransformer as mt
import minitransformer.serve.runner as runner_module
from conftest import assert_like_solo
from engine_fuzz import check_pool, solo
from minitransformer.backend import to_numpy
from minitransformer.model import forward
from minitransformer.sampling import SamplingSettings
from minitransformer.serve.config import EngineConfig
from minitransformer.serve.engine import Engine
from minitransformer.serve.paged import PagedCache
from minitransformer.serve.records import Request

generate_module = importlib.import_module("minitransformer.generate")  # not the function

PROMPT = (5, 9, 2, 7, 7, 1, 30, 12, 4, 18)          # 10 tokens: 2 full blocks of 4 and a half
SAMPLED = SamplingSettings(do_sample=True, temperature=1.0)


def test_a_fork_shares_every_block_until_one_side_writes(tiny_model):
    cache = PagedCache.allocate(tiny_model.config, 12, block_size=4)
    cache.books.add("a", list(PROMPT))
    forward(tiny_model, np.array([PROMPT]), cache.view(["a"]))
    free = cache.books.num_free
    cache.books.fork("a", "b")
    assert cache.books.seqs["b"].blocks == cache.books.seqs["a"].blocks
    assert cache.books.num_free == free
    assert cache.books.refcount[cache.books.seqs["a"].blocks].tolist() == [2, 2, 2]
    before = [to_numpy(k).copy() for k in cache.k]
    cache.books.make_room(["b"], 1)       # b writes at position 10, in the shared half block
    cache.do(cache.books.take_moves())
    a, b = cache.books.seqs["a"].blocks, cache.books.seqs["b"].blocks
    assert a[:2] == b[:2] and a[2] != b[2] and cache.books.num_free == free - 1
    for k, old in zip(map(to_numpy, cache.k), before, strict=True):
        assert np.array_equal(k[b[2]], old[a[2]]) and np.array_equal(k[a[2]], old[a[2]])
    forward(tiny_model, np.array([[3]]), cache.view(["b"]))
    assert all(np.array_equal(k[a[2]], old[a[2]])
               for k, old in zip(map(to_numpy, cache.k), before, strict=True))
    with pytest.raises(ValueError, match="already in the cache"):
        cache.books.fork("a", "b")


@pytest.mark.parametrize("batch_invariant", [True, False])
def test_sample_i_is_the_single_request_seeded_seed_plus_i(tiny_model, batch_invariant):
    request = Request(PROMPT, 12, sampling=SAMPLED, seed=40, n=4, eos_token_id=[])
    run = Engine(tiny_model, EngineConfig(max_num_seqs=4, block_size=4,
                                          batch_invariant=batch_invariant)).run(
        [request])
    assert [r.choice for r in run.results] == [0, 1, 2, 3]
    for result in run.results:
        alone = solo(tiny_model, request, result.choice)
        assert alone == mt.generate(tiny_model, PROMPT, 12, sampling=SAMPLED,
                                    seed=40 + result.choice, eos_token_id=[])
        assert_like_solo(tiny_model, result.tokens, alone, PROMPT, SAMPLED,
                         40 + result.choice, batch_invariant, eos_token_id=[])
    assert len({tuple(r.tokens) for r in run.results}) > 1      # they are not one sample


def test_the_prompt_is_prefilled_once_and_shared(tiny_model, monkeypatch):
    calls = []
    for module in (runner_module, generate_module):    # prefills here, decodes in last_logits
        monkeypatch.setattr(module, "forward", lambda model, ids, *a, **k:
                            calls.append(ids.shape) or forward(model, ids, *a, **k))
    engine = Engine(tiny_model, EngineConfig(max_num_seqs=8, block_size=4), history=True)
    engine.submit(Request(PROMPT, 5, sampling=SAMPLED, seed=1, n=8, eos_token_id=[]))
    engine.step()
    assert calls == [(1, len(PROMPT))]                  # one prefill of the prompt
    assert engine.prefill_times[0][0] == len(PROMPT)
    stats = engine.cache.stats()
    assert stats.sequences == 8 and stats.blocks_held == 3 and stats.blocks_shared == 3
    check_pool(engine)
    engine.step()                                       # each writes its 2nd token: half
    assert calls[1] == (8, 1)                           # block copied by 7, kept by the last
    assert engine.cache.stats().blocks_held == 2 + 8
    while engine.running():
        engine.step()
        check_pool(engine)
    assert engine.cache.books.num_free == engine.cache.books.num_blocks


def test_greedy_samples_are_all_the_greedy_answer(tiny_model):
    run = Engine(tiny_model, EngineConfig(max_num_seqs=3, block_size=4)).run([Request(PROMPT, 6,
                                                                                      n=3)])
    assert [r.tokens for r in run.results] == [mt.generate(tiny_model, PROMPT, 6)] * 3


def test_samples_wait_for_enough_free_slots_and_survive_preemption(tiny_model):
    """Two requests of 2 samples through 3 slots and a tight pool: the second waits for two
    free slots; samples are preempted and swapped back in; every one is still its solo."""
    requests = [Request(PROMPT, 14, sampling=SAMPLED, seed=s, n=2, eos_token_id=[])
                for s in (100, 200)]
    engine = Engine(tiny_model, EngineConfig(max_num_seqs=3, num_gpu_blocks_override=9,
                                             block_size=4, batch_invariant=True))
    for request in requests:
        engine.submit(request)
    engine.step()
    assert len(engine.running()) == 2 and [seq.result.id for seq in engine.waiting] == [2, 3]
    while engine.waiting or engine.running():
        engine.step()
        check_pool(engine)
    assert engine.preemptions > 0
    for result in engine.results.values():
        assert result.tokens == solo(tiny_model, result.request, result.choice)


def test_cancelling_one_sample_leaves_the_others(tiny_model):
    engine = Engine(tiny_model, EngineConfig(max_num_seqs=2, block_size=4))
    busy = engine.submit(Request(PROMPT, 3, eos_token_id=[]))
    first = engine.submit(Request(PROMPT, 4, sampling=SAMPLED, seed=9, n=2, eos_token_id=[]))
    engine.step()                                       # two samples wait for two slots
    assert engine.cancel(first) and engine.results[first].status == "cancelled"
    assert len(engine.waiting) == 1 and engine.waiting[0].result.id == first + 1
    third = engine.submit(Request(PROMPT, 4, sampling=SAMPLED, seed=9, n=2, eos_token_id=[]))
    while engine.waiting or engine.running():
        engine.step()
        if engine.results[third].tokens and engine.results[third].status == "running":
            engine.cancel(third + 1)                    # one running sample of two
        check_pool(engine)
    assert engine.results[busy].status == engine.results[first + 1].status == "finished"
    assert engine.results[first + 1].tokens == solo(tiny_model, engine.results[first].request,
                                                    1)
    assert engine.results[third].status == "finished"
    assert engine.results[third + 1].status == "cancelled"
    assert engine.cache.books.num_free == engine.cache.books.num_blocks


def test_samples_of_a_chunked_prompt_wait_at_the_head_of_the_queue_for_its_end(tiny_model):
    """Prefilled in chunks of 4, 4 and 2, the prompt holds 1 slot; its 2 sharers wait at the
    head of the queue, so a later request finds the 2 free slots not for it; at the last
    chunk the samples fork; cancelling the prompt while it is prefilled makes the next
    sample the one that computes it, the last sharing its prompt instead."""
    engine = Engine(tiny_model, EngineConfig(max_num_seqs=3, block_size=4,
                                             max_num_batched_tokens=4))
    first = engine.submit(Request(PROMPT, 3, sampling=SAMPLED, seed=3, n=3, eos_token_id=[]))
    other = engine.submit(Request((1, 2), 2, eos_token_id=[]))
    engine.step()
    assert [live.result.id for live in engine.running()] == [first]
    assert engine.slots.count(None) == 2 and engine.results[other].status == "waiting"
    assert [seq.result.id for seq in engine.waiting] == [first + 1, first + 2, other]
    while not engine.results[first].tokens:
        engine.step()
        check_pool(engine)
    assert len(engine.running()) == 3 and engine.cache.stats().blocks_shared == 3
    while engine.waiting or engine.running():
        engine.step()
    for result in map(engine.results.get, range(first, first + 3)):   # chunked: near-tie, not ==
        assert result.prefill_chunks == 3 and len(result.tokens) == 3
        assert_like_solo(tiny_model, result.tokens, solo(tiny_model, result.request,
                                                         result.choice), PROMPT, SAMPLED,
                         3 + result.choice, batch_invariant=False, eos_token_id=[])
    engine = Engine(tiny_model, EngineConfig(max_num_seqs=3, block_size=4,
                                             max_num_batched_tokens=4))
    first = engine.submit(Request(PROMPT, 3, sampling=SAMPLED, seed=3, n=3, eos_token_id=[]))
    engine.step()
    assert engine.cancel(first) and engine.waiting[0].result.id == first + 1
    assert engine.waiting[0].shares_prompt_with is None
    assert engine.waiting[1].shares_prompt_with is engine.waiting[0]
    assert engine.cancel(first + 2) and len(engine.waiting) == 1
    while engine.waiting or engine.running():
        engine.step()
        check_pool(engine)
    assert [r.status for r in engine.results.values()] == ["cancelled", "finished", "cancelled"]
    assert engine.cache.books.num_free == engine.cache.books.num_blocks


@pytest.mark.parametrize("chunked", [False, True])
def test_cancelling_every_sample_at_any_step_frees_every_block(tiny_model, chunked):
    """What a request's holder does when its client leaves: cancel each of its samples. At
    every step of the request's life (queued, its prompt in chunks with the sharers queued,
    forked, decoding) the samples end cancelled, nothing of them stays queued or holds a
    block, and the request served beside them is its solo."""
    config = EngineConfig(max_num_seqs=4, block_size=4, num_gpu_blocks_override=12,
                          max_num_batched_tokens=5 if chunked else None, batch_invariant=True)
    busy = Request((1, 2, 3), 6, sampling=SAMPLED, seed=5, eos_token_id=[])
    for cancel_at in range(6):
        engine = Engine(tiny_model, config)
        engine.submit(busy)
        first = engine.submit(Request(PROMPT, 8, sampling=SAMPLED, seed=3, n=3,
                                      eos_token_id=[]))
        for _ in range(cancel_at):
            engine.step()
        for rid in range(first, first + 3):
            engine.cancel(rid)
        assert all(seq.result.id < first for seq in engine.waiting)
        assert [engine.results[i].status for i in range(first, first + 3)] == \
            ["cancelled"] * 3
        while engine.waiting or engine.running():
            engine.step()
            check_pool(engine)
        assert engine.cache.books.num_free == engine.cache.books.num_blocks, cancel_at
        assert engine.results[0].tokens == solo(tiny_model, busy)


@pytest.mark.parametrize("n", [0, -1, 3, True, 2.0, "2", None])
def test_a_bad_n_is_named(tiny_model, n):
    engine = Engine(tiny_model, EngineConfig(max_num_seqs=2))
    with pytest.raises(ValueError, match=r"n must be an integer in \[1, 2\]"):
        engine.submit(Request(PROMPT, 3, n=n))
    assert not engine.waiting and not engine.results


def test_samples_that_cannot_fit_the_pool_are_rejected(tiny_model):
    """4 samples of a 10-token prompt need its 3 blocks and 3 more for the copies."""
    run = Engine(tiny_model, EngineConfig(max_num_seqs=4, num_gpu_blocks_override=5,
                                          block_size=4)).run(
        [Request(PROMPT, 1, n=4), Request(PROMPT, 1, n=2)])
    assert [r.status for r in run.results] == ["rejected"] * 4 + ["finished"] * 2
    assert "needs up to 6 blocks" in run.results[0].reason


@pytest.mark.parametrize("prompt, new, n, need", [
    (7, 1, 1, 2),    # 8 tokens: 2 blocks of 4
    (7, 1, 3, 4),    # the prompt's last block and its first token, then a copy per sample
    (8, 1, 3, 5),    # 9 tokens: 3 blocks, and each of the 2 other samples its own copy
    (3, 10, 2, 4),   # the longest sequence, 13 tokens, outweighs the copies
    (4, 1, 1, 2),    # the first new token opens a block of its own
])
def test_pool_need_is_the_longest_sequence_or_the_prompt_with_each_samples_copy(
        tiny_model, prompt, new, n, need):
    engine = Engine(tiny_model, EngineConfig(max_num_seqs=4, block_size=4, num_gpu_blocks_override=32))
    assert engine.pool_need(Request(tuple(range(1, prompt + 1)), new, n=n)) == need


def test_pool_need_counts_one_sample_by_default(tiny_model):
    engine = Engine(tiny_model, EngineConfig(max_num_seqs=4, block_size=4,
                                             num_gpu_blocks_override=32))
    assert engine.pool_need(Request((1,) * 8, 1)) == 3
    assert engine.pool_need(Request((1,) * 7, 1)) == 2


def test_a_request_of_n_samples_is_refused_when_their_copies_do_not_fit(tiny_model):
    """7 prompt tokens, 3 samples, 1 new token each: 4 blocks of 4, one more than the pool's
    3, so every sample is rejected (one sample alone fits)."""
    config = EngineConfig(max_num_seqs=3, block_size=4, num_gpu_blocks_override=3)
    run = Engine(tiny_model, config).run([Request(tuple(range(1, 8)), 1, n=3,
                                                  eos_token_id=[])])
    assert [r.status for r in run.results] == ["rejected"] * 3
    assert run.results[0].reason == "needs up to 4 blocks of 4 tokens; the pool has 3"
    alone = Engine(tiny_model, config).run([Request(tuple(range(1, 8)), 1, eos_token_id=[])])
    assert alone.results[0].status == "finished"


def test_each_sample_records_which_choice_it_is(tiny_model):
    run = Engine(tiny_model, EngineConfig(max_num_seqs=3)).run(
        [Request((1, 2, 3), 2, n=3, seed=5, sampling=SamplingSettings(temperature=1.0),
                 eos_token_id=[])])
    assert [r.choice for r in run.results] == [0, 1, 2]
