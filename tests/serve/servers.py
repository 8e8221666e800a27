"""The server under test, for the tests/serve/test_server_*.py files: a tiny chat model (the `model`
fixture), a server of it in this process (`Background`, the `served` fixture: one per test file),
the real `serve` command in its own process (`serve_command`), raw HTTP (`exchange`, `post`,
`post_json`), what `generate` alone makes for a prompt (`expected`, `answered`), and the
logprobs and token texts the model itself gives (`reference`, `names`, `TOLERANCE`)."""
import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest

import minitransformer as mt
from conftest import assert_like_solo, wait_for
from engine_fuzz import exact
from minitransformer.logprobs import log_softmax
from minitransformer.sampling import SamplingSettings
from minitransformer.serve.config import EngineConfig
from minitransformer.serve.engine import Engine
from minitransformer.serve.online import OnlineEngine

pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
import openai
import uvicorn

from minitransformer.serve.http import READ_TIMEOUT_S, create_app, http_protocol

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


def inherited() -> dict:
    """This process's environment, less an API key the tester may have set for a server."""
    return {k: v for k, v in os.environ.items() if k != "MT_API_KEY"}


def serve_command(model, *options, env=None, api_key="none"):
    """`python3 -m minitransformer serve` in its own process on a free port of 127.0.0.1, once
    /health answers -> (process, an openai client of it, sending api_key). The caller kills
    the process. env: variables added to this process's.
    Its products of a few rows take the flat route (MT_PRODUCTS): the route is otherwise measured
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


# --- logprobs and tokens, against the model itself ---------------------------------------------
TOLERANCE = 1e-4


def reference(model, prompt_ids, tokens):
    """log_softmax of one full forward pass: the rows that score each of tokens (T, V)."""
    return log_softmax(mt.logits(model, list(prompt_ids) + list(tokens)))[len(prompt_ids) - 1:-1]


def warm(temperature):
    return SamplingSettings(do_sample=True, temperature=temperature)


def names(tokenizer, context, tokens, end=True) -> list:
    """The text each token adds to the output after ``context``, from whole decodes of every
    prefix (not the server's windows): decode(prefix + token) minus the text so far; "" while
    the text ends in an incomplete character, whose bytes the completing token carries (at
    the end, the last token: the text then ends in U+FFFD)."""
    out, done = [], tokenizer.decode(context)
    for i in range(len(tokens)):
        text = tokenizer.decode(list(context) + list(tokens[:i + 1]))
        complete = len(text) > len(done) and not text.endswith("\ufffd")
        out.append(text[len(done):] if complete else "")
        done = text if complete else done
    if end and out:
        out[-1] += tokenizer.decode(list(context) + list(tokens))[len(done):]
    return out


def check_names_index_the_text(tokens, offsets, text):
    """The tokens join to the text, and each text_offset points at its token."""
    assert "".join(tokens) == text
    assert all(text[o:].startswith(t) for o, t in zip(offsets, tokens, strict=True))
    assert offsets == [sum(map(len, tokens[:i])) for i in range(len(tokens))]


def post_json(url, path, body):
    """POST a JSON body -> (status, the reply's JSON), errors included."""
    request = urllib.request.Request(url + path, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
