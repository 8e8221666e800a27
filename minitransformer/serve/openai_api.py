"""The OpenAI API's request and response bodies, checked and built without any web framework.

A request body becomes a ``Job``: the engine ``Request`` (prompt ids, max_new_tokens, sampling
settings, seed) plus what the HTTP side needs (stop strings, streaming, usage). The field names
and meanings are OpenAI's, with vLLM's extras (``top_k``, ``repetition_penalty``,
``ignore_eos``), so a client written for either works here unchanged:

    temperature 0          greedy (argmax); otherwise sampling, seeded by ``seed`` if given
    max_tokens             new tokens at most (completions: 16 by default; chat: what fits)
    stop                   strings that end the answer; the text stops before them (at most
                           MAX_STOP of them, OpenAI's limit, each of at most MAX_STOP_CHARS)
    finish_reason          "stop" (eos or a stop string) or "length" (max_tokens reached)
    prompt                 completions: a string, a list of token ids, or a batch (a list of
                           strings or of token-id lists, at most MAX_PROMPTS): choice p x n + j
                           is sample j of prompt p, as OpenAI orders them
    n                      samples of each prompt, prefilled once (choice i: seed + i)
    logprobs               completions: k, each token's log-probability and the top k;
                           chat: true, with top_logprobs: k
    echo                   completions: the prompt comes back in front of the text (and its
                           tokens' log-probabilities, with logprobs); with max_tokens 0, the
                           prompt alone (vLLM's way to score a text)

A token in logprobs is named by the text it adds to the output (``name_logprobs``), leading
space included, so the tokens of a choice join to its text and ``text_offset`` points at each;
the first bytes of a character split over tokens add no text yet ("") and the token completing
it carries the character (vLLM's names). Chat's ``bytes`` are those of the same text. vLLM's
``/tokenize`` and ``/detokenize`` bodies are checked here too (``tokenize_body``).

Log-probabilities are the model's own (before temperature and the other sampling settings,
as vLLM returns by default); k is at most ``MAX_LOGPROBS``.

Anything wrong is an ``APIError`` carrying OpenAI's error body, naming the field: 400 for a
bad value, 404 (``model_not_found``) for a model this server does not serve. Types are strict:
JSON's ``true`` is not the integer 1 and 1 is not ``true``. Fields of the API this server does
not implement are refused unless they hold their neutral value (the value that means the same as
leaving the field out), never silently dropped; they are listed in one table, ``NOT_IMPLEMENTED``,
and a field of neither API (nor any this server reads) is refused as unrecognized, as OpenAI
answers one. ``best_of`` is accepted only equal to ``n`` (it means the same then).
Text must be Unicode: JSON can spell a lone UTF-16 surrogate (``"\\ud800"``), which is no
character, and a body holding one is refused. Leaves out: tools, ``best_of`` beyond ``n``, echo in
chat.
"""
import itertools
import json
import math
from dataclasses import dataclass, replace

from minitransformer.chat import MessageError, check_messages, encode_chat, special_tokens
from minitransformer.checks import FieldsRead, is_integer, is_real
from minitransformer.generate import eos_ids
from minitransformer.logprobs import MAX_LOGPROBS, TokenLogprob
from minitransformer.sampling import SamplingSettings
from minitransformer.serve.records import Request
from minitransformer.tokenizer import encode_text

MAX_STOP = 4                    # OpenAI's limit on stop strings
MAX_PROMPTS = 64                # prompts of one completions request at most (the default
                                # waiting queue's size: a batch is queued whole or not at all)
MAX_STOP_CHARS = 1024           # this server's limit on the length of each (see stop_strings)
LOWEST_LOGPROB = -9999.0        # what a log-probability of -inf is sent as (JSON has no inf)
COMPOSE = 3                     # a normalizer may shrink text: NFC makes 3 jamo (9 bytes) 1 of 3

