"""What the server refuses, and how: a 400 naming the field (the engine's own refusals included,
before any stream), a 429 when the queue is full, a 413 for a body over the limit as it arrives;
the default body limit fits a prompt of the model's whole context in any script; text too long
for any tokenization refused before tokenizing; and /health answering while a prompt is
tokenized."""
import json
import threading
import urllib.request

import pytest

from conftest import wait_for
from minitransformer.serve.config import EngineConfig
from minitransformer.serve.engine import Engine
from minitransformer.serve.online import OnlineEngine

pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
import openai

from minitransformer.serve.http import create_app, default_max_request_bytes
from servers import (
    NAME,
    Background,
    HeldTokenizer,
    chat,
    completion,
    exchange,
    held_in_tokenization,
    one_running_one_waiting,
    post,
)


def test_bad_requests_get_400_naming_the_field(served, model):
    online, url, client = served
    positions = model.config.max_position_embeddings
    cases = [(dict(model=NAME, prompt="hi", n=5), "n"),          # 4 slots
             (dict(model=NAME, prompt="hi", max_tokens=-1), "max_tokens"),
             (dict(model=NAME, prompt=[5] * positions), "prompt"),
             (dict(model=NAME, prompt="hi", max_tokens=200), "max_tokens"),
             (dict(model=NAME, prompt="hi", temperature=-1), "temperature"),
             (dict(model=NAME, prompt="hi", stop=5), "stop")]
    for body, field in cases:
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(**body)
        assert caught.value.status_code == 400 and caught.value.body["param"] == field, body
    with pytest.raises(openai.BadRequestError, match="a KV pool of 192 tokens"):
        client.completions.create(model=NAME, prompt="hi", max_tokens=200)
    with pytest.raises(openai.NotFoundError) as caught:       # as OpenAI and vLLM answer
        client.completions.create(model="gpt-4", prompt="hi")
    assert caught.value.body["code"] == "model_not_found" and caught.value.body["param"] == \
        "model"


def test_full_queue_gets_429_with_retry_after(model):
    online = OnlineEngine(Engine(model, EngineConfig(max_num_seqs=1, num_gpu_blocks_override=64,
                                                     block_size=4), history=True),
                          max_waiting=1)
    server = Background(create_app(online, NAME))
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    try:
        long, waiter = one_running_one_waiting(online, client)
        with pytest.raises(openai.RateLimitError) as caught:
            client.completions.create(model=NAME, prompt="c", max_tokens=2)
        assert caught.value.response.headers["retry-after"] == "1"
        long.close()
        waiter.join(20)
        assert online.engine.results[1].status == "finished"
    finally:
        server.stop()
        online.close()


def test_a_streamed_body_over_the_limit_is_refused_as_it_arrives(model):
    """Chunked (no Content-Length): cut off with 413 once the bytes received pass the limit."""
    online = OnlineEngine(Engine(model, EngineConfig(max_num_seqs=1, num_gpu_blocks_override=8,
                                                     block_size=4)))
    server = Background(create_app(online, NAME, max_request_bytes=1000))
    try:
        chunk = b"x" * 600
        raw = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" +
               b"%x\r\n%s\r\n" % (len(chunk), chunk) * 2 + b"0\r\n\r\n")
        status, _, body = exchange(server.url, raw)
        assert status == 413 and body["error"]["code"] == "request_too_large"
        assert "at least 1200 bytes" in body["error"]["message"]
        status, _, body = exchange(server.url, post("/v1/completions", completion()))
        assert status == 200 and body["choices"][0]["text"] is not None
    finally:
        server.stop()
        online.close()


TEXTS = {"English": "The cat sat on the mat. ",
         "Chinese": "\u6f22\u5b57\u306f\u96e3\u3057\u3044\u3002",
         "emoji": "\U0001f600\U0001f680\U0001f30d ", "control": "\x01\x02\x1f\t",
         "Arabic": "\u0645\u0631\u062d\u0628\u0627 ", "spaces": " " * 200}


