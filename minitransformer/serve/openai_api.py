"""The OpenAI API's request and response bodies, checked and built without any web framework.

A request body becomes a ``Job``: the engine ``Request`` (prompt ids, max_new_tokens, sampling
settings, seed) plus what the HTTP side needs (stop strings, streaming, usage). The field names
and meanings are OpenAI's, with vLLM's extras (``top_k``, ``repetition_penalty``,
``ignore_eos``), so a client written for either works here unchanged:

    temperature 0          greedy (argmax); otherwise sampling, seeded by ``seed`` if given
    max_tokens             new tokens at most (completions: 16 by default; chat: what fits)
    stop                   strings that end the answer; the text stops before them
    finish_reason          "stop" (eos or a stop string) or "length" (max_tokens reached)
    n                      samples of the one prompt, prefilled once (choice i: seed + i)
    logprobs               completions: k, each token's log-probability and the top k;
                           chat: true, with top_logprobs: k
    echo                   completions: the prompt comes back in front of the text (and its
                           tokens' log-probabilities, with logprobs)

Log-probabilities are the model's own (before temperature and the other sampling settings,
as vLLM returns by default); k is at most ``MAX_LOGPROBS``.

Anything wrong is an ``APIError`` carrying OpenAI's error body, naming the field: 400 for a
bad value, 404 (``model_not_found``) for a model this server does not serve. Types are strict:
JSON's ``true`` is not the integer 1 and 1 is not ``true``. Fields of the API this server does
not implement are refused unless they hold their neutral value (the value that means the same as
leaving the field out), never silently dropped; they are listed in one table, ``NOT_IMPLEMENTED``.
Text must be Unicode: JSON can spell a lone UTF-16 surrogate (``"\\ud800"``), which is no
character, and a body holding one is refused. Leaves out: tools, ``best_of``, echo in chat.
"""
import json
import math
from dataclasses import dataclass

from minitransformer.checks import is_integer, is_real
from minitransformer.chat import encode_chat
from minitransformer.generate import eos_ids
from minitransformer.logprobs import MAX_LOGPROBS, TokenLogprob
from minitransformer.sampling import SamplingSettings
from minitransformer.serve.records import Request

MAX_STOP = 4                    # OpenAI's limit on stop strings
LOWEST_LOGPROB = -9999.0        # what a log-probability of -inf is sent as (JSON has no inf)
COMPOSE = 3                     # a normalizer may shrink text: NFC makes 3 jamo (9 bytes) 1 of 3

# --- fields not implemented -------------------------------------------------------------------
# field -> its neutral values (null always passes: it means "absent"), for both endpoints unless
# a kind is named. A field leaves this table when it is implemented (and is parsed in `parse`).
NOT_IMPLEMENTED = {
    # several choices beyond n, log probabilities beyond logprobs and echo
    "best_of": (1,), "prompt_logprobs": (),
    # penalties and biases, structured output, tools
    "presence_penalty": (0.0,), "frequency_penalty": (0.0,), "logit_bias": ({},),
    "min_p": (0.0,), "min_tokens": (0,), "use_beam_search": (False,), "length_penalty": (1.0,),
    "stop_token_ids": ([],), "include_stop_str_in_output": (False,), "suffix": ("",),
    "response_format": ({"type": "text"},), "tools": ([],), "tool_choice": ("none",),
    "functions": ([],), "function_call": ("none",),
}


def same(value, neutral) -> bool:
    """Equal and of the same kind: false is not 0, 1 is not true, 1.0 is not an integer; a
    number field's neutral (a float) is met by 0 and 0.0 alike.

    >>> same(0, False), same(True, 1), same(1.0, 1), same(0, 0.0), same({}, {})
    (False, False, False, True, True)
    """
    if isinstance(value, bool) or isinstance(neutral, bool):
        return value is neutral
    if isinstance(neutral, float):
        return is_real(value) and value == neutral
    if isinstance(neutral, int):
        return is_integer(value) and value == neutral
    return type(value) is type(neutral) and value == neutral


def refuse_not_implemented(body: dict, kind: str) -> None:
    for field, neutral in NOT_IMPLEMENTED.items():
        neutral = neutral.get(kind, ()) if isinstance(neutral, dict) else neutral
        value = body.get(field)
        if value is not None and not any(same(value, n) for n in neutral):
            allowed = " or ".join(["null", *map(json_text, neutral)])
            raise APIError(f"{field}={json_text(value)} is not supported by this server "
                           f"(only {allowed})", field)