# --- fields not implemented -------------------------------------------------------------------
# field -> its neutral values (null always passes: it means "absent"), for both endpoints unless
# a kind is named. A field leaves this table when it is implemented (and is parsed in `parse`).
NOT_IMPLEMENTED = {
    # log probabilities beyond logprobs and echo
    "prompt_logprobs": (),
    # penalties and biases, structured output, tools
    "presence_penalty": (0.0,), "frequency_penalty": (0.0,), "logit_bias": ({},),
    "min_tokens": (0,), "use_beam_search": (False,), "length_penalty": (1.0,),
    "stop_token_ids": ([],), "include_stop_str_in_output": (False,), "suffix": ("",),
    "response_format": ({"type": "text"},), "tools": ([],), "tool_choice": ("none",),
    "functions": ([],), "function_call": ("none",),
    # vLLM's extras: guided (structured) decoding, token filters, prompt truncation
    "guided_json": (), "guided_regex": (), "guided_choice": (), "guided_grammar": (),
    "guided_decoding_backend": (), "guided_whitespace_pattern": (), "structured_outputs": (),
    "allowed_token_ids": (), "bad_words": ([],), "truncate_prompt_tokens": (),
    "logits_processors": (), "min_p": (0.0,),
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


def refuse_unread(body: FieldsRead, within: str = "") -> None:
    """A field never read is an error naming it (`within`: the object it sits in, for a
    nested one such as stream_options)."""
    unread = [within + field for field in body.unread()]
    if unread:
        raise APIError(f"unrecognized request argument supplied: {unread[0]!r:.100} (not a field "
                       f"of the OpenAI API this server implements)", unread[0])


class Spelled(str):
    """Text already spelled as JSON: a closing bracket, a key and its colon, a comma."""


def json_text(value, limit=80) -> str:
    """A value as JSON spells it (true, null), cut short for an error message: only its first
    ``limit`` characters or so are ever written, without recursion, so a value of any size or
    depth the decoder took is named by its start (json.dumps would recurse as deep as the
    value, and fail one level short of the decoder's own limit).

    >>> json_text({"a": [1, True, None]}), json_text([[[[[[[[[[[[]]]]]]]]]]]], limit=6)
    ('{"a": [1, true, null]}', '[[[[[[...')
    """
    written, size, todo = [], 0, [value]    # todo: what is still to write, the next last
    while todo and size <= limit:
        item = todo.pop()
        if isinstance(item, Spelled):
            text: str = item
        elif isinstance(item, (list, dict)):
            pairs = item.items() if isinstance(item, dict) else ((None, v) for v in item)
            text = "{" if isinstance(item, dict) else "["
            todo.append(Spelled("}" if isinstance(item, dict) else "]"))
            for i, (key, v) in reversed(list(enumerate(itertools.islice(pairs, limit)))):
                todo.append(v)          # at most limit entries: more would not be shown
                if key is not None:
                    todo.append(Spelled(json.dumps(key[:limit]) + ": "))
                if i:
                    todo.append(Spelled(", "))
        else:
            text = json.dumps(item[:limit + 1] if isinstance(item, str) else item)
        written.append(text)
        size += len(text)
    text = "".join(written)
    return text if size <= limit and not todo else text[:limit] + "..."


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
    echo: bool = False          # completions with echo: the prompt's text (as its tokens
                                # decode), sent first


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
          longest_token=None) -> tuple:
    """A request body of /v1/completions (kind "completion") or /v1/chat/completions -> a
    Job per prompt. A chat has one prompt; completions may send a batch, whose choices are
    numbered prompt x n + sample, as OpenAI orders them. ``pool_tokens`` is what the KV pool
    holds, ``max_n`` the most samples a request may ask for (the engine's slots).

    This tokenizes and lays out the prompt, so a server runs it off its event loop. With
    ``longest_token`` (``longest_token_bytes``, computed once by the caller), text too long
    to fit the model's positions whatever its tokens is refused before it is tokenized."""
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object")
    check_unicode(body)         # first the fields that cost nothing to check, then the prompt
    body = FieldsRead(body)
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
    best_of = number(body, "best_of", n, 1, math.inf, True)
    if best_of != n:
        raise APIError(f"best_of={best_of} is not supported with n={n}: this server returns "
                       f"every sample it makes, so best_of must equal n (or be left out)",
                       "best_of")
    top, echo = logprob_fields(body, kind)
    stream = flag(body, "stream")
    options = body.get("stream_options")
    if options is not None and (not stream or not isinstance(options, dict)):
        raise APIError("stream_options needs stream=true and must be an object",
                       "stream_options")
    options = FieldsRead(options or {})
    include_usage = flag(options, "include_usage", "stream_options.include_usage")
    refuse_unread(options, "stream_options.")      # vLLM's continuous_usage_stats among them
    stop = stop_strings(body)
    field = "max_completion_tokens" if body.get("max_completion_tokens") is not None \
        else "max_tokens"
    max_tokens = number(body, field, None, 0 if echo else 1, math.inf, True)  # 0: echo alone

    jobs, batch = [], prompts(body, kind, model, longest_token)
    for p, prompt in enumerate(batch):
        positions = model.config.max_position_embeddings
        which = "the prompt" if len(batch) == 1 else f"prompt[{p}]"
        param = "prompt" if kind == "completion" else "messages"
        room = min(positions, pool_tokens) - len(prompt)  # tokens left for the answer
        if room < 0 or room == 0 and max_tokens != 0:     # echo alone may fill them all
            raise APIError(f"{which} has {len(prompt)} tokens; the model takes {positions} "
                           f"positions and the KV pool {pool_tokens} tokens in all", param)
        new = (16 if kind == "completion" else room) if max_tokens is None else max_tokens
        if new > room:          # completions: 16 by default, as OpenAI; chat: what fits
            raise APIError(f"{which} has {len(prompt)} tokens: + {field}={new} exceed "
                           f"what fits: {positions} model positions, a KV pool of "
                           f"{pool_tokens} tokens", field)
        request = Request(tuple(prompt), new, sampling=sampling, seed=seed,
                          eos_token_id=[] if ignore_eos else None, n=n, logprobs=top,
                          prompt_logprobs=top if echo else None)
        jobs.append(Job(kind, request, frozenset(eos_ids(model, request.eos_token_id)), stop,
                        stream, include_usage, top is not None, echo))
    refuse_unread(body)
    return tuple(jobs)


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


