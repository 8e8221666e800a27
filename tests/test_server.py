"""The OpenAI-compatible server, driven by the official ``openai`` client over real HTTP on
127.0.0.1: every answer's text is the text of ``generate`` alone, streamed or not."""
import json
import socket
import threading
import time
import urllib.request

import pytest

from conftest import wait_for
import minitransformer as mt
from minitransformer.chat import encode_chat
from minitransformer.sampling import SamplingSettings
from minitransformer.serve.engine import Engine
from minitransformer.serve.online import OnlineEngine
from minitransformer.serve.records import Request
from minitransformer.synth import make_checkpoint, qwen2_config, train_tokenizer

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
from minitransformer.serve.http import create_app  # noqa: E402 (after the skips)

NAME = "tiny-chat"
TEMPLATE = ("{% for m in messages %}<|endoftext|>{{ m['role'] }}: {{ m['content'] }}\n"
            "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")


class Background:
    """A uvicorn server on an ephemeral port of 127.0.0.1, in a thread of this process."""

    def __init__(self, app):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
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
    online = OnlineEngine(Engine(model, slots=4, num_blocks=48, block_size=4,  # 192 tokens
                                 batch_invariant=True))
    server = Background(create_app(online, NAME))
    yield online, server.url, openai.OpenAI(base_url=server.url + "/v1", api_key="none",
                                            max_retries=0)
    server.stop()
    online.close()


def expected(model, ids, max_tokens, **sampling):
    """generate's tokens for these settings, their text and finish_reason."""
    tokens = mt.generate(model, ids, max_tokens, **sampling)
    text = model.tokenizer.decode(ids + tokens)[len(model.tokenizer.decode(ids)):]
    stopped = tokens[-1] in model.eos_token_ids and len(tokens) <= max_tokens
    return tokens, text, "stop" if stopped else "length"


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
    tokens, text, finish = expected(model, model.tokenizer.encode(prompt), 24,
                                    **as_generate(settings))
    reply = client.completions.create(model=NAME, prompt=prompt, max_tokens=24, **settings)
    assert reply.choices[0].text == text and reply.choices[0].finish_reason == finish
    assert reply.usage.completion_tokens == len(tokens)
    chunks = list(client.completions.create(model=NAME, prompt=prompt, max_tokens=24,
                                            stream=True, stream_options={"include_usage": True},
                                            **settings))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert len([c for c in chunks if c.choices and c.choices[0].text]) > 1  # not one lump
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == finish
    assert chunks[-1].usage.completion_tokens == len(tokens) and not chunks[-1].choices


@pytest.mark.parametrize("settings", SETTINGS, ids=["greedy", "seeded"])
def test_chat_text_is_generates_through_the_template(served, model, settings):
    online, url, client = served
    messages = [{"role": "user", "content": "Tell me about the robot."}]
    ids = encode_chat(model, messages)
    tokens, text, finish = expected(model, ids, 20, **as_generate(settings))
    reply = client.chat.completions.create(model=NAME, messages=messages, max_tokens=20,
                                           **settings)
    assert reply.choices[0].message.content == text
    assert reply.choices[0].finish_reason == finish
    assert reply.usage.prompt_tokens == len(ids)
    chunks = list(client.chat.completions.create(model=NAME, messages=messages, max_tokens=20,
                                                 stream=True, **settings))
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
        _, text, _ = expected(model, model.tokenizer.encode(prompt), 30, seed=i, eos_token_id=[],
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
    record = online.engine.results[-1]
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
    assert "".join(c.choices[0].text for c in chunks) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_a_waiting_client_that_gives_up_is_cancelled(model):
    """Not streamed: a client that times out while its request waits leaves the queue."""
    online = OnlineEngine(Engine(model, slots=1, num_blocks=64, block_size=4))
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
    finally:
        server.stop()
        online.close()


def test_bad_requests_get_400_naming_the_field(served, model):
    online, url, client = served
    positions = model.config.max_position_embeddings
    cases = [(dict(model="gpt-4", prompt="hi"), "model"),
             (dict(model=NAME, prompt="hi", n=5), "n"),          # 4 slots
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


def test_full_queue_gets_429_with_retry_after(model):
    online = OnlineEngine(Engine(model, slots=1, num_blocks=64, block_size=4), max_waiting=1)
    server = Background(create_app(online, NAME))
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    try:
        long = client.completions.create(model=NAME, prompt="a", max_tokens=200, stream=True,
                                         extra_body={"ignore_eos": True})
        next(iter(long))            # it holds the only slot
        waiter = threading.Thread(target=client.completions.create,
                                  kwargs=dict(model=NAME, prompt="b", max_tokens=2))
        waiter.start()
        wait_for(lambda: online.snapshot.waiting == 1)
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
    made = sum(len(r.tokens) for r in online.engine.results)
    assert int(samples["vllm:generation_tokens_total" + label]) == made
    assert int(samples["vllm:prompt_tokens_total" + label]) == \
        sum(len(r.request.prompt) for r in online.engine.results)
    results = online.engine.results
    hits = int(samples["vllm:prefix_cache_hits_total" + label])
    assert int(samples["vllm:prefix_cache_queries_total" + label]) == \
        sum(len(r.request.prompt) for r in results if r.prefill_chunks)  # the admitted
    assert hits == sum(r.cached_tokens for r in results) >= results[-1].cached_tokens > 0
    assert results[-1].cached_tokens == (len(results[-1].request.prompt) - 1) // 4 * 4
    assert samples["vllm:num_requests_running" + label] == "0"
    assert float(samples["vllm:kv_cache_usage_perc" + label]) == 0.0
    finished = sum(r.status == "finished" for r in online.engine.results)
    assert int(samples["vllm:e2e_request_latency_seconds_count" + label]) >= finished
    for name in ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                 "vllm:num_preemptions_total", "vllm:num_requests_waiting"):
        assert f"# TYPE {name}" in text


def test_serve_command_drains_answers_in_flight_on_ctrl_c(model):
    """The real command in its own process: Ctrl-C lets a stream in flight finish."""
    import signal
    import subprocess
    import sys
    from pathlib import Path

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    process = subprocess.Popen([sys.executable, "-m", "minitransformer", "serve", "--model",
                                model.path, "--port", str(port), "--served-model-name", NAME],
                               cwd=Path(__file__).resolve().parents[1],
                               stderr=subprocess.PIPE, text=True)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                               max_retries=0)

        def up():
            try:
                return urllib.request.urlopen(f"http://127.0.0.1:{port}/health").status == 200
            except OSError:
                return False
        wait_for(up, timeout=60)
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
