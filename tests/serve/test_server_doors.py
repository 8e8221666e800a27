"""Who may ask the server, and how: the API key, the body's type and encoding, chat content as
parts, clients too slow to send a request, and each `serve` flag reaching the server it starts.
Over real HTTP on 127.0.0.1 and the real ``openai`` client; the refusals themselves are cases
of the hostile corpus (test_server_hostile.HOSTILE, KEYLESS below)."""
import argparse
import json
import select
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import replace
from types import SimpleNamespace

import pytest

pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
import openai
import uvicorn

import minitransformer.__main__ as cli
from minitransformer.chat import encode_chat
from minitransformer.kernels import threads
from minitransformer.serve import http as server_module
from minitransformer.serve.config import EngineConfig
from minitransformer.serve.engine import Engine
from minitransformer.serve.http import create_app
from minitransformer.serve.online import OnlineEngine
from servers import (
    NAME,
    ROOT,
    Background,
    completion,
    exchange,
    held_in_tokenization,
    inherited,
    post,
    post_json,
    serve_command,
)

KEY = "sk-test-7f3a9c1e5b"


# --- the body: only JSON, only UTF-8 --------------------------------------------------------
def without_type(path, body: bytes):
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n"
            f"Connection: close\r\n\r\n").encode() + body


@pytest.mark.parametrize("raw", [
    without_type("/v1/completions", completion()),     # no Content-Type: taken as JSON
    post("/v1/completions", completion(), "application/json; charset=utf-8"),
    post("/v1/completions", completion(), "Application/JSON;charset=UTF-8"),
    post("/v1/completions", completion(), "application/vnd.api+json"),
    post("/v1/completions", completion()).replace(b"Host: x", b"Host: x\r\nOrigin: null"),
    post("/v1/completions", b"\xef\xbb\xbf" + completion()),     # a UTF-8 BOM
    without_type("/tokenize", b'{"prompt": "hi"}'),
    post("/v1/chat/completions", json.dumps({"model": NAME, "max_tokens": 2, "messages": [
        {"role": "user", "content": "hi", "name": None, "tool_calls": None}]}).encode()),
], ids=["no type", "charset", "capitals", "+json", "JSON from a page", "BOM",
        "tokenize, no type", "null message fields"])
def test_json_bodies_are_served_with_or_without_a_content_type(served, raw):
    """What stays accepted beside the new refusals: no Content-Type at all (from anything but
    a web page), JSON's with parameters or in capitals, a +json type (from a page too), a UTF-8
    BOM, message fields that are null."""
    online, url, client = served
    status, _, reply = exchange(url, raw)
    assert status == 200, reply


def test_the_415_says_which_header_and_how_to_send_it(served):
    online, url, client = served
    status, headers, reply = exchange(url, post("/v1/completions", completion(), "text/plain"))
    assert status == 415 and reply["error"]["message"] == (
        "the body's Content-Type is 'text/plain', not JSON: send JSON with the header "
        "'Content-Type: application/json'")


def test_a_duplicate_key_is_named_by_its_path_and_utf16_by_its_encoding(served):
    online, url, client = served
    body = (b'{"model": "tiny-chat", "max_tokens": 2, "messages": [{"role": "user", '
            b'"content": "a"}, {"role": "user", "content": "b", "content": "c"}]}')
    status, _, reply = exchange(url, post("/v1/chat/completions", body))
    assert status == 400 and reply["error"]["param"] == "messages[1].content"
    assert "'messages[1].content' is given twice" in reply["error"]["message"]
    status, _, reply = exchange(url, post("/v1/completions",
                                          completion().decode().encode("utf-32-le")))
    assert status == 400 and "UTF-32-LE, not UTF-8" in reply["error"]["message"]