def prompts(body, kind, model, longest_token=None) -> list:
    """The prompts as lists of token ids. Chat: one, its messages through the template.
    Completions, as OpenAI and vLLM take them: a string, a list of token ids, or a batch of
    up to MAX_PROMPTS of either kind (a list of strings, or of token-id lists)."""
    if kind == "chat":
        return [chat_prompt(model, body.get("messages"), longest_token)]
    prompt, V = body.get("prompt"), model.config.vocab_size
    kinds = (f"a non-empty string, a non-empty list of token ids in [0, {V}), or a list of "
             f"at most {MAX_PROMPTS} of either")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and
                                   not isinstance(prompt[0], (str, list))):
        prompt = [prompt]       # one prompt: a batch of one
    if not isinstance(prompt, list) or not prompt or len(prompt) > MAX_PROMPTS:
        size = f" of {len(prompt)} prompts" if isinstance(prompt, list) and prompt else ""
        raise APIError(f"prompt must be {kinds}; got {json_text(prompt, 40)}{size}", "prompt")
    batch = len(prompt) > 1 or not isinstance(body["prompt"], str)
    if len({type(p) for p in prompt}) > 1:
        raise APIError(f"prompt mixes strings and token-id lists: it must be {kinds}",
                       "prompt")
    return [one_prompt(model, p, f"prompt[{i}]" if batch else "prompt", V, longest_token)
            for i, p in enumerate(prompt)]


def chat_prompt(model, messages, longest_token=None, add_generation_prompt=True) -> list:
    """Chat messages -> the prompt's ids through the model's template: the messages' texts
    checked to fit first, then laid out; a message's mistake is a 400 naming where it is
    (``messages[0].content[1].type``), or ``messages``."""
    try:
        texts = [m["content"] for m in check_messages(messages)]
        check_text_fits(model, texts, longest_token, "messages")
        return encode_chat(model, messages, add_generation_prompt)
    except MessageError as e:
        raise APIError(str(e), e.where) from None
    except ValueError as e:
        raise APIError(str(e), "messages") from None


def one_prompt(model, prompt, where: str, V: int, longest_token) -> list:
    """One prompt of a completions request (text, or token ids in [0, V)) -> its ids."""
    if isinstance(prompt, str) and prompt:
        if model.tokenizer is None:
            raise APIError("the model has no tokenizer: send the prompt as token ids", "prompt")
        check_text_fits(model, [prompt], longest_token, "prompt")
        return model.tokenizer.encode(prompt)
    if isinstance(prompt, list) and prompt and all(
            is_integer(i) and 0 <= i < V for i in prompt):
        return prompt
    bad = next(i for i in prompt if not (is_integer(i) and 0 <= i < V)) \
        if isinstance(prompt, list) and prompt else prompt
    raise APIError(f"{where} must be a non-empty string or a non-empty list of token ids in "
                   f"[0, {V}); got {json_text(bad, 40)}", "prompt")


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
    """The stop strings: at most MAX_STOP (OpenAI's limit), each non-empty and at most
    MAX_STOP_CHARS characters. Matching them costs time linear in the generated text whatever
    their length (detokenize.StopStrings); the length limit bounds what each request builds
    and holds back (a table per string, the text that may begin one)."""
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else [] if stop is None else stop
    if not isinstance(stop, list) or len(stop) > MAX_STOP or \
            not all(isinstance(s, str) and s for s in stop):
        raise APIError(f"stop must be a string or a list of at most {MAX_STOP} non-empty "
                       f"strings, got {json_text(stop)}", "stop")
    longest = max(map(len, stop), default=0)
    if longest > MAX_STOP_CHARS:
        raise APIError(f"a stop string has {longest:,} characters; this server takes at most "
                       f"{MAX_STOP_CHARS:,}", "stop")
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


