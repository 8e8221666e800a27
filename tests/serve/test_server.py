"""The OpenAI-compatible server, driven by the official ``openai`` client over real HTTP on
127.0.0.1: every answer's text is the text of ``generate`` alone, streamed or not."""
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections import deque
from pathlib import Path

import pytest

from conftest import assert_like_solo, wait_for
from engine_fuzz import exact
import minitransformer as mt
from minitransformer.kernels import blas
from minitransformer.chat import encode_chat
from minitransformer.sampling import SamplingSettings
from minitransformer.serve.config import EngineConfig
from minitransformer.serve.engine import Engine
from minitransformer.serve.online import OnlineEngine
from minitransformer.serve.records import Request
from minitransformer.checkpoints.synth import make_checkpoint, qwen2_config, train_tokenizer

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
from minitransformer.serve.http import (READ_TIMEOUT_S, create_app,  # noqa: E402
                                        default_max_request_bytes, http_protocol)

NAME = "tiny-chat"
ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ("{% for m in messages %}<|endoftext|>{{ m['role'] }}: {{ m['content'] }}\n"
            "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")


class Background:
    """A uvicorn server on an ephemeral port of 127.0.0.1, in a thread of this process."""

    def __init__(self, app, read_timeout=READ_TIMEOUT_S):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning",
                                                    http=http_protocol(read_timeout)))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True)
        self.thread.start()
        wait_for(lambda: self.server.started)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A tiny Qwen2 with a real byte-level BPE tokenizer and a chat template."""
    path = make_checkpoint(tmp_path_factory.mktemp("served"), qwen2_config(vocab_size=320),
                           tokenizer=train_tokenizer(300))
    settings = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps(settings | {"chat_template":
                                                                       TEMPLATE}))
    return mt.load(path)


@pytest.fixture(scope="module")
def served(model):
    online = OnlineEngine(Engine(model, EngineConfig(max_num_seqs=4, num_gpu_blocks_override=48,
                                                     block_size=4,  # 192 tokens
                                                     batch_invariant=True),
                                 history=True))   # records read back
    server = Background(create_app(online, NAME))
    yield online, server.url, openai.OpenAI(base_url=server.url + "/v1", api_key="none",
                                            max_retries=0)
    server.stop()
    online.close()


def expected(model, ids, max_tokens, **sampling):
    """generate's tokens for these settings, their text and finish_reason."""
    return as_text(model, ids, mt.generate(model, ids, max_tokens, **sampling), max_tokens)


def as_text(model, ids, tokens, max_tokens) -> tuple:
    """-> (tokens, the text they add to the prompt's, finish_reason)."""
    text = model.tokenizer.decode(ids + tokens)[len(model.tokenizer.decode(ids)):]
    stopped = tokens[-1] in model.eos_token_ids and len(tokens) <= max_tokens
    return tokens, text, "stop" if stopped else "length"


def answered(online, model, ids, max_tokens, n=None, seed=None, **sampling):
    """What the server last made for this prompt, as ``expected`` gives generate's, its tokens
    checked against generate's by the exactness policy: == where its run was exact (batch-
    invariant, the prompt prefilled whole, nothing cached); else the near-tie rule (a prompt
    sent again finds its blocks cached, computed in another pass). n: its last n samples, a
    list (sample i against generate seeded seed + i). A cancelled one (a stop string, a client
    gone) against as many of generate's tokens as it made."""
    made = []
    records = [r for r in online.engine.results.values() if r.request.prompt == tuple(ids)]
    for result in records[-(n or 1):]:
        request = result.request
        mine = None if seed is None else seed + result.choice
        alone = mt.generate(model, ids, max_tokens, seed=mine, **sampling)
        if result.status == "cancelled":
            alone = alone[:len(result.tokens)]
        assert_like_solo(model, result.tokens, alone, ids, request.sampling, mine,
                         exact(online.engine, result), eos_token_id=request.eos_token_id)
        made.append(as_text(model, ids, result.tokens, max_tokens))
    return made if n else made[0]


SETTINGS = [dict(temperature=0), dict(temperature=0.9, top_p=0.9, seed=7)]


def as_generate(settings):
    if settings["temperature"] == 0:
        return {}
    return dict(sampling=SamplingSettings(do_sample=True, temperature=settings["temperature"],
                                          top_p=settings["top_p"]), seed=settings["seed"])


@pytest.mark.parametrize("settings", SETTINGS, ids=["greedy", "seeded"])
def test_completion_text_is_generates(served, model, settings):
    online, url, client = served
    prompt = "The cat sat on the mat."
    ids = model.tokenizer.encode(prompt)
    reply = client.completions.create(model=NAME, prompt=prompt, max_tokens=24, **settings)
    tokens, text, finish = answered(online, model, ids, 24, **as_generate(settings))
    assert reply.choices[0].text == text and reply.choices[0].finish_reason == finish
    assert reply.usage.completion_tokens == len(tokens)
    chunks = list(client.completions.create(model=NAME, prompt=prompt, max_tokens=24,
                                            stream=True, stream_options={"include_usage": True},
                                            **settings))
    tokens, text, finish = answered(online, model, ids, 24, **as_generate(settings))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert len([c for c in chunks if c.choices and c.choices[0].text]) > 1  # not one lump
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == finish
    assert chunks[-1].usage.completion_tokens == len(tokens) and not chunks[-1].choices