# ----------------------------------------------------------------------------------------------


def json_text(value, limit=80) -> str:
    """A value as JSON spells it (true, null), cut short for an error message."""
    text = json.dumps(value)
    return text if len(text) <= limit else text[:limit] + "..."




class APIError(Exception):
    def __init__(self, message, param=None, status=400, code=None, headers=None):
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code
        self.headers = headers or {}

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param,
                          "code": self.code}}


@dataclass(frozen=True)
class Job:
    kind: str                   # "completion" or "chat"
    request: Request            # what the engine runs
    eos: frozenset              # ids that end the answer with finish_reason "stop"
    stop: tuple                 # stop strings
    stream: bool
    include_usage: bool         # stream_options.include_usage: a last chunk with usage
    logprobs: bool = False      # send each token's log-probability (request.logprobs: top k)
    echo: str = None            # completions with echo: the prompt's text, sent first


def number(body, name, default, low, high, integer=False, low_open=False):
    """body[name] checked to be a number in [low, high] ((low, high] if low_open)."""
    value = body.get(name, default)
    if value is None:
        return default
    ok = is_integer(value) if integer else is_real(value)
    # a JSON integer may have thousands of digits: compare it as an int, never via a float
    if ok and isinstance(value, float):
        ok = math.isfinite(value)
    if not ok or value < low or value > high or (low_open and value == low):
        bounds = f"{'(' if low_open else '['}{low}, {high}]"
        raise APIError(f"{name} must be {'an integer' if integer else 'a number'} in "
                       f"{bounds}, got {json_text(value)}", name)
    return value


def longest_token_bytes(tokenizer) -> int:
    """The most bytes of text one token of the vocabulary stands for (special tokens too)."""
    backend = tokenizer.backend
    return max(len(backend.decode([i], skip_special_tokens=False).encode())
               for i in range(backend.get_vocab_size()))


def parse(body, kind: str, model, name: str, pool_tokens: int, max_n: int = 1,
          longest_token=None) -> Job:
    """A request body of /v1/completions (kind "completion") or /v1/chat/completions;
    ``max_n``: the most samples a request may ask for (the engine's slots). Tokenizes and
    lays out the prompt: a server runs this off its event loop. longest_token
    (``longest_token_bytes``, computed once by the caller): text too long to fit the model's
    positions, whatever its tokens, is refused before it is tokenized."""
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object")
    check_unicode(body)         # first the fields that cost nothing to check, then the prompt
    served_model(body, name)
    refuse_not_implemented(body, kind)
    text(body, "user")
    sampling = SamplingSettings(
        do_sample=True, temperature=number(body, "temperature", 1.0, 0, 2),
        top_p=number(body, "top_p", 1.0, 0, 1, low_open=True),
        top_k=max(0, number(body, "top_k", 0, -1, math.inf, True)),       # vLLM: -1 is off
        repetition_penalty=number(body, "repetition_penalty", 1.0, 0, math.inf, low_open=True))
    seed = number(body, "seed", None, 0, 2**63 - 1, True)
    ignore_eos = flag(body, "ignore_eos")                                 # vLLM's extra
    n = number(body, "n", 1, 1, max_n, True)
    top, echo = logprob_fields(body, kind)
    stream = flag(body, "stream")
    options = body.get("stream_options")
    if options is not None and (not stream or not isinstance(options, dict)):
        raise APIError("stream_options needs stream=true and must be an object",
                       "stream_options")
    include_usage = flag(options or {}, "include_usage", "stream_options.include_usage")
    stop = stop_strings(body)
    field = "max_completion_tokens" if body.get("max_completion_tokens") is not None \
        else "max_tokens"
    max_tokens = number(body, field, None, 1, math.inf, True)

    prompt = prompt_ids(body, kind, model, longest_token)
    positions = model.config.max_position_embeddings
    param = "prompt" if kind == "completion" else "messages"
    room = min(positions, pool_tokens) - len(prompt)  # tokens left for the answer
    if room <= 0:
        raise APIError(f"the prompt has {len(prompt)} tokens; the model takes {positions} "
                       f"positions and the KV pool {pool_tokens} tokens in all", param)
    if max_tokens is None:      # completions: 16, as OpenAI; chat: what fits
        max_tokens = 16 if kind == "completion" else room
    if max_tokens > room:
        raise APIError(f"{len(prompt)} prompt tokens + {field}={max_tokens} exceed what fits: "
                       f"{positions} model positions, a KV pool of {pool_tokens} tokens",
                       field)
    request = Request(tuple(prompt), max_tokens, sampling=sampling, seed=seed,
                      eos_token_id=[] if ignore_eos else None, n=n, logprobs=top,
                      prompt_logprobs=top if echo else None)
    return Job(kind, request, frozenset(eos_ids(model, request.eos_token_id)), stop, stream,
               include_usage, top is not None,
               echo_text(body, model, prompt) if echo else None)


