"""The serving engine changes no token: every request gets what decoding it alone gives, bit for
bit in batch-invariant mode, up to near ties in the default fast mode (conftest's policy).

Scenarios, one situation each; random workloads are the fuzz's (tests/serve/test_engine_fuzz.py)."""
import math
from itertools import pairwise

import numpy as np
import pytest

import minitransformer as mt
from conftest import assert_like_solo
from engine_fuzz import solo
from minitransformer.generate import generate
from minitransformer.sampling import SamplingSettings
from minitransformer.serve.config import EngineConfig
from minitransformer.serve.engine import Engine
from minitransformer.serve.records import Request, Result, metrics


def assert_solo(model, results, batch_invariant=False):
    """Each result's tokens against its request's solo tokens, by the exactness policy: ==
    in batch-invariant mode for a prompt prefilled whole with nothing cached, else the
    near-tie rule."""
    for result in results:
        r, s = result.request, result.request.sampling
        assert_like_solo(model, result.tokens, solo(model, r), r.prompt, s, r.seed,
                         batch_invariant and not result.cached_tokens
                         and result.prefill_chunks <= 1, eos_token_id=r.eos_token_id)


def assert_pool_whole(engine):
    """Nothing held, every block free; the prefix cache keeps only unheld blocks."""
    cache = engine.cache
    assert cache.books.num_free == cache.books.num_blocks and not cache.books.refcount.any()
    assert not cache.books.seqs and not any(engine.slots) and not engine.waiting
    assert set(cache.books.index.unheld) == set(cache.books.index.name_of)
    cache.books.check()


def test_shared_prefix_holds_the_expected_fewer_blocks(tiny_model):
    stem = list(range(1, 13))                              # three blocks of 4
    requests = [Request(tuple(stem + [40, 41]), 3, eos_token_id=[]),
                Request(tuple(stem + [50]), 3, eos_token_id=[])]
    held = {}
    for share in (True, False):
        engine = Engine(tiny_model, EngineConfig(max_num_seqs=2, num_gpu_blocks_override=20,
                                                  block_size=4, enable_prefix_caching=share),
                        history=True)
        run = engine.run(requests)
        held[share] = run.memory[0].blocks_held           # both admitted in the first step
        assert run.results[1].cached_tokens == (12 if share else 0)
        assert_solo(tiny_model, run.results)
        assert_pool_whole(engine)
    assert held[False] - held[True] == 3


def test_pool_exhaustion_preempts_and_resumes_without_losing_anything(tiny_model):
    rng = np.random.default_rng(1)
    requests = [Request(tuple(rng.integers(0, 96, 6).tolist()), 26, eos_token_id=[],
                        sampling=SamplingSettings(do_sample=True), seed=i) for i in range(4)]
    engine = Engine(tiny_model, EngineConfig(max_num_seqs=4, num_gpu_blocks_override=12,
                                             block_size=4))  # 4 x 8 blocks wanted
    run = engine.run(requests)
    assert run.preemptions > 0
    assert all(r.status == "finished" for r in run.results)
    assert_solo(tiny_model, run.results)
    assert_pool_whole(engine)


def test_a_request_waits_while_the_pool_is_short(tiny_model):
    a = Request((1, 2, 3, 4, 5, 6, 7, 8), 8, eos_token_id=[])  # up to 4 blocks of 4
    b = Request((9, 10, 11, 12, 13, 14, 15, 16), 8, eos_token_id=[])
    engine = Engine(tiny_model, EngineConfig(max_num_seqs=2, num_gpu_blocks_override=4,
                                             block_size=4))
    run = engine.run([a, b])
    assert run.preemptions == 0
    assert run.results[1].first_token > run.results[0].ended  # b waited for a's blocks
    assert_solo(tiny_model, run.results)
    assert_pool_whole(engine)


def test_a_prompt_cached_in_full_is_admitted_again_into_a_pool_its_exact_size(tiny_model):
    """8 tokens in blocks of 4 fill 2 blocks and the answer a third: the pool's size. Asked
    again, the prompt is cached in full; the copy of its last block and the answer's block are
    never held together, so it fits, and gives the same token from its cached blocks."""
    engine = Engine(tiny_model, EngineConfig(max_num_seqs=1, block_size=4,
                                             num_gpu_blocks_override=3))
    prompt = tuple(range(1, 9))
    results = [engine.run([Request(prompt, 1, eos_token_id=[])]).results[-1] for _ in range(3)]
    assert [r.cached_tokens for r in results] == [0, 7, 7]
    assert len({tuple(r.tokens) for r in results}) == 1
    assert_pool_whole(engine)