@pytest.mark.parametrize("settings", SETTINGS, ids=["greedy", "seeded"])
def test_chat_text_is_generates_through_the_template(served, model, settings):
    online, url, client = served
    messages = [{"role": "user", "content": "Tell me about the robot."}]
    ids = encode_chat(model, messages)
    reply = client.chat.completions.create(model=NAME, messages=messages, max_tokens=20,
                                           **settings)
    tokens, text, finish = answered(online, model, ids, 20, **as_generate(settings))
    assert reply.choices[0].message.content == text
    assert reply.choices[0].finish_reason == finish
    assert reply.usage.prompt_tokens == len(ids)
    chunks = list(client.chat.completions.create(model=NAME, messages=messages, max_tokens=20,
                                                 stream=True, **settings))
    tokens, text, finish = answered(online, model, ids, 20, **as_generate(settings))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text


def test_concurrent_clients_are_batched_and_exact(served, model):
    online, url, client = served
    prompts = [f"The {w} ran to the park." for w in ("dog", "cat", "robot", "boat", "sun",
                                                         "moon")]
    answers = [None] * len(prompts)

    def ask(i):
        chunks = client.completions.create(model=NAME, prompt=prompts[i], max_tokens=30,
                                           temperature=0.8, seed=i, stream=True,
                                           extra_body={"ignore_eos": True})
        answers[i] = "".join(c.choices[0].text for c in chunks)

    steps = len(online.engine.decode_times)
    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for i, prompt in enumerate(prompts):
        _, text, _ = answered(online, model, model.tokenizer.encode(prompt), 30, seed=i,
                              eos_token_id=[],
                              sampling=SamplingSettings(do_sample=True, temperature=0.8))
        assert answers[i] == text
    assert max(b for b, _ in online.engine.decode_times[steps:]) > 1   # decoded together


def test_a_client_that_disconnects_frees_its_blocks(served):
    online, url, client = served
    stream = client.completions.create(model=NAME, prompt="Once upon a time", max_tokens=150,
                                       stream=True, extra_body={"ignore_eos": True})
    pieces = [next(iter(stream)) for _ in range(3)]
    assert pieces and online.snapshot.blocks_used > 0
    stream.close()                  # the client goes away mid-answer
    wait_for(lambda: online.snapshot.blocks_used == 0 and online.snapshot.running == 0)
    record = online.engine.results[max(online.engine.results)]
    assert record.status == "cancelled" and len(record.tokens) < 150


def test_stop_strings_cut_the_text_and_end_with_stop(served, model):
    online, url, client = served
    prompt = "The robot counted the boats."
    _, text, _ = expected(model, model.tokenizer.encode(prompt), 40)
    stop = text[len(text) // 2:len(text) // 2 + 2]
    cut = text[:text.find(stop)]
    reply = client.completions.create(model=NAME, prompt=prompt, max_tokens=40, temperature=0,
                                      stop=[stop, "never in the text \u2603"])
    assert reply.choices[0].text == cut and reply.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model=NAME, prompt=prompt, max_tokens=40,
                                            temperature=0, stop=stop, stream=True))
    _, made, _ = answered(online, model, model.tokenizer.encode(prompt), 40)   # cached: the
    assert "".join(c.choices[0].text for c in chunks) == made[:made.find(stop)]  # near-tie rule
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_a_waiting_client_that_gives_up_is_cancelled(model):
    """Not streamed: a client that times out while its request waits leaves the queue, and
    the server logs no error for it (a client leaving is not the server's fault)."""
    import logging

    errors = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = errors.append
    logging.getLogger("uvicorn.error").addHandler(handler)
    online = OnlineEngine(Engine(model, EngineConfig(max_num_seqs=1, num_gpu_blocks_override=64,
                                                     block_size=4), history=True))
    server = Background(create_app(online, NAME))
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    try:                            # a slow listener keeps the only slot busy for seconds
        hog = online.submit(Request((1, 2), 200, eos_token_id=[]),
                            lambda update: time.sleep(0.02))
        wait_for(lambda: online.snapshot.running == 1)
        with pytest.raises(openai.APITimeoutError):
            client.completions.create(model=NAME, prompt="b", max_tokens=5, timeout=0.3)
        wait_for(lambda: len(online.engine.results) == 2 and
                 online.engine.results[1].status == "cancelled", timeout=5)
        assert online.engine.results[1].tokens == [] and online.engine.results[0].status == \
            "running"
        online.cancel(hog)
        time.sleep(0.3)             # the handler's cleanup after the client left
        assert not errors, [record.getMessage() for record in errors]
    finally:
        logging.getLogger("uvicorn.error").removeHandler(handler)
        server.stop()
        online.close()


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


def one_running_one_waiting(online, client) -> tuple:
    """On an engine of one slot: a long stream holding it, a request waiting behind it ->
    (the stream, the waiting request's thread)."""
    long = client.completions.create(model=NAME, prompt="a", max_tokens=200, stream=True,
                                     extra_body={"ignore_eos": True})
    next(iter(long))            # it holds the only slot
    waiter = threading.Thread(target=client.completions.create,
                              kwargs=dict(model=NAME, prompt="b", max_tokens=2))
    waiter.start()
    wait_for(lambda: online.snapshot.waiting == 1)
    return long, waiter


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