@dataclass(frozen=True)
class NamedLogprob:
    """A token's log-probability with the text that names it (and its alternatives)."""
    text: str                   # what the token adds to the output
    logprob: float | None       # None: a prompt's first token (nothing predicts it)
    top: tuple | None = ()      # ((text, logprob), ...) of the top k; None with logprob None


def name_logprobs(detokenizer, scored: TokenLogprob) -> NamedLogprob:
    """Name a token, and each alternative to it, by the text it would add at the
    detokenizer's position (before the token is added): so the texts of a choice's tokens
    join to its text and ``text_offset`` points at each. Without a tokenizer (detokenizer
    None), vLLM's names: "token_id:N"."""
    others = () if scored.top is None else tuple(t for t, _ in scored.top)
    texts = [f"token_id:{t}" for t in (scored.token, *others)] if detokenizer is None else \
        detokenizer.peek([scored.token, *others])
    top = None if scored.top is None else \
        tuple(zip(texts[1:], (p for _, p in scored.top), strict=True))
    return NamedLogprob(texts[0], scored.logprob, top)


def cut_to(named: list, offset: int, size: int) -> list:
    """The named tokens starting at text offset ``offset``, their texts cut at ``size``
    characters of text in all: a stop string ends the text inside (or before) the tokens that
    made it, and a token names only the text it adds to the output."""
    out = []
    for s in named:
        out.append(replace(s, text=s.text[:max(0, size - offset)]))
        offset += len(s.text)
    return out


def finite(logprob):
    return None if logprob is None else max(logprob, LOWEST_LOGPROB)