def filling(tokenizer, text, positions):
    """text repeated to the longest prefix that fits `positions` tokens."""
    long = text * (positions // max(1, len(tokenizer.encode(text))) + 2)
    low, high = 0, len(long)
    while low < high:           # the longest prefix of at most `positions` tokens
        mid = (low + high + 1) // 2
        low, high = (mid, high) if len(tokenizer.encode(long[:mid])) <= positions else \
            (low, mid - 1)
    return long[:low]


def test_a_prompt_filling_the_context_fits_the_default_limit(model):
    """In any script, escaped the costliest way JSON allows, a prompt up to the model's
    context is under the default body limit, and is served."""
    positions = model.config.max_position_embeddings
    limit = default_max_request_bytes(model)
    online = OnlineEngine(Engine(model, EngineConfig(max_num_seqs=1,
                                                     num_gpu_blocks_override=2 * positions // 4,
                                                     block_size=4)))
    server = Background(create_app(online, NAME))
    try:
        for language, text in TEXTS.items():
            prompt = filling(model.tokenizer, text, positions - 1)
            body = json.dumps({"model": NAME, "prompt": prompt, "max_tokens": 1},
                              ensure_ascii=True).encode()
            assert len(body) <= limit, language
            status, _, reply = exchange(server.url, post("/v1/completions", body))
            assert status == 200 and reply["usage"]["prompt_tokens"] == positions - 1, language
    finally:
        server.stop()
        online.close()


def test_smollm2_default_limit_takes_its_context_in_any_language():
    from types import SimpleNamespace

    from minitransformer.checkpoints.real_model import NAME as SMOLLM2
    from minitransformer.checkpoints.real_model import is_imported
    from minitransformer.checkpoints.synth import weights_dir
    from minitransformer.config import load_config
    from minitransformer.tokenizer import load_tokenizer

    path = weights_dir() / SMOLLM2
    if not is_imported(path):
        pytest.skip(f"{path} not imported")
    model = SimpleNamespace(config=load_config(path), tokenizer=load_tokenizer(path))
    positions, limit = model.config.max_position_embeddings, default_max_request_bytes(model)
    assert limit == 5_029_888               # the figure --help states
    for language, text in TEXTS.items():
        prompt = filling(model.tokenizer, text, positions)
        assert len(json.dumps({"model": "m", "prompt": prompt}).encode()) <= limit, language


def test_health_answers_while_a_big_request_is_tokenized(model):
    """A model of 4M positions, so that 2.6 MB of text may fit and must be tokenized: while its
    tokenization is held open (HeldTokenizer, below: as long as the test wants, whatever the
    machine's speed), /health answers; then the request is refused, 400."""
    from dataclasses import replace

    held = HeldTokenizer(model.tokenizer.backend)
    long = replace(model, config=replace(model.config, max_position_embeddings=2**22),
                   tokenizer=replace(model.tokenizer, backend=held))
    online = OnlineEngine(Engine(long, EngineConfig(max_num_seqs=1, num_gpu_blocks_override=8,
                                                    block_size=4)))
    server = Background(create_app(online, NAME, max_request_bytes=40 << 20))
    try:
        body = completion(prompt="The robot counted 1234 boats, \u6f22\u5b57! " * 60_000)
        done = []
        held.armed = True
        big = threading.Thread(target=lambda: done.append(exchange(server.url, post(
            "/v1/completions", body), timeout=300)))
        big.start()
        assert held.started.wait(timeout=30)
        for _ in range(3):      # a loop blocked by the tokenizer would not answer at all
            assert urllib.request.urlopen(server.url + "/health", timeout=5).status == 200
        assert big.is_alive() and not done
        held.go.set()
        big.join(300)
        assert done[0][0] == 400 and "the KV pool" in done[0][2]["error"]["message"]
    finally:
        held.go.set()
        server.stop()
        online.close()


def test_health_answers_while_a_prompt_is_being_tokenized(model):
    """Tokenizing runs off the event loop: while one prompt's tokenization is held open,
    /health keeps answering, and the held request then completes."""
    with held_in_tokenization(model) as (server, held, request, done):
        for _ in range(3):      # a loop blocked by the tokenizer would not answer at all
            assert urllib.request.urlopen(server.url + "/health", timeout=5).status == 200
        assert request.is_alive() and not done
        held.go.set()
        request.join(30)
        assert done and done[0][0] == 200, done


class WatchedTokenizer:
    """A tokenizer backend that notes the longest text any of its methods was given."""

    def __init__(self, backend):
        self.backend, self.longest = backend, 0

    def __getattr__(self, name):
        attr = getattr(self.backend, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            for a in args:
                for text in ([a] if isinstance(a, str) else a if isinstance(a, list) else []):
                    self.longest = max(self.longest, len(text) if isinstance(text, str) else 0)
            return attr(*args, **kwargs)
        return call


def test_text_too_long_for_any_tokenization_is_refused_before_tokenizing(model):
    """No token stands for more than the vocabulary's longest, so 10 MB of text cannot fit 256
    positions: refused without the text reaching the tokenizer (it would take many seconds)."""
    from dataclasses import replace

    watched = WatchedTokenizer(model.tokenizer.backend)
    served = replace(model, tokenizer=replace(model.tokenizer, backend=watched))
    online = OnlineEngine(Engine(served, EngineConfig(max_num_seqs=1, num_gpu_blocks_override=8,
                                                      block_size=4)))
    server = Background(create_app(online, NAME, max_request_bytes=40 << 20))
    try:
        text = "The cat sat on the mat. " * 400_000
        for path, body, param in (("/v1/completions", completion(prompt=text), "prompt"),
                                  ("/v1/chat/completions", chat(text), "messages")):
            status, _, reply = exchange(server.url, post(path, body))
            assert status == 400 and reply["error"]["param"] == param, reply
            assert "9,600,000 bytes of text make more than 256 tokens" in \
                reply["error"]["message"]
            assert watched.longest < 1000, watched.longest   # no long text was tokenized
    finally:
        server.stop()
        online.close()


def test_a_request_the_engine_refuses_is_a_400_before_any_stream(model):
    """The parser accepts what the engine then refuses (its own ValueError): through the real
    server that is a 400 with the engine's words, streamed or not, never a 500 nor a 200
    whose stream carries the error; the server serves on."""
    class Refusing(Engine):
        def _check(self, request):
            if 7 in request.prompt:
                raise ValueError("token 7 is refused by this engine")
            return super()._check(request)
    config = EngineConfig(max_num_seqs=2, num_gpu_blocks_override=16, block_size=4)
    online = OnlineEngine(Refusing(model, config))
    server = Background(create_app(online, NAME))
    try:
        for stream in (False, True):
            got, headers, body = exchange(server.url, post("/v1/completions", completion(
                prompt=[5, 7, 9], stream=stream)))
            assert got == 400 and headers["content-type"] == "application/json", body
            assert body["error"]["message"] == "token 7 is refused by this engine"
            assert body["error"]["type"] == "invalid_request_error"
        got, _, body = exchange(server.url, post("/v1/completions", completion(prompt=[5, 9])))
        assert got == 200 and body["choices"][0]["finish_reason"] in ("stop", "length")
        # the snapshot is taken after the step that answered: wait for it
        wait_for(lambda: online.snapshot.running == online.snapshot.waiting == 0)
    finally:
        server.stop()
        online.close()