def test_models_health_and_metrics(served):
    online, url, client = served
    assert [m.id for m in client.models.list().data] == [NAME]
    assert urllib.request.urlopen(url + "/health").status == 200
    for _ in range(2):              # the second finds the first's full blocks cached
        client.completions.create(model=NAME, prompt="The sun rose over the hills",
                                  max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    text = urllib.request.urlopen(url + "/metrics").read().decode()
    samples = dict(line.rsplit(" ", 1) for line in text.splitlines() if line[:1] != "#")
    label = f'{{model_name="{NAME}"}}'
    made = sum(len(r.tokens) for r in online.engine.results.values())
    assert int(samples["vllm:generation_tokens_total" + label]) == made
    assert int(samples["vllm:prompt_tokens_total" + label]) == \
        sum(len(r.request.prompt) for r in online.engine.results.values())
    results = list(online.engine.results.values())
    hits = int(samples["vllm:prefix_cache_hits_total" + label])
    assert int(samples["vllm:prefix_cache_queries_total" + label]) == \
        sum(len(r.request.prompt) for r in results if r.prefill_chunks)  # the admitted
    assert hits == sum(r.cached_tokens for r in results) >= results[-1].cached_tokens > 0
    assert results[-1].cached_tokens == (len(results[-1].request.prompt) - 1) // 4 * 4
    assert samples["vllm:num_requests_running" + label] == "0"
    assert float(samples["vllm:kv_cache_usage_perc" + label]) == 0.0
    finished = sum(r.status == "finished" for r in online.engine.results.values())
    assert int(samples["vllm:e2e_request_latency_seconds_count" + label]) >= finished
    for name in ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                 "vllm:num_preemptions_total", "vllm:num_requests_waiting"):
        assert f"# TYPE {name}" in text


def inherited() -> dict:
    """This process's environment, less an API key the tester may have set for a server."""
    return {k: v for k, v in os.environ.items() if k != "MT_API_KEY"}