def test_a_prompt_cached_in_full_behind_the_chunk_filling_its_last_block_reads_it_filled(
        tiny_model):
    """Two requests of one 8-token prompt (blocks of 4) arrive together, nothing decoding:
    the first's chunk names both its blocks when planned, so the second, admitted behind it in
    the same step, finds its prompt cached in full and computes its last token in a copy of
    the last block, the block the first's chunk is writing. The copy is of that block
    written (a step's passes in one forward pass would copy it first, unwritten): both get
    their solo tokens."""
    prompt = (60, 3, 44, 21, 7, 50, 11, 26)
    requests = [Request(prompt, 8, eos_token_id=[]) for _ in range(2)]
    engine = Engine(tiny_model, EngineConfig(max_num_seqs=2, block_size=4,
                                             num_gpu_blocks_override=16))
    run = engine.run(requests)
    assert [r.cached_tokens for r in run.results] == [0, 7]
    assert run.results[0].first_token == run.results[1].first_token   # one step
    assert_solo(tiny_model, run.results)
    assert_pool_whole(engine)


def test_a_request_longer_than_the_pool_is_rejected_and_the_rest_served(tiny_model):
    ok = Request((1, 2, 3), 5, eos_token_id=[])
    huge = Request(tuple(range(1, 30)), 20, eos_token_id=[])  # 49 tokens > 8 blocks x 4
    engine = Engine(tiny_model, EngineConfig(max_num_seqs=2, num_gpu_blocks_override=8,
                                             block_size=4))
    run = engine.run([ok, huge])
    assert run.results[1].status == "rejected" and run.results[1].tokens == []
    assert "13 blocks" in run.results[1].reason and "pool has 8" in run.results[1].reason
    assert run.results[1].returned == 0.0                   # answered at once
    assert run.results[0].status == "finished"
    assert_solo(tiny_model, run.results[:1])
    assert_pool_whole(engine)


def test_cancel_waiting_running_and_finished_requests(tiny_model):
    requests = [Request((1, 2, 3), 20, eos_token_id=[]), Request((4, 5), 20, eos_token_id=[]),
                Request((6,), 1, eos_token_id=[])]
    engine = Engine(tiny_model, EngineConfig(max_num_seqs=1, num_gpu_blocks_override=16,
                                             block_size=4))
    ids = [engine.submit(r) for r in requests]
    for _ in range(5):
        engine.step()                                       # request 0 runs, 1 and 2 wait
    assert engine.cancel(ids[1]) is True                    # waiting: leaves with no tokens
    assert engine.cancel(ids[0]) is True                    # running: stops, keeps its tokens
    assert engine.cache.books.num_free == 16                      # its blocks are back at once
    r0, r1 = engine.results[0], engine.results[1]
    assert (r0.status, r1.status) == ("cancelled", "cancelled") and r1.tokens == []
    assert len(r0.tokens) == 5                              # a prefix of its solo tokens:
    assert_like_solo(tiny_model, r0.tokens, solo(tiny_model, requests[0])[:5], (1, 2, 3),
                     eos_token_id=[])
    while engine.waiting or engine.running():
        engine.step()
    assert engine.results[2].status == "finished"
    assert_solo(tiny_model, list(engine.results.values())[2:])
    assert engine.cancel(ids[2]) is False and engine.cancel(99) is False
    assert_pool_whole(engine)


def test_cancelling_the_last_member_ends_a_static_batch(tiny_model):
    requests = [Request((1, 2), 2, eos_token_id=[]), Request((3, 4), 30, eos_token_id=[]),
                Request((5, 6), 3, eos_token_id=[])]
    engine = Engine(tiny_model, EngineConfig(max_num_seqs=2, num_gpu_blocks_override=12,
                                             block_size=4, policy="static"))
    for r in requests:
        engine.submit(r)
    for _ in range(4):
        engine.step()               # request 0 finished after 2 steps: now a padding row
    assert engine.slots[0].padding and math.isnan(engine.results[0].returned)
    engine.cancel(1)                # the batch's last running member
    while engine.waiting or engine.running():
        engine.step()
    r0, r1, r2 = engine.results.values()
    assert (r0.status, r1.status, r2.status) == ("finished", "cancelled", "finished")
    assert r0.returned <= r2.first_token
    assert_solo(tiny_model, [r2])
    assert_pool_whole(engine)


