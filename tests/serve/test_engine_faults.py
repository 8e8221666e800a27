"""Faults in a step (engine.py, "Faults"): a pass that raises ends the sequences it concerned
with an error, everyone else goes on with the tokens they get without the fault, and the
books hold (``check()`` after every step, every block back at the end, no name left on a
block that was never written); an error the engine cannot go on after ends everything,
says so and stops. A step that can admit nothing with nothing running raises, in words.

The faults are injected where every forward pass starts (``model.embed``): where a prompt
holds a poison run of tokens (a request the model cannot take), or at a chosen step (a pass
that fails whoever is in it)."""
import json
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import minitransformer as mt
from conftest import wait_for
from engine_fuzz import solo
from minitransformer import model as model_module
from minitransformer.serve.config import EngineConfig, SpeculativeConfig
from minitransformer.serve.engine import Engine
from minitransformer.serve.online import Closed, OnlineEngine
from minitransformer.serve.records import Request
from minitransformer.serve.scheduler import Scheduler

ROOT = Path(__file__).resolve().parents[2]
POISON = (91, 92, 93)           # a run of tokens no other prompt holds
STEM = (11, 12, 13, 14, 15, 16, 17, 18)     # two full blocks of 4


class Injected(RuntimeError):
    pass


@pytest.fixture()
def model(checkpoint_dir):
    return mt.load(checkpoint_dir("llama-gqa"))


@pytest.fixture()
def fault(monkeypatch):
    """fault(when): every forward pass whose ids make when(ids) true raises Injected."""
    embed = model_module.embed

    def arm(when):
        def failing(model, ids):
            if when(np.asarray(ids)):
                raise Injected("a fault injected into the forward pass")
            return embed(model, ids)
        monkeypatch.setattr(model_module, "embed", failing)
    return arm


def poisoned(ids) -> bool:
    """Does any row hold the poison run?"""
    return any(POISON == tuple(row[i:i + 3]) for row in ids.tolist()
               for i in range(len(row) - 2))


def checked_run(engine, requests):
    """Serve requests, the books checked after every step, and every block back (or kept,
    named and written) at the end, none left being filled."""
    run = engine.run(requests, on_step=lambda e: e.cache.books.check())
    books = engine.cache.books
    assert books.num_free == books.num_blocks and not books.filling
    return run


def test_a_prompt_the_model_cannot_take_ends_alone_and_the_others_keep_their_tokens(
        model, fault):
    """Batch-invariant: each prompt is a pass of its own. Four prompts enter in the first
    step; the poisoned one's pass fails. It ends with the error, and so does the prompt after
    it that starts the same (its pass would read the blocks the failed one was to fill, found
    by the names its plan gave them); the two others are served. The names of the blocks
    never written are gone: a later prompt with that start finds nothing cached (it would
    read keys never computed), and the one after it finds the first's, written. Every request
    not concerned gets generate's tokens."""
    fault(poisoned)
    requests = [Request((1, 2, 3), 16, eos_token_id=[]),
                Request(STEM + POISON, 16, eos_token_id=[]),
                Request(STEM + (50,), 16, eos_token_id=[]),
                Request((4, 5), 16, eos_token_id=[]),
                *[Request(STEM + (40 + i,), 12, eos_token_id=[]) for i in range(2)]]
    served = Engine(model, EngineConfig(max_num_seqs=4, block_size=4,
                                        num_gpu_blocks_override=40, batch_invariant=True))
    run = checked_run(served, requests)
    assert [r.status for r in run.results] == ["finished", "error", "error"] + ["finished"] * 3
    for failed in run.results[1:3]:
        assert failed.tokens == [] and "Injected" in failed.reason
    for result, request in zip(run.results, requests, strict=True):
        if result.status == "finished":
            assert result.tokens == solo(model, request)
    assert run.results[2].cached_tokens == len(STEM)  # it found the unwritten ones then
    assert run.results[4].cached_tokens == 0          # not the poisoned prompt's blocks
    assert run.results[5].cached_tokens == len(STEM)  # the one before it's, written


