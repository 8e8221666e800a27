"""The online engine: requests from many threads, on a real clock, get their solo tokens."""
import threading
import time

import numpy as np
import pytest

import minitransformer as mt
from conftest import wait_for
from engine_fuzz import solo
from minitransformer.sampling import SamplingSettings
from minitransformer.serve.config import EngineConfig
from minitransformer.serve.engine import Engine
from minitransformer.serve.online import Closed, OnlineEngine, QueueFull
from minitransformer.serve.records import Request


@pytest.fixture()
def model(checkpoint_dir):
    return mt.load(checkpoint_dir("llama-gqa"))


@pytest.mark.parametrize("policy", ["continuous", "static"])
def test_concurrent_clients_get_their_solo_tokens(model, policy):
    rng = np.random.default_rng(0)
    V = model.config.vocab_size
    requests = [Request(tuple(rng.integers(0, V, rng.integers(1, 12)).tolist()),
                        int(rng.integers(1, 20)),
                        sampling=SamplingSettings(do_sample=bool(i % 2), temperature=0.8,
                                                  top_p=0.9),
                        seed=i, eos_token_id=[] if i % 3 else None) for i in range(12)]
    config = EngineConfig(max_num_seqs=3, num_gpu_blocks_override=20, block_size=4,
                          policy=policy, batch_invariant=True)
    online = OnlineEngine(Engine(model, config))
    got = [None] * len(requests)

    def client(i):
        time.sleep(0.001 * i)       # arrivals spread over the first steps
        got[i] = list(online.stream(requests[i]))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    online.close()
    assert got == [solo(model, r) for r in requests]
    assert online.snapshot.blocks_used == 0 and not online.thread.is_alive()


def test_a_client_that_leaves_frees_its_blocks_at_once(model):
    config = EngineConfig(max_num_seqs=2, num_gpu_blocks_override=60, block_size=4)
    online = OnlineEngine(Engine(model, config, history=True))
    tokens = online.stream(Request((1, 2, 3), 200, eos_token_id=[]))
    first = [next(tokens) for _ in range(3)]
    assert online.snapshot.blocks_used > 0
    tokens.close()                  # the client goes away mid-stream
    wait_for(lambda: online.snapshot.blocks_used == 0 and online.snapshot.running == 0)
    record = online.engine.results[0]
    assert record.status == "cancelled" and record.tokens[:3] == first
    assert len(record.tokens) < 200
    online.close()


def test_cancelling_a_ticket_of_n_samples_cancels_each_and_frees_its_blocks(model):
    """The ticket is the request's parent: it gathers its samples' tokens by choice, and a
    client that leaves cancels every one of them."""
    config = EngineConfig(max_num_seqs=3, num_gpu_blocks_override=60, block_size=4)
    online = OnlineEngine(Engine(model, config, history=True))
    updates = []
    ticket = online.submit(Request((1, 2, 3), 200, sampling=SamplingSettings(
        do_sample=True, temperature=1.0), seed=4, n=3, eos_token_id=[]), updates.append)
    wait_for(lambda: {u.choice for u in updates} == {0, 1, 2})
    online.cancel(ticket)
    wait_for(lambda: online.snapshot.blocks_used == 0 and online.snapshot.running == 0)
    records = [online.engine.results[rid] for rid in ticket.ids]
    assert [r.status for r in records] == ["cancelled"] * 3
    assert all(len(r.tokens) < 200 for r in records)
    for choice, record in enumerate(records):
        assert [t for u in updates if u.choice == choice for t in u.tokens] == record.tokens
    online.close()


def test_full_queue_is_refused_and_bad_requests_end_rejected(model):
    config = EngineConfig(max_num_seqs=1, num_gpu_blocks_override=8, block_size=4)
    online = OnlineEngine(Engine(model, config), max_waiting=1)
    first = []
    with online.lock:               # hold the loop off: both submissions are still in the inbox
        online.submit(Request((1, 2), 5), first.append)
        with pytest.raises(QueueFull, match="limit is 1"):
            online.submit(Request((3, 4), 5), lambda update: None)
    wait_for(lambda: first and first[-1].done)
    with pytest.raises(ValueError, match="token ids must be in"):
        list(online.stream(Request((10**6,), 5)))
    with pytest.raises(ValueError, match="the pool has 8"):
        list(online.stream(Request((1, 2), 40)))
    online.close()
    with pytest.raises(Closed):
        online.submit(Request((1, 2), 5), lambda update: None)


def test_a_request_the_loop_has_taken_still_counts_as_waiting(model):
    """Between taking submissions from the inbox and the snapshot that shows them, the loop
    holds requests nobody could see: they count against max_waiting all the same (once, a
    full batch's extra requests were let in there)."""
    config = EngineConfig(max_num_seqs=1, num_gpu_blocks_override=8, block_size=4)
    online = OnlineEngine(Engine(model, config), max_waiting=1)
    taken, go, apply = threading.Event(), threading.Event(), online._apply

    def held(*command):             # the loop stops with the first submission in its hands
        taken.set()
        go.wait(30)
        return apply(*command)
    online._apply = held
    try:
        online.submit(Request((1, 2), 5), lambda update: None)
        assert taken.wait(30) and not online.inbox and online.snapshot.waiting == 0
        with pytest.raises(QueueFull, match="1 requests are waiting"):
            online.submit(Request((3, 4), 5), lambda update: None)
    finally:
        go.set()
        online.close()


def test_close_without_drain_cancels_what_is_in_flight(model):
    config = EngineConfig(max_num_seqs=1, num_gpu_blocks_override=80, block_size=4)
    online = OnlineEngine(Engine(model, config))
    updates = []
    for prompt in ((1, 2), (3, 4)):
        online.submit(Request(prompt, 200, eos_token_id=[]), updates.append)
    wait_for(lambda: updates)
    online.close(drain=False, timeout=10)
    assert not online.thread.is_alive() and online.snapshot.blocks_used == 0
    ends = [u.status for u in updates if u.done]
    assert sorted(ends) == ["cancelled", "cancelled"]


def test_a_failing_step_ends_every_request_loudly(model):
    config = EngineConfig(max_num_seqs=2, num_gpu_blocks_override=40, block_size=4)
    online = OnlineEngine(Engine(model, config))

    def broken():
        raise RuntimeError("a bug in a step")
    online.engine.step = broken
    with pytest.raises(ValueError, match="engine failed: RuntimeError"):
        list(online.stream(Request((1, 2), 5)))
    with pytest.raises(Closed, match="a bug in a step"):
        online.submit(Request((1, 2), 5), lambda update: None)


def test_a_batch_is_queued_whole_or_refused_whole(model):
    """submit_all counts the whole batch against the queue's limit at once: with one request
    waiting and a limit of 2, a batch of 2 is refused and none of it queued; a batch of 1 is
    taken. (Submitting the prompts one by one would let the engine's progress decide.)"""
    config = EngineConfig(max_num_seqs=1, num_gpu_blocks_override=8, block_size=4)
    online = OnlineEngine(Engine(model, config), max_waiting=2)
    with online.lock:               # hold the loop off: what is submitted stays in the inbox
        online.submit(Request((1, 2), 3), lambda update: None)
        with pytest.raises(QueueFull, match="1 requests are waiting and 2 more arrive"):
            online.submit_all([(Request((3, 4), 3), lambda u: None),
                               (Request((5, 6), 3), lambda u: None)])
        assert len(online.inbox) == 1
        assert len(online.submit_all([(Request((3, 4), 3), lambda u: None)])) == 1
        assert len(online.inbox) == 2
    online.close()