def test_cancelling_the_last_static_member_with_nothing_waiting_returns_the_batch(tiny_model):
    # once a bug: the finished padding member was never freed nor returned (returned nan, its
    # blocks held, metrics' latency nan) when nothing waited to start a next step
    requests = [Request((1, 2), 2, eos_token_id=[]), Request((3, 4), 30, eos_token_id=[])]
    engine = Engine(tiny_model, EngineConfig(max_num_seqs=2, num_gpu_blocks_override=12,
                                             block_size=4, policy="static"))
    for r in requests:
        engine.submit(r)
    for _ in range(4):
        engine.step()
    assert engine.slots[0].padding and math.isnan(engine.results[0].returned)
    assert engine.cancel(1) is True
    assert not engine.waiting and not engine.running()      # no further step will run
    r0, r1 = engine.results.values()
    assert r0.status == "finished" and r0.returned == r1.returned == engine.clock
    assert math.isfinite(metrics(engine.results.values()).latency_mean)
    assert_pool_whole(engine)


def test_static_admits_only_when_every_slot_is_free(tiny_model):
    requests = [Request((i + 1,), n, eos_token_id=[]) for i, n in enumerate([2, 6, 2, 2])]
    static = Engine(tiny_model, EngineConfig(max_num_seqs=2, policy="static"),
                    history=True).run(requests)
    cont = Engine(tiny_model, EngineConfig(max_num_seqs=2, policy="continuous"),
                  history=True).run(requests)
    assert (static.steps, cont.steps) == (8, 6)  # 6 + 2 steps vs slot 0 reused twice
    # static computes a finished member's row as padding until its batch ends
    assert [B for B, _ in static.decode_times] == [2] * 6
    assert [B for B, _ in cont.decode_times] == [2, 1, 2, 1, 2]  # newcomers prefill first
    s, c = static.results, cont.results
    assert s[2].first_token > s[1].ended and c[2].first_token < c[1].ended
    assert s[0].returned == s[1].returned > s[0].ended   # returned with its batch
    assert c[0].returned == c[0].ended
    assert_solo(tiny_model, s)
    assert_solo(tiny_model, c)


def test_zero_tokens_and_model_eos_behave_like_generate(tiny_model):
    requests = [Request((3, 4), 0), Request((1, 2, 3), 40)]  # model's eos stops the second
    run = Engine(tiny_model, EngineConfig(max_num_seqs=2)).run(requests)
    assert run.results[0].status == "finished" and run.results[0].tokens == []
    assert_solo(tiny_model, run.results)


def test_late_arrivals_wait_for_their_time(tiny_model, monkeypatch):
    """The engine's clock stopped (every step lasts 0 s), so that only waiting moves it: the
    first request is served at 0, the engine then idles to the late one's arrival, and the
    late one's first token is made there, not before."""
    from types import SimpleNamespace

    from minitransformer.serve import engine as engine_module
    monkeypatch.setattr(engine_module, "time", SimpleNamespace(perf_counter=lambda: 0.0))
    requests = [Request((1, 2), 3, arrival=0.0, eos_token_id=[]),
                Request((3, 4), 3, arrival=100.0, eos_token_id=[])]
    run = Engine(tiny_model, EngineConfig(max_num_seqs=2)).run(requests)
    early, late = run.results
    assert early.first_token == early.ended == 0.0
    assert late.first_token == late.ended == 100.0 and late.ttft == 0.0
    assert run.elapsed == 100.0 and len(late.tokens) == 3


def test_bad_settings_and_requests_are_refused(tiny_model):
    with pytest.raises(ValueError, match="policy"):
        Engine(tiny_model, EngineConfig(policy="fifo"))
    with pytest.raises(ValueError, match="max_num_seqs"):
        Engine(tiny_model, EngineConfig(max_num_seqs=0))
    with pytest.raises(ValueError, match="block_size"):
        Engine(tiny_model, EngineConfig(block_size=0))
    with pytest.raises(ValueError, match="num_gpu_blocks_override"):
        Engine(tiny_model, EngineConfig(num_gpu_blocks_override=2.5))
    engine = Engine(tiny_model)
    with pytest.raises(ValueError, match="seed"):
        engine.submit(Request((1, 2), 3, seed="x"))
    with pytest.raises(ValueError, match="token ids"):
        engine.submit(Request((1, 96), 3))
    with pytest.raises(ValueError, match="positions"):
        engine.submit(Request((1, 2), 10_000))
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.submit(Request((1, 2), -1))
    assert engine.results == {} and not engine.waiting