def serve_command(model, *options, env=None, api_key="none"):
    """`python3 -m minitransformer serve` in its own process on a free port of 127.0.0.1, once
    /health answers -> (process, an openai client of it, sending api_key). The caller kills
    the process. env: variables added to this process's.
    Its products of a few rows take the flat way (MT_PRODUCTS): the way is otherwise measured
    per process (blas.py), and a test comparing its text with this process's generate bit for
    bit pins blas.FIXED to the same."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    process = subprocess.Popen([sys.executable, "-m", "minitransformer", "serve", "--model",
                                model.path, "--port", str(port), "--served-model-name", NAME,
                                *options], cwd=ROOT, stderr=subprocess.PIPE, text=True,
                               env=inherited() | {"MT_PRODUCTS": "flat"} | (env or {}))

    def up():
        try:
            return urllib.request.urlopen(f"http://127.0.0.1:{port}/health").status == 200
        except OSError:
            return process.poll() is not None   # it died: stop waiting, the test will say so
    wait_for(up, timeout=60)
    assert process.poll() is None, process.stderr.read()
    return process, openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=api_key,
                                  max_retries=0)


def test_serve_command_drains_answers_in_flight_on_ctrl_c(model):
    """The real command in its own process: Ctrl-C lets a stream in flight finish."""
    process, client = serve_command(model)
    try:
        stream = iter(client.completions.create(model=NAME, prompt="The robot", max_tokens=40,
                                                stream=True, extra_body={"ignore_eos": True}))
        chunks = [next(stream)]
        process.send_signal(signal.SIGINT)      # shut down while the answer is half made
        chunks += list(stream)
        assert chunks[-1].choices[0].finish_reason == "length"
        assert process.wait(30) == 0
    finally:
        process.kill()
        process.wait()
    assert "serving 'tiny-chat'" in process.stderr.read()


def test_serve_command_with_a_quantized_cache_and_tiled_attention(model, monkeypatch):
    """--kv-cache-dtype q8_0 --attention tiled: the client's text is generate's with the same
    cache format and attention (batch-invariant, and both processes multiplying the flat way:
    the same BLAS calls, bit for bit); a bad format is refused."""
    monkeypatch.setattr(blas, "FIXED", "flat")
    bad = subprocess.run([sys.executable, "-m", "minitransformer", "serve", "--model", model.path,
                          "--kv-cache-dtype", "int8"], cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode == 2 and "--kv-cache-dtype: invalid choice: 'int8'" in bad.stderr
    assert all(name in bad.stderr.splitlines()[-1] for name in ("f32", "f16", "q8_0", "q4_0"))
    process, client = serve_command(model, "--kv-cache-dtype", "q8_0", "--attention", "tiled",
                                    "--batch-invariant")
    try:
        prompt = "The cat sat on the mat."
        ids = model.tokenizer.encode(prompt)
        tokens, text, finish = expected(model, ids, 24, kv_dtype="q8_0", attention="tiled")
        reply = client.completions.create(model=NAME, prompt=prompt, max_tokens=24,
                                          temperature=0)
        assert reply.choices[0].text == text and reply.choices[0].finish_reason == finish
    finally:
        process.kill()
        process.wait()
    assert "q8_0 cache, tiled attention" in process.stderr.read()


def test_serve_command_speculating_streams_generates_text_and_counts_drafts(model, monkeypatch):
    """--speculative-config (prompt lookup) with --batch-invariant: a prompt the answer copies
    from, streamed: the text is generate's, events carry the several tokens a step verified
    (fewer events than tokens), and /metrics shows vLLM's spec_decode counters."""
    monkeypatch.setattr(blas, "FIXED", "flat")
    process, client = serve_command(model, "--batch-invariant", "--speculative-config",
                                    '{"method": "ngram", "num_speculative_tokens": 4}')
    try:
        prompt = "the cat sat on the mat. " * 4
        ids = model.tokenizer.encode(prompt)
        tokens, text, _ = expected(model, ids, 32, eos_token_id=[])
        events = [c.choices[0].text for c in client.completions.create(
            model=NAME, prompt=prompt, max_tokens=32, temperature=0, stream=True,
            extra_body={"ignore_eos": True})]
        port = client.base_url.port
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
    finally:
        process.kill()
        process.wait()
    assert "".join(events) == text and len([e for e in events if e]) < len(tokens)
    samples = dict(line.rsplit(" ", 1) for line in metrics.splitlines() if line[:1] != "#")
    label = f'{{model_name="{NAME}"}}'
    drafted = int(samples["vllm:spec_decode_num_draft_tokens_total" + label])
    accepted = int(samples["vllm:spec_decode_num_accepted_tokens_total" + label])
    assert 0 < accepted <= drafted and int(samples["vllm:spec_decode_num_drafts_total" + label])
    assert int(samples[f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{position="0",'
                       f'model_name="{NAME}"}}']) > 0


# --- hostile requests ---------------------------------------------------------------------------
def exchange(url, raw: bytes, timeout=30):
    """Send raw bytes to the server -> (status, headers, body as JSON or text)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        sock.sendall(raw)
        reply = b""
        while b"\r\n\r\n" not in reply:
            reply += sock.recv(65536) or b"\r\n\r\n"
        head, _, body = reply.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = dict(line.lower().split(": ", 1) for line in lines[1:] if ": " in line)
        length = int(headers.get("content-length", -1))
        while len(body) < length:
            more = sock.recv(65536)
            if not more:
                break
            body += more
    status = int(lines[0].split()[1])
    try:
        return status, headers, json.loads(body)
    except ValueError:
        return status, headers, body.decode("latin-1")


def post(path, body: bytes, content_type="application/json"):
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body


def completion(**fields):
    return json.dumps({"model": NAME, "prompt": "hi", "max_tokens": 2} | fields).encode()


def chat(content):
    return json.dumps({"model": NAME, "max_tokens": 2,
                       "messages": [{"role": "user", "content": content}]}).encode()


def conversation(*messages, **fields):
    return json.dumps({"model": NAME, "max_tokens": 2, "messages": list(messages)} |
                      fields).encode()


USER = {"role": "user", "content": "hi"}
TOOL_CALL = {"role": "assistant", "content": "", "tool_calls": [{
    "id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
CHAT_JSON = conversation(USER).decode()


def parts(*content):
    return conversation({"role": "user", "content": list(content)})


def get(path, method="GET"):
    return f"{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode()


HOSTILE = {  # name -> (raw request, status, param or None, code or None)
    "number of 5000 digits": (post("/v1/completions", b'{"model": "tiny-chat", "prompt": "hi",'
                                   b' "max_tokens": 1' + b"0" * 5000 + b"}"), 400, None, None),
    "nesting 100000 deep": (post("/v1/completions", b'{"model": "tiny-chat", "prompt": ' +
                                 b"[" * 100_000 + b"]" * 100_000 + b"}"), 400, None, None),
    "nesting 900 deep": (post("/v1/completions", b'{"model": "tiny-chat", "prompt": ' +
                              b"[" * 900 + b"]" * 900 + b"}"), 400, "prompt", None),
    "lone surrogate in a prompt": (post("/v1/completions", completion(prompt="a\ud800b")),
                                   400, "prompt", None),
    "lone surrogate in a message": (post("/v1/chat/completions", chat("\udc00 hi")), 400,
                                    "messages", None),
    "lone surrogate in a stop string": (post("/v1/completions", completion(stop="\ud800")),
                                        400, "stop", None),
    "not JSON": (post("/v1/completions", b"{model: tiny-chat}"), 400, None, "invalid_json"),
    "not UTF-8": (post("/v1/completions", b'{"model": "\xff\xfe\xfa"}'), 400, None,
                  "invalid_json"),
    "empty body": (post("/v1/completions", b""), 400, None, "invalid_json"),
    "a JSON array": (post("/v1/completions", b"[1, 2]"), 400, None, None),
    "n 0": (post("/v1/completions", completion(n=0)), 400, "n", None),
    "n true": (post("/v1/completions", completion(n=True)), 400, "n", None),
    "best_of 0": (post("/v1/completions", completion(best_of=0)), 400, "best_of", None),
    "logprobs false": (post("/v1/completions", completion(logprobs=False)), 400, "logprobs",
                       None),
    "echo 0": (post("/v1/completions", completion(echo=0)), 400, "echo", None),
    "n 1.0": (post("/v1/completions", completion(n=1.0)), 400, "n", None),
    "ignore_eos yes": (post("/v1/completions", completion(ignore_eos="yes")), 400,
                       "ignore_eos", None),
    "max_tokens true": (post("/v1/completions", completion(max_tokens=True)), 400,
                        "max_tokens", None),
    "temperature 1e400": (post("/v1/completions", b'{"model": "tiny-chat", "prompt": "hi", '
                               b'"temperature": 1e400}'), 400, "temperature", None),
    "unknown model": (post("/v1/completions", completion(model="gpt-4")), 404, "model",
                      "model_not_found"),
    "unknown path": (get("/v1/nowhere"), 404, None, "not_found"),
    "unknown path, POST": (post("/v2/completions", completion()), 404, None, "not_found"),
    "GET on a POST route": (get("/v1/completions"), 405, None, "method_not_allowed"),
    "DELETE on /health": (get("/health", "DELETE"), 405, None, "method_not_allowed"),
    "POST on /v1/models": (post("/v1/models", b"{}"), 405, None, "method_not_allowed"),
    "not HTTP at all": (b"HELLO THERE\r\n\r\n", 400, None, "malformed_request"),
    "a bad header line": (b"GET /health HTTP/1.1\r\nHost x\r\n\r\n", 400, None,
                          "malformed_request"),
    "content-length lies": (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: "
                            b"nine\r\n\r\n", 400, None, "malformed_request"),
    "over the size limit": (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                            b"application/json\r\nContent-Length: 999999999999\r\n\r\n{",
                            413, None, "request_too_large"),
    # stop strings past the limits: five of them, or one of 250,000 characters (a body under
    # the size limit that once held the event loop for seconds)
    "five stop strings": (post("/v1/completions", completion(stop=list("abcde"))), 400, "stop",
                          None),
    "a stop string of 250,000 characters": (post("/v1/completions", completion(
        stop=["x" * 250_000] * 4)), 400, "stop", None),
    # fields not implemented, or of neither API: refused, never ignored
    "guided_json": (post("/v1/completions", completion(guided_json={"type": "object"})), 400,
                    "guided_json", None),
    "guided_choice in a chat": (post("/v1/chat/completions", json.dumps(
        {"model": NAME, "messages": [{"role": "user", "content": "hi"}],
         "guided_choice": ["yes", "no"]}).encode()), 400, "guided_choice", None),
    "allowed_token_ids": (post("/v1/completions", completion(allowed_token_ids=[1, 2])), 400,
                          "allowed_token_ids", None),
    "truncate_prompt_tokens": (post("/v1/completions", completion(truncate_prompt_tokens=4)),
                               400, "truncate_prompt_tokens", None),
    "an unknown field": (post("/v1/completions", completion(temprature=0)), 400, "temprature",
                         None),
    "best_of 1 with n 2": (post("/v1/completions", completion(best_of=1, n=2)), 400, "best_of",
                           None),
    # n samples the pool (48 blocks of 4) can never hold at once: 46 blocks for the prompt's
    # 180 tokens and the first token, 3 more copies; refused before any answer, streamed too
    "n 4 beyond the pool": (post("/v1/completions", completion(prompt=[5] * 180, n=4)), 400,
                            "n", None),
    "n 4 beyond the pool, streamed": (post("/v1/completions", completion(
        prompt=[5] * 180, n=4, stream=True)), 400, "n", None),
    # only JSON: a body under another Content-Type (what a web page may send anywhere without
    # asking) is a 415, whatever it holds
    "text/plain": (post("/v1/completions", completion(), "text/plain"), 415, None,
                   "unsupported_media_type"),
    "a form": (post("/v1/completions", completion(), "application/x-www-form-urlencoded"),
               415, None, "unsupported_media_type"),
    "multipart": (post("/v1/chat/completions", chat("hi"), "multipart/form-data; boundary=x"),
                  415, None, "unsupported_media_type"),
    "XML": (post("/v1/completions", completion(), "application/xml"), 415, None,
            "unsupported_media_type"),
    "text/json": (post("/v1/completions", completion(), "text/json"), 415, None,
                  "unsupported_media_type"),
    "+json alone": (post("/v1/completions", completion(), "application/+json"), 415, None,
                    "unsupported_media_type"),
    "no type, from a web page": ((f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nOrigin: "
                                  f"https://example.com\r\nContent-Length: {len(completion())}"
                                  f"\r\nConnection: close\r\n\r\n").encode() + completion(),
                                 415, None, "unsupported_media_type"),
    "text/plain to /tokenize": (post("/tokenize", b'{"prompt": "hi"}', "text/plain"), 415,
                                None, "unsupported_media_type"),
    "text/plain to /detokenize": (post("/detokenize", b'{"tokens": [1]}', "text/plain"), 415,
                                  None, "unsupported_media_type"),
    # only UTF-8: Python's parser would take UTF-16 and UTF-32, with or without a BOM
    "UTF-16": (post("/v1/completions", completion().decode().encode("utf-16")), 400, None,
               "invalid_json"),
    "UTF-16-LE, no BOM": (post("/v1/completions", completion().decode().encode("utf-16-le")),
                          400, None, "invalid_json"),
    "UTF-16-BE to /tokenize": (post("/tokenize", '{"prompt": "hi"}'.encode("utf-16-be")), 400,
                               None, "invalid_json"),
    "UTF-32": (post("/v1/chat/completions", CHAT_JSON.encode("utf-32")), 400, None,
               "invalid_json"),
    "UTF-32-BE, no BOM": (post("/v1/completions", completion().decode().encode("utf-32-be")),
                          400, None, "invalid_json"),
    # only once: a key given twice is refused, naming its path (the parser keeps the last)
    "max_tokens twice": (post("/v1/completions", b'{"model": "tiny-chat", "prompt": "hi", '
                              b'"max_tokens": 2, "max_tokens": 6}'), 400, "max_tokens", None),
    "model twice": (post("/v1/completions", b'{"model": "gpt-4", "prompt": "hi", '
                         b'"model": "tiny-chat"}'), 400, "model", None),
    "a role twice in a message": (post("/v1/chat/completions", CHAT_JSON.replace(
        '"role": "user"', '"role": "system", "role": "user"').encode()), 400,
        "messages[0].role", None),
    "include_usage twice": (post("/v1/completions", completion(stream=True).replace(
        b'"stream": true', b'"stream": true, "stream_options": {"include_usage": true, '
        b'"include_usage": false}')), 400, "stream_options.include_usage", None),
    "logit_bias key twice": (post("/v1/completions", completion().replace(
        b'"prompt"', b'"logit_bias": {"1": 0, "1": 5}, "prompt"')), 400, "logit_bias.1", None),
    "prompt twice to /tokenize": (post("/tokenize", b'{"prompt": "a", "prompt": "b"}'), 400,
                                  "prompt", None),
    # every field of a message is read, or refused: nothing the prompt would drop
    "an unknown key in a message": (post("/v1/chat/completions", conversation(
        USER | {"foo": 1})), 400, "messages[0].foo", None),
    "temperature in a message": (post("/v1/chat/completions", conversation(
        USER, USER | {"temperature": 0})), 400, "messages[1].temperature", None),
    "a name the template drops": (post("/v1/chat/completions", conversation(
        USER | {"name": "Ada"})), 400, "messages[0].name", None),
    "an assistant's tool_calls": (post("/v1/chat/completions", conversation(
        USER, TOOL_CALL, USER)), 400, "messages[1].tool_calls", None),
    "tool_calls to /tokenize": (post("/tokenize", json.dumps({"messages": [USER, TOOL_CALL]})
                                     .encode()), 400, "messages[1].tool_calls", None),
    # chat content as parts: text only, each part checked
    "an image part": (post("/v1/chat/completions", parts(
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}})), 400,
        "messages[0].content[1].type", None),
    "an audio part": (post("/v1/chat/completions", parts(
        {"type": "input_audio", "input_audio": {"data": "AA==", "format": "wav"}})), 400,
        "messages[0].content[0].type", None),
    "a file part": (post("/v1/chat/completions", parts(
        {"type": "file", "file": {"file_id": "f"}})), 400, "messages[0].content[0].type", None),
    "an image part to /tokenize": (post("/tokenize", json.dumps({"messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]})
        .encode()), 400, "messages[0].content[0].type", None),
    "a part without a type": (post("/v1/chat/completions", parts({"text": "hi"})), 400,
                              "messages[0].content[0]", None),
    "a text part of a number": (post("/v1/chat/completions", parts({"type": "text",
                                                                    "text": 5})), 400,
                                "messages[0].content[0].text", None),
    "a text part with a key more": (post("/v1/chat/completions", parts(
        {"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}})), 400,
        "messages[0].content[0].cache_control", None),
    "no parts": (post("/v1/chat/completions", parts()), 400, "messages[0].content", None),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_requests_get_openai_errors_and_the_server_lives_on(served, case):
    online, url, client = served
    raw, status, param, code = HOSTILE[case]
    got, headers, body = exchange(url, raw)
    assert got == status, body
    assert headers["content-type"] == "application/json", body
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["message"]
    assert body["error"]["param"] == param and body["error"]["code"] == code, body
    assert urllib.request.urlopen(url + "/health", timeout=5).status == 200
    reply = client.completions.create(model=NAME, prompt="hi", max_tokens=2)
    assert reply.choices[0].finish_reason in ("stop", "length")


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

    from minitransformer.config import load_config
    from minitransformer.checkpoints.real_model import NAME as SMOLLM2, is_imported
    from minitransformer.checkpoints.synth import weights_dir
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


class HeldTokenizer:
    """A tokenizer backend that, once armed, holds the next encoding until told to go on: a
    tokenization as long as the test wants, whatever the machine's speed."""

    def __init__(self, backend):
        self.backend, self.armed = backend, False
        self.started, self.go = threading.Event(), threading.Event()

    def encode_batch(self, *args, **kwargs):
        if self.armed:
            self.started.set()
            self.go.wait(timeout=60)
        return self.backend.encode_batch(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.backend, name)


@contextlib.contextmanager
def held_in_tokenization(model, read_timeout=READ_TIMEOUT_S):
    """A server whose tokenizer holds its next encoding (HeldTokenizer), and a completion
    request sent to it, held there -> (its server, the HeldTokenizer, the request's thread, a
    list its exchange() goes to). The request goes on once held.go is set."""
    from dataclasses import replace

    held = HeldTokenizer(model.tokenizer.backend)
    served = replace(model, tokenizer=replace(model.tokenizer, backend=held))
    online = OnlineEngine(Engine(served, EngineConfig(max_num_seqs=1, num_gpu_blocks_override=16,
                                                      block_size=4)))
    server = Background(create_app(online, NAME), read_timeout)
    try:
        done = []
        held.armed = True
        request = threading.Thread(target=lambda: done.append(exchange(server.url, post(
            "/v1/completions", completion(prompt="The robot counted boats.")))))
        request.start()
        assert held.started.wait(timeout=30)
        yield server, held, request, done
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


def test_cancelled_requests_are_counted_as_abort(served):
    online, url, client = served

    def aborted():
        text = urllib.request.urlopen(url + "/metrics").read().decode()
        line = f'vllm:request_success_total{{finished_reason="abort",model_name="{NAME}"}} '
        return int(next(s for s in text.splitlines() if s.startswith(line)).split()[-1])

    before = aborted()
    stream = client.completions.create(model=NAME, prompt="Once upon a time", max_tokens=150,
                                       stream=True, extra_body={"ignore_eos": True})
    next(iter(stream))
    stream.close()                  # the client goes away mid-answer
    wait_for(lambda: aborted() == before + 1)
    client.completions.create(model=NAME, prompt="The end", max_tokens=3)
    assert aborted() == before + 1  # a finished request is not an abort
    stream = client.completions.create(model=NAME, prompt="Once upon a time", max_tokens=150,
                                       n=2, stream=True, extra_body={"ignore_eos": True})
    next(iter(stream))
    stream.close()                  # two samples, each counted as its own finished sequence
    wait_for(lambda: aborted() == before + 3)


def test_a_model_name_is_escaped_in_the_metrics_labels():
    """--served-model-name is the client's word; quoted into a label it must stay one label."""
    from minitransformer.serve.prometheus import ServingMetrics

    assert ServingMetrics('my "best"\\model\n').labels == \
        'model_name="my \\"best\\"\\\\model\\n"'


# --- a server left running --------------------------------------------------------------------
def footprint(*objects) -> dict:
    """The length of every list, dict, deque and set the objects hold: what grows if something
    is kept per request or per step."""
    return {(type(o).__name__, name): len(value) for o in objects
            for name, value in vars(o).items() if isinstance(value, (list, dict, deque, set))}


def metric_samples(url) -> dict:
    text = urllib.request.urlopen(url + "/metrics").read().decode()
    return dict(line.rsplit(" ", 1) for line in text.splitlines() if line[:1] != "#")


def test_a_long_run_keeps_no_record_per_request_and_metrics_count_them_all(model):
    """Without history the engine forgets each request once its end is handed over, and keeps
    no per-step list: its footprint after 2N requests is its footprint after N, while /metrics
    has counted every one of them."""
    online = OnlineEngine(Engine(model, EngineConfig(max_num_seqs=2, num_gpu_blocks_override=32,
                                                     block_size=4)))
    server = Background(create_app(online, NAME))
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    samples = tokens = prompt_tokens = 0

    def requests(count):
        nonlocal samples, tokens, prompt_tokens
        for i in range(count):
            n, stream = 1 + i % 2, i % 3 == 0
            body = dict(model=NAME, prompt=f"Request {samples} of many", max_tokens=3, n=n,
                        logprobs=i % 2, temperature=0.5, seed=i)
            if stream:
                chunks = list(client.completions.create(
                    stream=True, stream_options={"include_usage": True}, **body))
                usage = chunks[-1].usage
            else:
                usage = client.completions.create(**body).usage
            samples, tokens = samples + n, tokens + usage.completion_tokens
            prompt_tokens += usage.prompt_tokens
        wait_for(lambda: not online.live and online.snapshot.running == 0)
        cache = online.engine.cache             # its lists and maps: at most one per block
        assert max(footprint(cache).values()) <= cache.books.num_blocks
        return footprint(online.engine, online)
    try:
        after_n = requests(6)
        assert online.engine.results == {} and online.engine.memory == []
        assert requests(12) == after_n                    # 18 requests: nothing grew
        counted = metric_samples(server.url)
        label = f'model_name="{NAME}"'
        assert sum(int(counted[f'vllm:request_success_total{{finished_reason="{r}",{label}}}'])
                   for r in ("stop", "length", "abort")) == samples
        assert int(counted[f"vllm:generation_tokens_total{{{label}}}"]) == tokens
        assert int(counted[f"vllm:prompt_tokens_total{{{label}}}"]) == prompt_tokens
        assert int(counted[f"vllm:e2e_request_latency_seconds_count{{{label}}}"]) == samples
    finally:
        server.stop()
        online.close()


def test_history_keeps_the_timeline_and_run_hands_its_records_over():
    """An experiment asks for the timeline (history=True): a decode entry per decoding step, a
    pool reading per step. Without it run() still returns every record, and the engine keeps
    none of them once run() is over."""
    from minitransformer.checkpoints.synth import random_model
    model = random_model(qwen2_config())
    requests = [Request((1, 2, 3), 4, eos_token_id=[]), Request((4, 5), 2, eos_token_id=[])]
    kept = Engine(model, EngineConfig(max_num_seqs=2), history=True)
    run = kept.run(requests)
    assert len(run.memory) == run.steps and len(run.decode_times) == run.steps - 1
    assert sorted(kept.results) == [0, 1] and [len(r.tokens) for r in run.results] == [4, 2]
    lean = Engine(model, EngineConfig(max_num_seqs=2))
    run = lean.run(requests)
    assert [len(r.tokens) for r in run.results] == [4, 2] and lean.results == {}
    assert run.memory == run.decode_times == run.prefill_times == ()
    rid = lean.submit(requests[0])
    with pytest.raises(ValueError, match="not over"):
        lean.release(rid)           # a running request's record is never dropped


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


def test_long_stop_strings_cost_the_server_linear_work_and_keep_the_answer_whole(
        served, model, monkeypatch):
    """Four stop strings of the longest length taken, each beginning with the very text the
    answer will be (greedy), so that every token keeps them partly matched, the most work a
    stop string can ask for. The server's matching is the counted automata's: every character
    of the answer fed once, and at most 2 moves per character and string in all (a stream that
    scanned its held-back text again for each token would do about a token count times more).
    That work, not a time, is what keeps the loop free: /health answers meanwhile and after.
    The answer is the whole text (no stop string completed; what was held back is sent at the
    end)."""
    from minitransformer.serve.detokenize import StopStrings
    from minitransformer.serve.openai_api import MAX_STOP_CHARS

    fed, feed = [], StopStrings.feed

    def counted(self, text):
        before = self.moves
        found = feed(self, text)
        fed.append((len(text), self.moves - before, len(self.stops)))
        return found
    monkeypatch.setattr(StopStrings, "feed", counted)
    online, url, client = served
    prompt = "Once upon a time"
    tokens, text, _ = expected(model, model.tokenizer.encode(prompt), 60)
    stops = [(text + "\x00" + str(k)).ljust(MAX_STOP_CHARS, "\x01") for k in range(4)]
    done = []

    def ask():
        done.append(client.completions.create(model=NAME, prompt=prompt, max_tokens=60,
                                              temperature=0, stop=stops, stream=True))
        done.append("".join(c.choices[0].text for c in done.pop() if c.choices))
    thread = threading.Thread(target=ask)
    thread.start()
    while thread.is_alive():    # timeout: a loop that never answers fails, a slow one not
        assert urllib.request.urlopen(url + "/health", timeout=30).status == 200
        time.sleep(0.01)
    thread.join()
    assert done == [text]
    assert urllib.request.urlopen(url + "/health", timeout=30).status == 200
    assert sum(n for n, _, _ in fed) == len(text) and {k for _, _, k in fed} == {4}
    assert len(fed) >= len(tokens) - 1 and sum(m for _, m, _ in fed) <= 2 * len(text) * 4


def test_the_server_module_imports_without_the_serve_extra():
    """The library imports without fastapi (doctests collect every module); the server says
    what to install when it is asked for."""
    code = ("import sys; sys.modules['fastapi'] = None\n"
            "from minitransformer.serve import http\n"
            "try:\n    http.create_app(None, 'x')\n"
            "except ImportError as e:\n    print(e)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "the server needs the serve extra: pip install -e '.[serve]'\n"


def test_a_stream_left_before_its_first_chunk_is_cancelled_and_counted(model):
    """A client gone while the answer is starting, before the stream's first chunk (the stream
    never started, so its own cleanup never ran): its request is cancelled and counted as an
    abort all the same. Played at the ASGI level: the response's start is never sent, and
    the client says it left."""
    import asyncio

    online = OnlineEngine(Engine(model, EngineConfig(max_num_seqs=1, block_size=4)))
    app = create_app(online, NAME)
    body = json.dumps({"model": NAME, "prompt": [5, 6], "max_tokens": 100, "stream": True,
                       "ignore_eos": True}).encode()
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
             "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"",
             "root_path": "", "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80),
             "headers": [(b"content-type", b"application/json"),
                         (b"content-length", str(len(body)).encode())]}

    async def client():
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive():
            return messages.pop(0) if messages else {"type": "http.disconnect"}

        async def send(message):
            if message["type"] == "http.response.start":
                await asyncio.Event().wait()        # held: no chunk ever goes out
        await app(scope, receive, send)
    try:
        asyncio.run(asyncio.wait_for(client(), 60))
        metrics = app.state.serving.metrics
        wait_for(lambda: 'finished_reason="abort",model_name="tiny-chat"} 1' in
                 metrics.render(online.snapshot))
        assert online.snapshot.running == online.snapshot.waiting == 0
    finally:
        online.close()
