"""Hostile requests, sent as raw bytes (HOSTILE: numbers and nesting past any sense, lone
surrogates, keys given twice, chat fields and parts the prompt would drop, bytes that are not
HTTP): each gets OpenAI's error body with the status, param and code it names, and the server
lives on."""
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