BAD_REQUESTS = [  # each a ValueError naming the field, at submission
    (dict(sampling=None), "sampling"),
    (dict(sampling={"do_sample": True}), "sampling"),
    (dict(arrival="1"), "arrival"),
    (dict(arrival=math.nan), "arrival"),
    (dict(arrival=math.inf), "arrival"),
    (dict(arrival=-1.0), "arrival"),
    (dict(arrival=True), "arrival"),
    (dict(seed=-1), "seed"),
    (dict(seed=1.5), "seed"),
    (dict(seed="x"), "seed"),
    (dict(prompt=()), "prompt"),
    (dict(prompt=None), "prompt"),
    (dict(prompt=("a", "b")), "token ids"),
    (dict(prompt=(1.0, 2.0)), "token ids"),
    (dict(prompt=(1, 96)), "token ids"),
    (dict(max_new_tokens=2.5), "max_new_tokens"),
    (dict(max_new_tokens=None), "max_new_tokens"),
    (dict(max_new_tokens=True), "max_new_tokens"),
    (dict(eos_token_id="x"), "eos_token_id"),
    (dict(eos_token_id=2.7), "eos_token_id"),
    (dict(eos_token_id={}), "eos_token_id"),
]


@pytest.mark.parametrize("fields, named", BAD_REQUESTS)
def test_a_malformed_request_is_refused_at_submission_holding_nothing(checkpoint_dir, fields,
                                                                    named):
    model = mt.load(checkpoint_dir("llama-gqa"))
    engine = Engine(model, EngineConfig(max_num_seqs=2, num_gpu_blocks_override=8, block_size=4))
    request = Request(**({"prompt": (1, 2), "max_new_tokens": 3} | fields))
    with pytest.raises(ValueError, match=named):
        engine.submit(request)
    with pytest.raises(ValueError, match=r"requests\[1\]: .*" + named):
        engine.run([Request((1, 2), 3), request])
    assert engine.results == {} and engine.steps == 0        # nothing queued, nothing run
    assert_pool_whole(engine)


@pytest.mark.parametrize("sizes", [dict(num_gpu_blocks_override=10**12),
                                   dict(max_num_seqs=10**7),
                                   dict(max_num_seqs=10**12, num_gpu_blocks_override=4)], ids=str)
def test_a_pool_larger_than_memory_is_refused_before_allocating(tiny_model, sizes,
                                                                monkeypatch):
    """Refused by arithmetic on the sizes: the pool's allocation is never entered, and
    nothing else of size is allocated either (tracemalloc's peak)."""
    import tracemalloc

    from minitransformer.serve.paged import PagedCache
    entered = []
    monkeypatch.setattr(PagedCache, "allocate", staticmethod(lambda *a: entered.append(a)))
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match=r"need [\d,]+ bytes .* more than the [\d,]+ "
                                             r"bytes of (physical|free GPU) memory"):
            Engine(tiny_model, EngineConfig(**sizes))
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert entered == [] and peak < 2**20   # nothing was allocated


def test_only_requests_are_served(tiny_model):
    with pytest.raises(ValueError, match="Request"):
        Engine(tiny_model).submit({"prompt": (1, 2), "max_new_tokens": 3})


def test_run_is_atomic_and_serves_each_request_once(tiny_model):
    # once a bug: a bad request after a good one left the good one queued, served twice later
    good = Request((1, 2, 3), 4, eos_token_id=[])
    engine = Engine(tiny_model, EngineConfig(max_num_seqs=2, num_gpu_blocks_override=8,
                                             block_size=4))
    with pytest.raises(ValueError, match=r"requests\[1\]: arrival"):
        engine.run([good, Request((4, 5), 2, arrival=math.nan)])
    assert engine.results == {} and not engine.waiting
    run = engine.run([good])
    assert len(run.results) == 1
    assert_solo(tiny_model, run.results)
    assert_pool_whole(engine)


def test_metrics_of_known_results():
    def result(i, arrival, first, finished, returned, n):
        r = Result(i, arrival, Request((1,), n, arrival=arrival), [0] * n, "finished")
        r.first_token, r.ended, r.returned = first, finished, returned
        return r
    m = metrics([result(0, 0.0, 1.0, 3.0, 3.0, 3), result(1, 1.0, 2.0, 2.0, 5.0, 1),
                 Result(2, 0.0, Request((1,), 4), status="cancelled")])
    assert (m.requests, m.tokens) == (2, 4)
    assert m.throughput == 4 / 5.0 and m.latency_mean == (3.0 + 4.0) / 2
    assert m.ttft_mean == 1.0 and m.per_token_mean == 1.0 and m.latency_p50 == 3.5
    with pytest.raises(ValueError, match="no finished request"):
        metrics([])
    assert math.isnan(result(3, 0.0, 1.0, 1.0, 1.0, 1).per_token)