def test_a_block_an_earlier_pass_wrote_is_no_failed_passes_to_fill(model, fault):
    """Batch-invariant, three prompts in one step: the first computes STEM and names its
    blocks; the second and third find them by name. The second's pass fails. STEM's blocks
    are held by it, but the first pass wrote them: the third, reading them, is not
    concerned, and is served with generate's tokens."""
    fault(poisoned)
    requests = [Request(STEM + (60,), 8, eos_token_id=[]),
                Request(STEM + POISON, 8, eos_token_id=[]),
                Request(STEM + (50,), 8, eos_token_id=[])]
    served = Engine(model, EngineConfig(max_num_seqs=3, block_size=4,
                                        num_gpu_blocks_override=40, batch_invariant=True))
    run = checked_run(served, requests)
    assert [r.status for r in run.results] == ["finished", "error", "finished"]
    assert run.results[1].cached_tokens == run.results[2].cached_tokens == len(STEM)
    for result, request in zip(run.results[::2], requests[::2], strict=True):
        assert result.tokens == solo(model, request)


def test_the_samples_waiting_for_a_prompt_that_fails_end_with_it(model, fault):
    """n = 2, the prompt prefilled in chunks (a budget of 6), the poison in its first: its
    second sample, waiting to fork the prompt, ends with it (it would wait for ever)."""
    fault(poisoned)
    bad = Request(POISON + tuple(range(20, 30)), 8, n=2, seed=1, eos_token_id=[])
    good = Request((1, 2, 3), 8, eos_token_id=[])
    served = Engine(model, EngineConfig(max_num_seqs=3, block_size=4,
                                        max_num_batched_tokens=6, batch_invariant=True))
    run = checked_run(served, [bad, good])
    assert [r.status for r in run.results] == ["error", "error", "finished"]
    assert run.results[2].tokens == solo(model, good)


def test_a_failed_requests_end_is_stamped_with_the_clock_of_the_step_that_failed_it(model, fault):
    """As a finished request's end: the engine's clock as the failing step reports it, once
    its passes are over (the step's end, not its start); returned then too."""
    fault(poisoned)
    clocks = []
    served = Engine(model, EngineConfig(max_num_seqs=2))
    run = served.run([Request(POISON + (5,), 4, n=2, eos_token_id=[])],
                     on_step=lambda e: clocks.append(e.clock))
    assert [r.status for r in run.results] == ["error", "error"] and len(clocks) == 1
    assert clocks[0] > 0.0
    assert all(r.ended == r.returned == clocks[0] for r in run.results)


SETTINGS = {  # name -> EngineConfig fields: the ways a step may be shaped (default mode)
    "continuous": {},
    "static": {"policy": "static"},
    "chunked": {"max_num_batched_tokens": 6},
    "speculating": {"speculative_config": SpeculativeConfig(num_speculative_tokens=3)},
    "batch-invariant": {"batch_invariant": True},
}


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_a_failing_pass_ends_its_rows_and_the_waiting_keep_their_tokens(model, fault,
                                                                       setting):
    """Two requests decode in one pass (two slots); the pass of the third step fails: both
    end with the error, keeping the tokens they had; the two waiting behind them are then
    served as they are without the fault (the same engine serving them alone: the same
    batches, so the same bits, whatever the mode)."""
    config = EngineConfig(max_num_seqs=2, block_size=4, num_gpu_blocks_override=24,
                          **SETTINGS[setting])
    first = [Request(p, 12, eos_token_id=[]) for p in ((1, 2, 3), (4, 5, 6, 7))]
    later = [Request(p, 10, eos_token_id=[]) for p in ((30, 31), (32, 33, 34, 35, 36))]
    alone = checked_run(Engine(model, config), later)
    served = Engine(model, config)
    fault(lambda ids: served.steps == 2)      # the third step: both decoding
    run = checked_run(served, first + later)
    for result in run.results[:2]:
        assert result.status == "error" and "Injected" in result.reason
        assert 0 < len(result.tokens) < 12
    assert [r.status for r in run.results[2:]] == ["finished"] * 2
    assert [r.tokens for r in run.results[2:]] == [r.tokens for r in alone.results]