# --- chat content as parts --------------------------------------------------------------------
def test_text_parts_are_joined_with_newlines_through_the_real_client(served, model):
    """[{"type": "text"}, ...] is the text of its parts joined with "\\n" (vLLM's join),
    each exactly as sent, its spaces and newlines kept: the same prompt, so the same greedy
    answer, as that string; /tokenize lays it out the same. Any other part type is a 400
    naming it and where it is."""
    online, url, client = served
    content = [{"type": "text", "text": " The cat\n"}, {"type": "text", "text": "\tsat down. "}]
    joined = [{"role": "user", "content": " The cat\n\n\tsat down. "}]
    as_parts = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": content}], max_tokens=6,
        temperature=0)
    as_text = client.chat.completions.create(model=NAME, messages=joined, max_tokens=6,
                                             temperature=0)
    assert as_parts.choices[0].message.content == as_text.choices[0].message.content
    assert as_parts.usage.prompt_tokens == len(encode_chat(model, joined))
    status, reply = post_json(url, "/tokenize", {"messages": [{"role": "user",
                                                               "content": content}]})
    assert status == 200 and reply["tokens"] == encode_chat(model, joined)
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=NAME, max_tokens=2, messages=[{
            "role": "user", "content": [{"type": "text", "text": "What is this?"},
                                        {"type": "image_url", "image_url": {"url": "x"}}]}])
    assert caught.value.body["param"] == "messages[0].content[1].type"
    assert "'image_url'" in caught.value.body["message"]


def test_message_fields_the_template_reads_pass(tmp_path, model):
    """The rule is "read or refused", not a fixed list: under a template that reads `name`,
    a message's name is taken (and changes the prompt); null stands for absent."""
    template = ("{% for m in messages %}{{ m['role'] }}{% if m.name %} ({{ m.name }}){% endif %}"
                ": {{ m['content'] }}\n{% endfor %}")
    named = replace(model, tokenizer=replace(model.tokenizer, chat_template=template))
    online = OnlineEngine(Engine(named, EngineConfig(max_num_seqs=1, num_gpu_blocks_override=16,
                                                     block_size=4)))
    server = Background(create_app(online, NAME))
    try:
        status, with_name = post_json(server.url, "/tokenize", {"messages": [
            {"role": "user", "content": "hi", "name": "Ada"}]})
        assert status == 200, with_name
        status, with_null = post_json(server.url, "/tokenize", {"messages": [
            {"role": "user", "content": "hi", "name": None}]})
        assert status == 200 and with_null["tokens"] != with_name["tokens"]
        status, reply = post_json(server.url, "/tokenize", {"messages": [
            {"role": "user", "content": "hi", "names": "Ada"}]})
        assert status == 400 and reply["error"]["param"] == "messages[0].names"
    finally:
        server.stop()
        online.close()


# --- the API key ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def keyed(model):
    online = OnlineEngine(Engine(model, EngineConfig(max_num_seqs=2, num_gpu_blocks_override=32,
                                                     block_size=4)))
    server = Background(create_app(online, NAME, api_key=KEY))
    yield server.url
    server.stop()
    online.close()


def request(method, path, body=None, authorization=None) -> bytes:
    head = f"{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
    if authorization is not None:
        head += f"Authorization: {authorization}\r\n"
    if body is not None:
        head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    return (head + "\r\n").encode() + (body or b"")