def test_a_chat_turn_finds_the_last_turn_cached_prompt_and_answer(tiny_model):
    """Turn 2's prompt is turn 1's prompt + answer + a new message: every full block of it is
    found cached, the answer's blocks too (named as decoding filled them)."""
    engine = Engine(tiny_model, EngineConfig(max_num_seqs=1, num_gpu_blocks_override=16,
                                             block_size=4))
    first = Request(tuple(range(1, 12)), 9, eos_token_id=[])
    engine.submit(first)
    while engine.running() or engine.waiting:
        engine.step()
    history = first.prompt + tuple(engine.results[0].tokens)          # 20 tokens, 5 blocks
    second = Request(history + (50, 51, 52), 4, eos_token_id=[])
    engine.submit(second)
    while engine.running() or engine.waiting:
        engine.step()
    r1, r2 = engine.results.values()
    assert (r1.cached_tokens, r2.cached_tokens) == (0, 16)  # 4 full blocks of turn 1's 19
    assert (engine.prefix_queries, engine.prefix_hits) == (11 + 23, 16)
    assert_solo(tiny_model, [r1, r2])
    assert_pool_whole(engine)


@pytest.mark.parametrize("budget", [4, 7, 64])
def test_chunked_prefill_keeps_streams_decoding_and_changes_no_token(tiny_model, budget):
    """Two requests decode; a 20-token prompt arrives: with a budget of b tokens a step it is
    prefilled in chunks of b - 2 while both streams make a token every step."""
    engine = Engine(tiny_model, EngineConfig(max_num_seqs=3, num_gpu_blocks_override=40,
                                              block_size=4, enable_prefix_caching=False,
                                              max_num_batched_tokens=budget),
                    history=True)
    for _ in range(2):
        engine.submit(Request((1, 2), 30, eos_token_id=[]))
    while not all(r.tokens for r in engine.results.values()):
        engine.step()
    before = len(engine.prefill_times)
    engine.submit(Request(tuple(range(5, 25)), 3, arrival=engine.clock, eos_token_id=[]))
    made = []
    while engine.running() or engine.waiting:
        engine.step()
        made.append([len(r.tokens) for r in engine.results.values()])
    chunks = [n for n, _ in engine.prefill_times[before:]]
    room = budget - 2                                     # the two decodes come first
    assert chunks == [room] * (20 // room) + [20 % room] * (20 % room > 0) if room < 20 \
        else chunks == [20]
    assert engine.results[2].prefill_chunks == len(chunks)
    for previous, now in pairwise(made[:len(chunks)]):  # both streams flowed meanwhile
        assert now[:2] == [previous[0] + 1, previous[1] + 1]
    assert_solo(tiny_model, engine.results.values())     # the near-tie rule
    assert_pool_whole(engine)


@pytest.mark.parametrize("bad", [0, -3, 2.5, "8", True, 2])
def test_a_bad_token_budget_is_refused_naming_it(tiny_model, bad):
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        Engine(tiny_model, EngineConfig(max_num_seqs=2, max_num_batched_tokens=bad))


def test_a_requests_own_eos_ids_end_it(tiny_model):
    """Greedy tokens of a prompt without stopping, then the same request with its third token
    as its eos id: it ends there, that token included, as generate does."""
    free = Engine(tiny_model).run([Request((1, 2, 3), 6, eos_token_id=[])]).results[0].tokens
    eos = free[2]
    stop = next(i for i, t in enumerate(free) if t == eos)
    run = Engine(tiny_model).run([Request((1, 2, 3), 6, eos_token_id=[eos])])
    assert run.results[0].tokens == free[:stop + 1]


def test_a_repetition_penalty_is_applied_as_generate_applies_it(tiny_model):
    """A heavy penalty changes greedy tokens (checked), and the engine's are generate's."""
    s = SamplingSettings(repetition_penalty=50.0)
    plain = Engine(tiny_model).run([Request((1, 2, 1, 2), 8, eos_token_id=[])])
    run = Engine(tiny_model).run([Request((1, 2, 1, 2), 8, sampling=s, eos_token_id=[])])
    want = generate(tiny_model, np.array([1, 2, 1, 2]), 8, sampling=s, eos_token_id=[])
    assert run.results[0].tokens != plain.results[0].tokens
    assert run.results[0].tokens == [int(t) for t in want]
