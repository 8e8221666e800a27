"""A value nested as deep as the JSON decoder takes, in any field a client sends (``prompt``,
``stop``, ``messages``, a batch's prompt, ``logit_bias`` and their neighbours, as arrays and
as objects), is a 400 naming that field, never a 500: the error names a bad value by its field
and what JSON shows of its start (``openai_api.json_text``), never by serializing it whole,
which recursed as deep as the value and failed one level short of the decoder's own limit.
Depths are tried up to where the decoder itself refuses the body (a 400 naming no field), so
the test holds whatever the stack depth the server runs at."""
import json

import pytest

pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
from servers import NAME, exchange, post

DEPTHS = 48         # depths tried below the decoder's limit (where json.dumps once failed:
                    # one or two below it, as deep as the error's own call sits)
BODY = {"model": NAME, "prompt": "hi", "max_tokens": 2}
USER = {"role": "user", "content": "hi"}
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


def request(case, depth, kind) -> bytes:
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
        status, _, body = exchange(url, request("prompt", mid, "array"))
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
        status, _, body = exchange(url, request(case, depth, kind))
        assert status == 400, (depth, body)
        error = body["error"]
        if error["param"] is None:      # past the decoder's limit
            assert "too deeply" in error["message"], (depth, error)
        else:                           # the field, or a place within it
            assert error["param"] == param or error["param"].startswith(param + "["), \
                (depth, error)
        assert len(error["message"]) < 600, (depth, error)
    assert error["param"] is None       # past the limit, the decoder refused it
