"""Hostile requests, sent as raw bytes (HOSTILE: numbers and nesting past any sense, lone
surrogates, keys given twice, chat fields and parts the prompt would drop, bytes that are not
HTTP): each gets OpenAI's error body with the status, param and code it names, and the server
lives on.

A value nested as deep as the JSON decoder takes, in any field a client sends (``prompt``,
``stop``, ``messages``, a batch's prompt, ``logit_bias`` and their neighbours, as arrays and
as objects), is a 400 naming that field, never a 500: the error names a bad value by its field
and what JSON shows of its start (``openai_api.json_text``), never by serializing it whole,
which recursed as deep as the value and failed one level short of the decoder's own limit.
Depths are tried up to where the decoder itself refuses the body (a 400 naming no field), so
the test holds whatever the stack depth the server runs at."""
import json
import urllib.request

import pytest

pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
from servers import NAME, chat, completion, conversation, exchange, post

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
    # named where it is, not where an equal object is: the parsed first message equals the second
    "a content twice in the first of two equal messages": (post("/v1/chat/completions", (
        b'{"model": "tiny-chat", "messages": [{"role": "user", "content": "hi", "content": '
        b'"hi"}, {"role": "user", "content": "hi"}]}')), 400, "messages[0].content", None),
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


# ---- a deep value in each field ------------------------------------------------------------------
DEPTHS = 48         # depths tried below the decoder's limit (where json.dumps once failed:
                    # one or two below it, as deep as the error's own call sits)
BODY = {"model": NAME, "prompt": "hi", "max_tokens": 2}
FIELDS = {  # name -> (path, body with DEEP where the deep value goes, the param named)
    "prompt": ("/v1/completions", {"prompt": "DEEP"}, "prompt"),
    "a batch's prompt": ("/v1/completions", {"prompt": [[1, 2], "DEEP"]}, "prompt"),
    "a batch of texts": ("/v1/completions", {"prompt": ["hi", "DEEP"]}, "prompt"),
    "stop": ("/v1/completions", {"stop": "DEEP"}, "stop"),
    "logit_bias": ("/v1/completions", {"logit_bias": "DEEP"}, "logit_bias"),
    "a logit_bias entry": ("/v1/completions", {"logit_bias": {"1": "DEEP"}}, "logit_bias"),
    "temperature": ("/v1/completions", {"temperature": "DEEP"}, "temperature"),
    "seed": ("/v1/completions", {"seed": "DEEP"}, "seed"),
    "stream": ("/v1/completions", {"stream": "DEEP"}, "stream"),
    "user": ("/v1/completions", {"user": "DEEP"}, "user"),
    "model": ("/v1/completions", {"model": "DEEP"}, "model"),
    "response_format": ("/v1/completions", {"response_format": "DEEP"}, "response_format"),
    "messages": ("/v1/chat/completions", {"prompt": None, "messages": "DEEP"}, "messages"),
    "a message": ("/v1/chat/completions", {"prompt": None, "messages": [USER, "DEEP"]},
                  "messages[1]"),
    "a message's content": ("/v1/chat/completions", {"prompt": None, "messages": [
        {"role": "user", "content": "DEEP"}]}, "messages[0].content"),
    "/tokenize's prompt": ("/tokenize", {"max_tokens": None, "prompt": "DEEP"}, "prompt"),
    "/detokenize's tokens": ("/detokenize", {"max_tokens": None, "prompt": None,
                                             "tokens": "DEEP"}, "tokens"),
}


def deep(depth: int, kind: str) -> bytes:
    """A JSON value nested depth deep: [[[...]]] or {"a": {"a": ...}}."""
    if kind == "array":
        return b"[" * depth + b"]" * depth
    return b'{"a": ' * (depth - 1) + b"{}" + b"}" * (depth - 1)


def deep_request(case, depth, kind) -> bytes:
    path, fields, _ = FIELDS[case]
    body = {k: v for k, v in (BODY | fields).items() if v is not None}
    text = json.dumps(body).encode().replace(b'"DEEP"', deep(depth, kind))
    return post(path, text)


def decoder_limit(url) -> int:
    """The deepest nesting the server's decoder takes in a prompt (found by bisection: above
    it the body is refused as too deep, naming no field)."""
    low, high = 1, 100_000          # low is taken, high refused
    while high - low > 1:
        mid = (low + high) // 2
        status, _, body = exchange(url, deep_request("prompt", mid, "array"))
        refused = status == 400 and body["error"]["param"] is None
        low, high = (low, mid) if refused else (mid, high)
    return low


@pytest.fixture(scope="module")
def limit(served):
    return decoder_limit(served[1])


@pytest.mark.parametrize("kind", ["array", "object"])
@pytest.mark.parametrize("case", sorted(FIELDS))
def test_a_deep_value_is_a_400_naming_its_field_up_to_the_decoders_limit(served, limit, case,
                                                                          kind):
    url, param = served[1], FIELDS[case][2]
    for depth in range(limit + 1 - DEPTHS, limit + 3):
        status, _, body = exchange(url, deep_request(case, depth, kind))
        assert status == 400, (depth, body)
        error = body["error"]
        if error["param"] is None:      # past the decoder's limit
            assert "too deeply" in error["message"], (depth, error)
        else:                           # the field, or a place within it
            assert error["param"] == param or error["param"].startswith(param + "["), \
                (depth, error)
        assert len(error["message"]) < 600, (depth, error)
    assert error["param"] is None       # past the limit, the decoder refused it