def served_model(body, name: str) -> None:
    """The model asked for must be the one served: else 404, as OpenAI and vLLM answer."""
    asked = body.get("model")
    if not isinstance(asked, str):
        raise APIError(f"model must be a string naming the served model ({name!r}), got "
                       f"{json_text(asked)}", "model")
    if asked != name:
        raise APIError(f"the model {asked!r:.200} does not exist; this server has {name!r}",
                       "model", status=404, code="model_not_found")


def check_unicode(body: dict) -> None:
    """Every string of the body (keys too) is Unicode text: no lone UTF-16 surrogate, which JSON
    can spell ("\\ud800") but no encoder or tokenizer takes. The error names the top field."""
    for field, value in body.items():
        stack = [field, value]
        while stack:
            item = stack.pop()
            if isinstance(item, str):
                try:
                    item.encode("utf-8")
                except UnicodeEncodeError as e:
                    raise APIError(f"{field!r:.100} holds a lone UTF-16 surrogate "
                                   f"({item[e.start]!r}), which is not a character",
                                   field.encode("utf-8", "replace").decode()) from None
            elif isinstance(item, dict):
                stack.extend(item)
                stack.extend(item.values())
            elif isinstance(item, list):
                stack.extend(item)


def logprob_fields(body, kind) -> tuple:
    """-> (top k of each new token, or None for no logprobs; echo). OpenAI's two spellings:
    completions ``logprobs: k`` (an integer), chat ``logprobs: true`` + ``top_logprobs: k``."""
    def top_count(field):
        return number(body, field, None, 0, MAX_LOGPROBS, True)
    if kind == "completion":
        if body.get("top_logprobs") is not None:
            raise APIError("top_logprobs is a field of /v1/chat/completions; completions take "
                           "logprobs: k", "top_logprobs")
        return top_count("logprobs"), flag(body, "echo")
    if flag(body, "echo"):
        raise APIError("echo is a field of /v1/completions only", "echo")
    top = top_count("top_logprobs")
    if not flag(body, "logprobs"):
        if top is not None:
            raise APIError("top_logprobs needs logprobs: true", "top_logprobs")
        return None, False
    return top or 0, False


def echo_text(body, model, prompt) -> str:
    """The prompt as the client sent it (text), or its ids decoded."""
    text = body.get("prompt")
    text = text[0] if isinstance(text, list) and len(text) == 1 else text
    return text if isinstance(text, str) else model.tokenizer.decode(prompt)


def flag(body, name, param=None) -> bool:
    value = body.get(name, False)
    if value is not None and not isinstance(value, bool):
        raise APIError(f"{param or name} must be true or false, got {json_text(value)}",
                       param or name)
    return bool(value)


def text(body, name) -> str | None:
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise APIError(f"{name} must be a string, got {json_text(value)}", name)
    return value


def prompt_ids(body, kind, model, longest_token=None) -> list:
    """The prompt as token ids: text, a list of ids, or chat messages through the template."""
    if kind == "chat":
        messages = body.get("messages")
        texts = [m.get("content") for m in messages if isinstance(m, dict)] \
            if isinstance(messages, list) else []
        check_text_fits(model, [t for t in texts if isinstance(t, str)], longest_token,
                        "messages")
        try:
            return encode_chat(model, messages)
        except ValueError as e:
            raise APIError(str(e), "messages") from None
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]      # a batch of one prompt
    if isinstance(prompt, str) and prompt:
        if model.tokenizer is None:
            raise APIError("the model has no tokenizer: send the prompt as token ids", "prompt")
        check_text_fits(model, [prompt], longest_token, "prompt")
        return model.tokenizer.encode(prompt)
    V = model.config.vocab_size
    if isinstance(prompt, list) and prompt and all(
            is_integer(i) and 0 <= i < V for i in prompt):
        return prompt
    raise APIError(f"prompt must be a non-empty string or a list of token ids in [0, {V}) "
                   f"(one prompt per request)", "prompt")