def test_an_engine_that_cannot_go_on_ends_everything_says_so_and_stops(model, monkeypatch):
    """A failure outside a pass (here the commit) leaves books nobody can vouch for: every
    request in flight and every one submitted gets the error, new ones are refused, the
    server's on_failure hears it once, and the loop stops."""
    heard = []
    online = OnlineEngine(Engine(model, EngineConfig(max_num_seqs=2, block_size=4,
                                                     num_gpu_blocks_override=40)),
                          on_failure=heard.append)

    def broken(self, made, now, on_commit=None):
        raise RuntimeError("the books are broken")
    updates = []
    with online.lock:           # both submitted before the first step
        for prompt in ((1, 2), (3, 4)):
            online.submit(Request(prompt, 50, eos_token_id=[]), updates.append)
        monkeypatch.setattr(Scheduler, "commit", broken)
    wait_for(lambda: heard)
    online.thread.join(10)
    assert not online.thread.is_alive() and len(heard) == 1
    assert sorted((u.status, u.done) for u in updates) == [("error", True)] * 2
    assert all("the books are broken" in u.reason for u in updates)
    with pytest.raises(Closed, match="cannot go on: RuntimeError"):
        online.submit(Request((1, 2), 5), updates.append)


def test_online_a_poisoned_stream_fails_alone_and_the_loop_goes_on(model, fault):
    """Concurrent streams, one poisoned: it raises the engine's error, the others get their
    solo tokens, and the engine serves the next request."""
    fault(poisoned)
    config = EngineConfig(max_num_seqs=3, block_size=4, num_gpu_blocks_override=40,
                          batch_invariant=True)
    online = OnlineEngine(Engine(model, config))
    requests = [Request((1, 2, 3), 10, eos_token_id=[]), Request(POISON, 10, eos_token_id=[]),
                Request((5, 6), 10, eos_token_id=[])]
    updates = [[] for _ in requests]
    with online.lock:
        for request, got in zip(requests, updates, strict=True):
            online.submit(request, got.append)
    wait_for(lambda: all(got and got[-1].done for got in updates))
    tokens = [[t for u in got for t in u.tokens] for got in updates]
    assert updates[1][-1].status == "error" and "Injected" in updates[1][-1].reason
    assert tokens[0] == solo(model, requests[0]) and tokens[2] == solo(model, requests[2])
    assert list(online.stream(replace(requests[0], prompt=(7, 8)))) == \
        solo(model, replace(requests[0], prompt=(7, 8)))
    assert online.error is None and online.snapshot.blocks_used == 0
    online.close()


def test_a_chat_turn_whose_step_fails_is_an_error_not_a_short_answer(model, fault):
    """The chat command's engine: a failed turn raises the error (the command's one error
    line), never an answer cut short as if it were whole."""
    from types import SimpleNamespace

    from minitransformer.__main__ import chat_engine, turn
    from minitransformer.sampling import GREEDY
    fault(poisoned)
    engine = chat_engine(model)
    with pytest.raises(ValueError, match="Injected"):
        list(turn(engine, list(POISON), SimpleNamespace(max_new_tokens=5, seed=None), GREEDY))
    assert list(turn(engine, [1, 2], SimpleNamespace(max_new_tokens=5, seed=None), GREEDY)) == \
        mt.generate(model, [1, 2], 5)


# --- through the server -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """A tiny Qwen2 with a byte-level tokenizer: what the server needs to answer in text."""
    from minitransformer.checkpoints.synth import make_checkpoint, qwen2_config, train_tokenizer
    return mt.load(make_checkpoint(tmp_path_factory.mktemp("faults"),
                                   qwen2_config(vocab_size=320), tokenizer=train_tokenizer(300)))


@pytest.fixture()
def server(chat_model):
    """-> start(online): an in-process server of it -> an openai client; stopped after."""
    openai = pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    from minitransformer.serve.http import create_app
    from servers import NAME, Background
    started = []

    def start(online):
        started.append((online, Background(create_app(online, NAME))))
        return openai.OpenAI(base_url=started[-1][1].url + "/v1", api_key="none",
                             max_retries=0)
    yield start
    for online, background in started:
        background.stop()
        online.close(drain=False, timeout=10)


