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
as vLLM returns by default); k is at most ``MAX_LOGPROBS``. Anything wrong is an
``APIError``: HTTP 400 with OpenAI's error body, naming the field. Fields this server does not
implement (penalties, ``best_of``, tools...) are refused by name rather than silently ignored.
Leaves out: tools, ``best_of``, echo in chat.
"""
import math
from dataclasses import dataclass

from minitransformer.checks import is_integer, is_real
from minitransformer.chat import encode_chat
from minitransformer.generate import eos_ids
from minitransformer.logprobs import MAX_LOGPROBS, TokenLogprob
from minitransformer.sampling import SamplingSettings
from minitransformer.serve.records import Request

UNSUPPORTED = {  # field -> the value that means "off" (null, false, {} and [] pass too)
    "best_of": 1, "suffix": None,
    "presence_penalty": 0, "frequency_penalty": 0, "logit_bias": None, "tools": None,
    "response_format": None,
}
MAX_STOP = 4                    # OpenAI's limit on stop strings
LOWEST_LOGPROB = -9999.0        # what a log-probability of -inf is sent as (JSON has no inf)


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
    if not (is_integer(value) if integer else is_real(value)) or not math.isfinite(value) \
            or value < low or value > high or (low_open and value == low):
        bounds = f"{'(' if low_open else '['}{low}, {high}]"
        raise APIError(f"{name} must be {'an integer' if integer else 'a number'} in "
                       f"{bounds}, got {value!r}", name)
    return value


def parse(body, kind: str, model, name: str, pool_tokens: int, max_n: int = 1) -> Job:
    """A request body of /v1/completions (kind "completion") or /v1/chat/completions;
    ``max_n``: the most samples a request may ask for (the engine's slots)."""
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object")
    if body.get("model") != name:
        raise APIError(f"the model {body.get('model')!r} does not exist; this server has "
                       f"{name!r}", "model", code="model_not_found")
    for field, off in UNSUPPORTED.items():
        value = body.get(field)
        if value is not None and value != off and value not in (False, {}, []):
            raise APIError(f"{field}={value!r} is not supported by this server", field)
    prompt = prompt_ids(body, kind, model)
    positions = model.config.max_position_embeddings
    param = "prompt" if kind == "completion" else "messages"
    room = min(positions, pool_tokens) - len(prompt)  # tokens left for the answer
    if room <= 0:
        raise APIError(f"the prompt has {len(prompt)} tokens; the model takes {positions} "
                       f"positions and the KV pool {pool_tokens} tokens in all", param)
    field = "max_completion_tokens" if body.get("max_completion_tokens") is not None \
        else "max_tokens"
    max_tokens = number(body, field, 16 if kind == "completion" else room, 1, math.inf, True)
    if max_tokens > room:
        raise APIError(f"{len(prompt)} prompt tokens + {field}={max_tokens} exceed what fits: "
                       f"{positions} model positions, a KV pool of {pool_tokens} tokens",
                       field)
    sampling = SamplingSettings(
        do_sample=True, temperature=number(body, "temperature", 1.0, 0, 2),
        top_p=number(body, "top_p", 1.0, 0, 1, low_open=True),
        top_k=max(0, number(body, "top_k", 0, -1, math.inf, True)),       # vLLM: -1 is off
        repetition_penalty=number(body, "repetition_penalty", 1.0, 0, math.inf, low_open=True))
    seed = number(body, "seed", None, 0, 2**63 - 1, True)
    ignore_eos = body.get("ignore_eos", False) is True                   # vLLM's extra
    n = number(body, "n", 1, 1, max_n, True)
    top, echo = logprob_fields(body, kind)
    request = Request(tuple(prompt), max_tokens, sampling=sampling, seed=seed,
                      eos_token_id=[] if ignore_eos else None, n=n, logprobs=top,
                      prompt_logprobs=top if echo else None)
    stream = flag(body, "stream")
    options = body.get("stream_options")
    if options is not None and (not stream or not isinstance(options, dict)):
        raise APIError("stream_options needs stream=true and must be an object",
                       "stream_options")
    return Job(kind, request, frozenset(eos_ids(model, request.eos_token_id)),
               stop_strings(body), stream, bool(options and options.get("include_usage")),
               top is not None, echo_text(body, model, prompt) if echo else None)


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
    if body.get("echo") not in (None, False):
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


def flag(body, name) -> bool:
    value = body.get(name, False)
    if value is not None and not isinstance(value, bool):
        raise APIError(f"{name} must be true or false, got {value!r}", name)
    return bool(value)


def prompt_ids(body, kind, model) -> list:
    """The prompt as token ids: text, a list of ids, or chat messages through the template."""
    if kind == "chat":
        try:
            return encode_chat(model, body.get("messages"))
        except ValueError as e:
            raise APIError(str(e), "messages") from None
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]      # a batch of one prompt
    if isinstance(prompt, str) and prompt:
        if model.tokenizer is None:
            raise APIError("the model has no tokenizer: send the prompt as token ids", "prompt")
        return model.tokenizer.encode(prompt)
    V = model.config.vocab_size
    if isinstance(prompt, list) and prompt and all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < V for i in prompt):
        return prompt
    raise APIError(f"prompt must be a non-empty string or a list of token ids in [0, {V}) "
                   f"(one prompt per request)", "prompt")


def stop_strings(body) -> tuple:
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else stop or []
    if not isinstance(stop, list) or len(stop) > MAX_STOP or \
            not all(isinstance(s, str) for s in stop):
        raise APIError(f"stop must be a string or a list of at most {MAX_STOP} strings", "stop")
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