def check_text_fits(model, texts, longest_token, param) -> None:
    """No token stands for more than longest_token bytes, so text of more bytes than the
    model's positions x longest_token (x COMPOSE, for a normalizer's shrinking) makes more
    tokens than fit: refused at once, not after seconds of tokenizing."""
    positions = model.config.max_position_embeddings
    size = sum(len(text.encode("utf-8")) for text in texts)
    if longest_token is not None and size > positions * longest_token * COMPOSE:
        raise APIError(f"the prompt's {size:,} bytes of text make more than {positions} tokens "
                       f"(no token of this vocabulary stands for more than {longest_token} "
                       f"bytes); the model takes {positions} positions", param)


def stop_strings(body) -> tuple:
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else [] if stop is None else stop
    if not isinstance(stop, list) or len(stop) > MAX_STOP or \
            not all(isinstance(s, str) and s for s in stop):
        raise APIError(f"stop must be a string or a list of at most {MAX_STOP} non-empty "
                       f"strings, got {json_text(stop)}", "stop")
    return tuple(stop)


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def choice(kind, text, finish_reason, delta=False, first=False, index=0,
           logprobs=None) -> dict:
    """One choice of a response (delta: of a streamed chunk); logprobs as built by
    completion_logprobs or chat_logprobs."""
    if kind == "completion":
        return {"index": index, "text": text, "logprobs": logprobs,
                "finish_reason": finish_reason}
    if delta:
        message = ({"role": "assistant"} if first else {}) | ({"content": text} if text or first
                                                              else {})
        return {"index": index, "delta": message, "logprobs": logprobs,
                "finish_reason": finish_reason}
    return {"index": index, "message": {"role": "assistant", "content": text},
            "logprobs": logprobs, "finish_reason": finish_reason}


def token_text(tokenizer, token: int) -> str:
    """A token as logprobs name it: its own text (vLLM's "token_id:N" without a tokenizer)."""
    return f"token_id:{token}" if tokenizer is None else tokenizer.token_text(token)


def finite(logprob):
    return None if logprob is None else max(logprob, LOWEST_LOGPROB)


def completion_logprobs(tokenizer, scored, offset: int = 0) -> tuple:
    """TokenLogprobs -> (the completions ``logprobs`` object, the text offset after them).
    ``top_logprobs`` maps text -> logprob for the top k and the token itself (vLLM's rule);
    a prompt's first token has null for both (nothing predicts it)."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for s in scored:
        text = token_text(tokenizer, s.token)
        out["tokens"].append(text)
        out["token_logprobs"].append(finite(s.logprob))
        out["top_logprobs"].append(None if s.top is None else {
            token_text(tokenizer, t): finite(p) for t, p in s.top + ((s.token, s.logprob),)})
        out["text_offset"].append(offset)
        offset += len(text)
    return out, offset


def chat_logprobs(tokenizer, scored) -> dict:
    """TokenLogprobs -> the chat ``logprobs`` object: per token its text, logprob, UTF-8 bytes
    and the top k alternatives."""
    def entry(token, logprob):
        text = token_text(tokenizer, token)
        return {"token": text, "logprob": finite(logprob), "bytes": list(text.encode())}
    return {"content": [entry(s.token, s.logprob) | {
        "top_logprobs": [entry(t, p) for t, p in s.top]} for s in scored]}


def unpredicted(token: int) -> TokenLogprob:
    """A prompt's first token as echo reports it: no logprob, no alternatives."""
    return TokenLogprob(token, None, None)


def response(job, rid, created, name, choices, usage_counts=None, chunk=False) -> dict:
    """A whole response, or one streamed chunk (usage None in chunks unless asked)."""
    kind = {"completion": "text_completion", "chat": "chat.completion"}[job.kind]
    if chunk and job.kind == "chat":
        kind = "chat.completion.chunk"
    return {"id": rid, "object": kind, "created": created, "model": name, "choices": choices,
            "usage": usage_counts}