def test_the_server_answers_a_failed_request_with_an_error_and_serves_on(chat_model, fault,
                                                                         server):
    """A request whose pass fails: not streamed, a 500 in OpenAI's error shape; streamed
    (its 200 and first bytes are sent at once), an error event. A stream in flight beside
    them ends with generate's text, and the server stays healthy."""
    import openai

    from servers import NAME, expected
    fault(poisoned)
    client = server(OnlineEngine(Engine(chat_model, EngineConfig(
        max_num_seqs=4, block_size=4, num_gpu_blocks_override=48, batch_invariant=True))))
    ids = chat_model.tokenizer.encode("The cat sat on the mat")
    stream = iter(client.completions.create(model=NAME, prompt=ids, max_tokens=24, stream=True,
                                            temperature=0, extra_body={"ignore_eos": True}))
    pieces = [next(stream).choices[0].text]
    with pytest.raises(openai.InternalServerError, match="Injected") as caught:
        client.completions.create(model=NAME, prompt=list(POISON), max_tokens=5)
    assert caught.value.status_code == 500 and caught.value.body["type"]
    with pytest.raises(openai.APIError, match="Injected"):
        list(client.completions.create(model=NAME, prompt=list(POISON) + [5], max_tokens=5,
                                       stream=True))
    pieces += [chunk.choices[0].text for chunk in stream]
    assert "".join(pieces) == expected(chat_model, ids, 24, eos_token_id=[])[1]
    health = urllib.request.urlopen(str(client.base_url).removesuffix("/v1/") + "/health")
    assert health.status == 200


def test_a_server_whose_engine_cannot_go_on_says_so_at_health(chat_model, server,
                                                              monkeypatch):
    import openai

    from servers import NAME
    monkeypatch.setattr(Scheduler, "commit", lambda *_: 1 / 0)
    client = server(OnlineEngine(Engine(chat_model, EngineConfig(max_num_seqs=2))))
    with pytest.raises(openai.InternalServerError, match="ZeroDivisionError"):
        client.completions.create(model=NAME, prompt=[1, 2], max_tokens=5)
    url = str(client.base_url).removesuffix("/v1/") + "/health"
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(url)
    assert caught.value.code == 503
    assert caught.value.read().decode().startswith("the engine failed: ZeroDivisionError")


def test_the_serve_command_drains_and_exits_1_when_its_engine_cannot_go_on(chat_model):
    """The command, its scheduler's commit broken: the request in flight gets a 500, the
    process stops by itself with status 1 and one error line (a supervisor restarts it),
    never a process answering 503 for ever."""
    pytest.importorskip("fastapi")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = ("import sys\nfrom minitransformer.serve.scheduler import Scheduler\n"
            "def broken(self, made, now, on_commit=None):\n"
            "    raise RuntimeError('the books are broken')\n"
            "Scheduler.commit = broken\nfrom minitransformer.__main__ import main\n"
            "main(sys.argv[1:])")
    process = subprocess.Popen([sys.executable, "-c", code, "serve", "--model",
                                chat_model.path, "--port", str(port)],
                               cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"

        def up():
            try:
                return urllib.request.urlopen(url + "/health").status == 200
            except OSError:
                return process.poll() is not None
        wait_for(up, timeout=60)
        body = json.dumps({"model": Path(chat_model.path).name, "prompt": [1, 2, 3],
                           "max_tokens": 5}).encode()
        request = urllib.request.Request(url + "/v1/completions", body,
                                         {"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(request, timeout=30)
        assert caught.value.code == 500
        assert process.wait(30) == 1
    finally:
        process.kill()
        process.wait()
    assert process.stderr.read().strip().splitlines()[-1] == (
        "error: the engine failed and cannot go on: RuntimeError('the books are broken')")


def test_an_empty_pool_refuses_the_first_request_in_words(tiny_model):
    """Submission rejects what the pool can never hold, so the scheduler stands in for a plan
    that admits nothing with nothing running: the step raises, saying so."""
    engine = Engine(tiny_model, EngineConfig(max_num_seqs=1, block_size=4, num_gpu_blocks_override=1))
    engine.submit(Request((1, 2), 1, eos_token_id=[]))
    engine.scheduler.schedule = lambda now, wants=None: SimpleNamespace(decode=None, prefill=[],
                                                                     moves=[])
    with pytest.raises(RuntimeError,
                       match="^nothing running and the first request cannot be admitted$"):
        engine.step()