def completion_logprobs(named, offset: int = 0) -> tuple:
    """NamedLogprobs -> (the completions ``logprobs`` object, the text offset after them).
    ``top_logprobs`` maps text -> logprob for the top k and the token itself (vLLM's rule);
    a prompt's first token has null for both (nothing predicts it)."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                            "text_offset": []}
    for s in named:
        out["tokens"].append(s.text)
        out["token_logprobs"].append(finite(s.logprob))
        out["top_logprobs"].append(None if s.top is None else {
            text: finite(p) for text, p in s.top + ((s.text, s.logprob),)})
        out["text_offset"].append(offset)
        offset += len(s.text)
    return out, offset


def chat_logprobs(named) -> dict:
    """NamedLogprobs -> the chat ``logprobs`` object: per token its text, logprob, UTF-8 bytes
    (its text's, so that joined they are the content's) and the top k alternatives."""
    def entry(text, logprob):
        return {"token": text, "logprob": finite(logprob), "bytes": list(text.encode())}
    return {"content": [entry(s.text, s.logprob) | {
        "top_logprobs": [entry(t, p) for t, p in s.top]} for s in named]}


def response(job, rid, created, name, choices, usage_counts=None, chunk=False) -> dict:
    """A whole response, or one streamed chunk (usage None in chunks unless asked)."""
    kind = {"completion": "text_completion", "chat": "chat.completion"}[job.kind]
    if chunk and job.kind == "chat":
        kind = "chat.completion.chunk"
    return {"id": rid, "object": kind, "created": created, "model": name, "choices": choices,
            "usage": usage_counts}


# --- vLLM's /tokenize and /detokenize ---------------------------------------------------------
TOKENIZE_FIELDS = {         # field -> (kind of request it belongs to, its default)
    "model": ("both", None), "return_token_strs": ("both", False),
    "prompt": ("completion", None), "messages": ("chat", None),
    "add_special_tokens": ("both", None),      # default: true for a prompt, false for a chat
    "add_generation_prompt": ("chat", True),
}
TOKENIZE_NEUTRAL: dict[str, object] = {
    "continue_final_message": False, "chat_template": None, "chat_template_kwargs": {},
    "tools": [], "mm_processor_kwargs": {}, "media_io_kwargs": {}}


def tokenizer_request(body, model, name, fields) -> None:
    """The checks /tokenize and /detokenize share: a JSON object of known fields (any other is
    refused, naming it), the served model if named, a tokenizer to use."""
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object")
    check_unicode(body)
    for field, value in body.items():
        if field in fields:
            continue
        if field in TOKENIZE_NEUTRAL and (value is None or same(value, TOKENIZE_NEUTRAL[field])):
            continue
        raise APIError(f"{field!r:.100} is not a field this server takes here (it takes "
                       f"{', '.join(fields)})", field.encode("utf-8", "replace").decode())
    if body.get("model") is not None:
        served_model(body, name)
    if model.tokenizer is None:
        raise APIError("the model has no tokenizer: it serves token ids only")


def tokenize_body(body, model, name: str, longest_token=None) -> dict:
    """vLLM's /tokenize: {"prompt": text} or {"messages": [...]} -> {"count", "max_model_len",
    "tokens", "token_strs"}; add_special_tokens (a prompt: true by default, the BOS the
    completions endpoint adds; a chat: false, its template holds them), return_token_strs
    (the vocabulary's pieces: "▁Once", "ĠThe")."""
    tokenizer_request(body, model, name, TOKENIZE_FIELDS)
    chat = body.get("messages") is not None
    if chat == (body.get("prompt") is not None):
        raise APIError("/tokenize takes a prompt (a string) or messages, one of them",
                       "prompt")
    for field, (kind, default) in TOKENIZE_FIELDS.items():
        if kind == ("completion" if chat else "chat") and body.get(field) is not None:
            raise APIError(f"{field} goes with "
                           f"{'a prompt' if kind == 'completion' else 'messages'}", field)
    special = flag(body, "add_special_tokens") if body.get("add_special_tokens") is not None \
        else not chat
    if chat:
        messages = body["messages"]
        if not isinstance(messages, list):
            raise APIError(f"messages must be a list of messages, got {json_text(messages)}",
                           "messages")
        generation = body.get("add_generation_prompt")
        ids = chat_prompt(model, messages, longest_token, True if generation is None else
                          flag(body, "add_generation_prompt"))
        if special and model.tokenizer.bos_token_id is not None:
            ids = [model.tokenizer.bos_token_id] + ids
    else:
        prompt = text(body, "prompt")
        assert prompt is not None       # a prompt or messages, one of them (above)
        ids = model.tokenizer.encode(prompt) if special else \
            encode_text(model.tokenizer.backend, prompt, add_special_tokens=False)
    strs = [model.tokenizer.backend.id_to_token(i) for i in ids] \
        if flag(body, "return_token_strs") else None
    return {"count": len(ids), "max_model_len": model.config.max_position_embeddings,
            "tokens": ids, "token_strs": strs}


def detokenize_body(body, model, name: str, longest_token=None) -> dict:
    """vLLM's /detokenize: {"tokens": [ids]} -> {"prompt": their text}, special tokens kept
    (as vLLM decodes)."""
    tokenizer_request(body, model, name, ("model", "tokens"))
    tokens, V = body.get("tokens"), model.config.vocab_size
    if not isinstance(tokens, list) or not all(is_integer(i) and 0 <= i < V for i in tokens):
        bad = next((i for i in tokens if not (is_integer(i) and 0 <= i < V)), None) \
            if isinstance(tokens, list) else tokens
        raise APIError(f"tokens must be a list of token ids in [0, {V}); got "
                       f"{json_text(bad, 40)}", "tokens")
    return {"prompt": model.tokenizer.backend.decode(tokens, skip_special_tokens=False)}


def tokenizer_info(model) -> dict:
    """vLLM's /tokenizer_info: the special tokens by name, the chat template and the class,
    what a client needs to tokenize as the server does (lm-eval reads it to use /tokenize)."""
    if model.tokenizer is None:
        raise APIError("the model has no tokenizer: it serves token ids only", status=404,
                       code="not_found")
    tokens = special_tokens(model)
    return {"tokenizer_class": "PreTrainedTokenizerFast", **tokens,
            "add_bos_token": model.tokenizer.add_bos,
            "chat_template": model.tokenizer.chat_template,
            "model_max_length": model.config.max_position_embeddings}