ROUTES = [("GET", "/v1/models", None), ("POST", "/v1/completions", completion()),
          ("POST", "/v1/chat/completions", json.dumps({
              "model": NAME, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
           .encode()),
          ("POST", "/tokenize", b'{"prompt": "hi"}'), ("POST", "/detokenize", b'{"tokens": [5]}'),
          ("GET", "/tokenizer_info", None)]
KEYLESS = {  # what a client without the key sends -> the Authorization header (None: none)
    "no header": None, "a wrong key": "Bearer sk-wrong", "the key, Basic": f"Basic {KEY}",
    "the key and more": f"Bearer {KEY}x", "the key less one": f"Bearer {KEY[:-1]}",
    "Bearer alone": "Bearer", "the key alone": KEY, "the key twice": f"Bearer {KEY} {KEY}"}


@pytest.mark.parametrize("route", ROUTES + [("GET", "/v1/nowhere", None)],
                         ids=lambda r: r[1])
@pytest.mark.parametrize("case", sorted(KEYLESS))
def test_without_the_key_the_api_answers_401_and_never_shows_a_key(keyed, route, case):
    method, path, body = route
    status, headers, reply = exchange(keyed, request(method, path, body, KEYLESS[case]))
    assert status == 401 and headers["www-authenticate"] == "bearer", reply  # (lowered)
    assert reply["error"]["code"] == "invalid_api_key" and reply["error"]["param"] is None
    assert reply["error"]["type"] == "invalid_request_error"
    assert KEY not in json.dumps(reply) and KEY[:8] not in json.dumps(reply)


@pytest.mark.parametrize("route", ROUTES, ids=lambda r: r[1])
def test_with_the_key_every_route_answers_and_health_and_metrics_need_none(keyed, route):
    method, path, body = route
    for scheme in ("Bearer", "bearer"):         # the scheme's case does not matter (RFC 9110)
        status, _, reply = exchange(keyed, request(method, path, body, f"{scheme} {KEY}"))
        assert status == 200, reply
    for open_path in ("/health", "/metrics"):
        assert urllib.request.urlopen(keyed + open_path, timeout=5).status == 200


@pytest.mark.parametrize("route", ROUTES, ids=lambda r: r[1])
@pytest.mark.parametrize("order", ["the key first", "the key last", "the key twice"])
def test_two_authorization_headers_are_a_400_whichever_holds_the_key(keyed, route, order):
    """Starlette and proxies read the first of two headers, a dict of them keeps the last: a
    request holding two is refused, so no two readers of it disagree on who sent it."""
    method, path, body = route
    first, last = {"the key first": (KEY, "sk-wrong"), "the key last": ("sk-wrong", KEY),
                   "the key twice": (KEY, KEY)}[order]
    raw = request(method, path, body, f"Bearer {first}\r\nAuthorization: Bearer {last}")
    status, _, reply = exchange(keyed, raw)
    assert status == 400, reply
    assert "2 Authorization headers" in reply["error"]["message"]
    assert reply["error"]["code"] == "invalid_api_key" and KEY not in json.dumps(reply)


def test_the_openai_client_with_the_key_is_served_and_without_it_refused(keyed, monkeypatch):
    """The real client: api_key=KEY works for completions, chat and models; a wrong key is an
    AuthenticationError. The comparison goes through hmac.compare_digest (constant time)."""
    compared = []
    real = server_module.hmac.compare_digest
    monkeypatch.setattr(server_module.hmac, "compare_digest",
                        lambda a, b: compared.append(1) or real(a, b))
    client = openai.OpenAI(base_url=keyed + "/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in client.models.list().data] == [NAME]
    # (served: an answer of its 2 tokens; sampled, their text may be held back as part of a
    # character, so it is not what is checked)
    assert client.completions.create(model=NAME, prompt="hi", max_tokens=2).usage \
        .completion_tokens == 2
    assert client.chat.completions.create(model=NAME, max_tokens=2, messages=[
        {"role": "user", "content": "hi"}]).choices[0].finish_reason in ("stop", "length")
    assert len(compared) == 3
    wrong = openai.OpenAI(base_url=keyed + "/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as caught:
        wrong.completions.create(model=NAME, prompt="hi", max_tokens=2)
    assert caught.value.status_code == 401 and caught.value.body["code"] == "invalid_api_key"


def test_serve_takes_the_key_from_mt_api_key_and_never_prints_it(model):
    """The command: MT_API_KEY (or --api-key) is required of clients; the key appears in none
    of the process's output, whatever the clients send; an empty or unprintable key is
    refused before the model loads, without showing it."""
    process, client = serve_command(model, env={"MT_API_KEY": KEY}, api_key=KEY)
    try:
        assert client.completions.create(model=NAME, prompt="hi", max_tokens=2).choices
        for wrong in ("sk-wrong", KEY[:-1]):
            with pytest.raises(openai.AuthenticationError):
                openai.OpenAI(base_url=str(client.base_url), api_key=wrong,
                              max_retries=0).models.list()
    finally:
        process.kill()
        process.wait()
    err = process.stderr.read()
    assert "an API key required" in err and KEY not in err and KEY[:-1] not in err
    for key, env in (("", {}), ("sk key", {}), (None, {"MT_API_KEY": ""})):
        option = [] if key is None else ["--api-key", key]
        bad = subprocess.run([sys.executable, "-m", "minitransformer", "serve", "--model",
                              model.path, *option], cwd=ROOT, capture_output=True, text=True,
                             env=inherited() | env, timeout=60)
        assert bad.returncode == 2 and bad.stderr.startswith("error: the API key"), bad.stderr
        assert "serving" not in bad.stderr and (not key or key not in bad.stderr)


def test_server_limits_refuse_what_could_never_work():
    """--max-waiting 0 would refuse every request; a read timeout must be a time."""
    from minitransformer.serve.http import ServerLimits
    with pytest.raises(ValueError, match="max_waiting=0: expected an integer >= 1"):
        ServerLimits(max_waiting=0)
    for bad in (0, -1.0, float("inf"), float("nan"), "5", True):
        with pytest.raises(ValueError, match="read_timeout"):
            ServerLimits(read_timeout=bad)
    assert KEY not in repr(ServerLimits(api_key=KEY))      # a repr may reach a log


# --- slow clients -----------------------------------------------------------------------------
TIMEOUT = 1.0                   # the test servers' --read-timeout


@pytest.fixture(scope="module")
def impatient(model):
    online = OnlineEngine(Engine(model, EngineConfig(max_num_seqs=2, num_gpu_blocks_override=32,
                                                     block_size=4)))
    server = Background(create_app(online, NAME), read_timeout=TIMEOUT)
    yield online, server.url
    server.stop()
    online.close()


def drip(url, start: bytes, byte: bytes, every=0.1, bound=10.0) -> tuple:
    """Send start, then one byte every `every` seconds, until the server answers or closes
    (or `bound` seconds pass) -> (seconds until then, what it sent back)."""
    host, port = url.removeprefix("http://").split(":")
    begun = time.monotonic()    # before the server's clock starts, on its connection
    with socket.create_connection((host, int(port)), timeout=bound) as sock:
        sock.sendall(start)
        while time.monotonic() - begun < bound:
            if select.select([sock], [], [], every)[0]:
                reply = b""
                while more := sock.recv(65536):     # until the server closes
                    reply += more
                return time.monotonic() - begun, reply
            try:
                sock.sendall(byte)
            except OSError:         # closed under our feet: read what came before
                continue
    return time.monotonic() - begun, None


def as_json(reply: bytes) -> tuple:
    head, _, body = reply.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


@pytest.mark.parametrize("start, byte", [
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ", b"a"),         # slow head
    (b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ", b"a"),                 # any route
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
     b"Content-Length: 400\r\n\r\n" + completion()[:-1], b" "),            # slow body
], ids=["head", "head of a GET", "body"])
def test_a_request_sent_a_byte_at_a_time_gets_408_and_is_disconnected(impatient, start, byte):
    online, url = impatient
    took, reply = drip(url, start, byte)
    assert reply is not None, "never timed out"
    status, body = as_json(reply)
    assert status == 408 and body["error"]["code"] == "request_timeout", body
    assert "--read-timeout" in body["error"]["message"]
    assert TIMEOUT <= took < TIMEOUT + 5        # 5: a loaded machine's slack
    assert urllib.request.urlopen(url + "/health", timeout=5).status == 200


def test_a_connection_that_sends_nothing_is_closed_without_an_answer(impatient):
    online, url = impatient
    took, reply = drip(url, b"", b"", every=0.1)
    assert reply == b"" and TIMEOUT <= took < TIMEOUT + 5


def test_the_timeout_is_per_request_and_ends_when_the_request_is_in(impatient, model):
    """A kept-alive connection asking again and again, over longer than the timeout in all,
    is served each time; and a request that arrived whole is answered however long it then
    takes (its tokenization held open here past the timeout)."""
    online, url = impatient
    host, port = url.removeprefix("http://").split(":")
    ask = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        begun = time.monotonic()
        while time.monotonic() - begun < 2.5 * TIMEOUT:
            sock.sendall(ask)
            assert sock.recv(65536).startswith(b"HTTP/1.1 200")
            time.sleep(TIMEOUT / 2)
        idle = time.monotonic()     # then nothing: closed once read_timeout has passed since
        assert select.select([sock], [], [], 10)[0] and sock.recv(65536) == b""    # the answer
        assert time.monotonic() - idle < 4      # not after uvicorn's 5 s of keep-alive
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(ask)
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        sock.sendall(ask[:10])      # the next request, never finished
        assert select.select([sock], [], [], 10)[0]
        assert sock.recv(65536).startswith(b"HTTP/1.1 408")
    with held_in_tokenization(model, TIMEOUT) as (server, held, request, done):
        time.sleep(2 * TIMEOUT)     # the request is in: no timer runs on it now
        held.go.set()
        request.join(30)
        assert done and done[0][0] == 200, done


# --- each serve flag reaches the server it starts ---------------------------------------------
SPEC = '{"method": "ngram", "num_speculative_tokens": 2}'
FLAGS = {  # option -> (its arguments, whether the started server `s` (below) shows them)
    "--model": (None, lambda s: s.app.online.model.path == s.path),
    "--host": (["localhost"], lambda s: s.bound[0] == "localhost"),
    "--port": (["8123"], lambda s: s.bound[1] == 8123),
    "--served-model-name": (["flagged"], lambda s: s.app.name == "flagged"),
    "--max-num-seqs": (["3"], lambda s: s.config.max_num_seqs == 3),
    "--num-gpu-blocks-override": (["40"], lambda s: s.app.online.sizes.num_blocks == 40),
    "--block-size": (["8"], lambda s: s.app.online.sizes.block_size == 8),
    "--policy": (["static"], lambda s: s.config.policy == "static"),
    "--max-waiting": (["5"], lambda s: s.app.online.max_waiting == 5),
    "--batch-invariant": ([], lambda s: s.config.batch_invariant),
    "--enable-prefix-caching": ("--no-enable-prefix-caching",
                                lambda s: s.config.enable_prefix_caching is False),
    "--max-num-batched-tokens": (["32"], lambda s: s.config.max_num_batched_tokens == 32),
    "--drain-timeout": (["7.5"], lambda s: s.run.timeout_graceful_shutdown ==
                        7.5 + server_module.CUT_GRACE_S),
    "--max-request-bytes": (["123456"], lambda s: s.app.limit == 123456),
    "--read-timeout": (["9.5"], lambda s: s.run.http.timeout == 9.5),
    "--api-key": ([KEY], lambda s: s.answers(KEY) and not s.answers("sk-wrong")),
    "--kv-cache-dtype": (["q8_0"], lambda s: s.config.kv_cache_dtype == "q8_0"),
    "--attention": (["tiled"], lambda s: s.config.attention == "tiled"),
    "--speculative-config": ([SPEC], lambda s: getattr(s.config.speculative_config,
                                                       "num_speculative_tokens", None) == 2),
    "--threads": (["2"], lambda s: s.threads == 2),
}


def serve_options() -> set:
    """Every option `serve` parses (its first spelling), --help aside."""
    commands = next(a for a in cli.parser()._actions
                    if isinstance(a, argparse._SubParsersAction))
    return {a.option_strings[0] for a in commands.choices["serve"]._actions
            if a.option_strings and a.dest != "help"}


def started(model, monkeypatch, argv) -> SimpleNamespace:
    """`python3 -m minitransformer serve ARGV` run in this process up to uvicorn's
    Server.run, which is caught (nothing listens; the socket is bound to a free port of
    127.0.0.1 whatever the flags) -> the server it started: its App (``app``) and engine
    config, uvicorn's Config (``run``), the (host, port) it was to bind (``bound``), and
    ``answers(key)``: whether /v1/models answers that key, through the app's own middleware."""
    from starlette.testclient import TestClient

    caught, real_bind = {}, server_module.bound_socket
    monkeypatch.setattr(uvicorn.Server, "run",
                        lambda self, sockets=None: caught.update(config=self.config))
    monkeypatch.setattr(server_module, "bound_socket", lambda host, port: (
        caught.update(bound=(host, port)) or real_bind("127.0.0.1", 0)))
    monkeypatch.delenv("MT_API_KEY", raising=False)
    before = threads.count(), threads.SET_BY
    blas = [lib.get_num_threads() for lib in threads.controllers()]
    cli.main(["serve", *argv])
    ran_on = threads.count()                   # --threads holds for the process: put back
    threads.set_count(*before, blas=False)
    for lib, n in zip(threads.controllers(), blas, strict=True):
        lib.set_num_threads(n)
    asgi = caught["config"].app

    def answers(key) -> bool:
        with TestClient(asgi) as client:
            return client.get("/v1/models", headers={"Authorization": f"Bearer {key}"}
                              ).status_code == 200
    app = asgi.state.serving
    return SimpleNamespace(app=app, config=app.online.engine.config, run=caught["config"],
                           bound=caught["bound"], answers=answers, path=str(model.path),
                           threads=ran_on)


def test_every_serve_flag_reaches_the_server_it_starts(model, monkeypatch):
    """Each option of `serve`, given a value other than its default, is seen by the server
    the command starts (a flag parsed and dropped on the way fails here); FLAGS names every
    option serve has, so a new one must say how it is seen; and with the defaults every check
    but --model's fails, so each can."""
    assert serve_options() == set(FLAGS)
    argv = ["--model", str(model.path)]
    for option, (arguments, _) in FLAGS.items():
        if arguments is not None:
            argv += [arguments] if isinstance(arguments, str) else [option, *arguments]
    server = started(model, monkeypatch, argv)
    assert [option for option, (_, seen) in FLAGS.items() if not seen(server)] == []
    default = started(model, monkeypatch, ["--model", str(model.path)])
    assert [option for option, (_, seen) in FLAGS.items() if seen(default)] == ["--model"]
