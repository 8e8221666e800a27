"""An OpenAI-compatible HTTP server over the online engine (FastAPI on uvicorn, as vLLM).

    POST /v1/completions        text (or token ids) in, a continuation out
    POST /v1/chat/completions   messages in, laid out by the checkpoint's chat template
    GET  /v1/models             the one model served
    POST /tokenize, /detokenize vLLM's: text or chat messages -> token ids, and back
    GET  /tokenizer_info        vLLM's: the special tokens and chat template (lm-eval reads it)
    GET  /health                200 while the engine runs; 503 naming the error once it cannot
                                go on (the server then drains and exits with status 1)
    GET  /metrics               Prometheus text, vLLM's metric names (see prometheus.py)

Every request is submitted to the one ``OnlineEngine`` and answered from its tokens as they
come: the HTTP side never waits for one request before taking the next, so concurrent clients
share the engine's batch. With ``"stream": true`` each piece of text goes out at once as a
Server-Sent Event, ``data: {json}`` and a blank line, ending with ``data: [DONE]``, the framing
OpenAI and vLLM use. A client that disconnects cancels its request: its blocks go back to the
pool before the next step, and it is counted at /metrics as vLLM counts it
(``finished_reason="abort"``). On shutdown (Ctrl-C) uvicorn stops accepting, lets answers in
flight finish for up to ``drain_timeout`` seconds, then the rest are cut short: each stream ends
with finish_reason "abort" and [DONE] (``draining_server``), and serve says on one line how
many finished and how many were cut.

A client's mistake is a 4xx with OpenAI's error body, ``{"error": {"message", "type", "param",
"code"}}``, whatever it is: a bad field (400), a body that is not UTF-8 JSON or gives a key twice
(400), a missing or wrong API key when the server has one (401), an unknown model (404), an
unknown path (404), a wrong method (405), a request too slow to arrive (408), a body over
``max_request_bytes`` (413, refused before it is read), a body under a Content-Type other than
JSON's (415), a full queue (429 with ``Retry-After``; a batch that could never be queued is a
400), even a request that is not HTTP (400). No request stalls
the others: the event loop only moves bytes; parsing the JSON, laying out a chat,
tokenizing and building the stop strings' tables, whose time grows with the request, run in
worker threads, and each new token's text is checked for stop strings in time linear in that
text (detokenize.StopStrings), whatever the strings' length.

With ``n`` > 1 the answer has n choices (streamed chunks say which by their ``index``), and
with logprobs each piece carries the log-probabilities of the tokens it was made from, each
token named by the text it adds (``Sample``): the tokens of a choice join to its text. A batch
of prompts is submitted whole, its prompts batched by the engine like any requests, and its
choices numbered prompt x n + sample.

Needs the ``serve`` extra (fastapi, uvicorn, jinja2); the library imports without it.
Leaves out: keys per client, TLS (put a proxy in front), tools.
"""
from __future__ import annotations  # Request below: the serve extra's, when installed

import asyncio
import contextlib
import hmac
import json
import math
import signal
import socket
import sys
import time
import uuid
from dataclasses import dataclass, field, replace
from http import HTTPStatus
from pathlib import Path

from minitransformer.checks import duplicate_keys, is_integer, is_real
from minitransformer.logprobs import TokenLogprob
from minitransformer.serve.config import EngineConfig
from minitransformer.serve.detokenize import Detokenizer, StopStrings, TextStream
from minitransformer.serve.online import MAX_WAITING, Closed, OnlineEngine, QueueFull
from minitransformer.serve.openai_api import (
    APIError,
    chat_logprobs,
    choice,
    completion_logprobs,
    cut_to,
    detokenize_body,
    longest_token_bytes,
    name_logprobs,
    parse,
    response,
    tokenize_body,
    tokenizer_info,
    usage,
)
from minitransformer.serve.prometheus import ServingMetrics

try:                            # the serve extra; the library imports without it
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.background import BackgroundTask
    from starlette.exceptions import HTTPException
    from starlette.requests import ClientDisconnect
except ImportError:             # create_app says what to install
    FastAPI = None  # type: ignore[misc, assignment]  # the serve extra absent: no class

RETRY_AFTER_S = 1               # what a 429 asks the client to wait
READ_TIMEOUT_S = 60.0           # a request's head and body must arrive within this: else 408
CUT_GRACE_S = 10.0              # after the drain, seconds the answers cut short have to end
GUARDED = ("/v1", "/tokenize", "/detokenize", "/tokenizer_info")   # paths an API key guards
JSON_ESCAPE = 6                 # bytes a JSON string may spend on one byte of text: "\u0001"
SLACK_BYTES = 1 << 20           # room for a request's other fields


def default_max_request_bytes(model) -> int:
    """A body limit that never refuses a prompt filling the model's context, in any text: every
    position holding the vocabulary's longest token, every byte of it spelled as a JSON escape,
    plus 1 MiB. (SmolLM2: 8,192 positions x 81 bytes x 6 + 1 MiB = 5,029,888 bytes.)"""
    positions = model.config.max_position_embeddings
    longest = 8                 # bytes; a list of token ids spends at most this per position
    if model.tokenizer is not None:
        longest = max(longest, longest_token_bytes(model.tokenizer))
    return positions * longest * JSON_ESCAPE + SLACK_BYTES


@dataclass(frozen=True)
class App:
    """What every handler shares (``http.app.state.serving``): one model, served by one online
    engine, under one name."""
    online: OnlineEngine
    name: str                   # the model's name in the API
    limit: int                  # bytes a request body may have: 413 above
    longest: int | None         # bytes of the vocabulary's longest token (None: no tokenizer)
    metrics: ServingMetrics
    created: int                # when the server started, Unix seconds (/v1/models)


def check_request_bytes(max_request_bytes) -> None:
    """None (the default) or an integer >= 1, else a ValueError."""
    if max_request_bytes is not None and (not is_integer(max_request_bytes) or
                                          max_request_bytes < 1):
        raise ValueError(f"max_request_bytes={max_request_bytes!r}: expected an integer >= 1")


def create_app(online: OnlineEngine, name: str, max_request_bytes: int | None = None,
               api_key: str | None = None):
    """The FastAPI application serving one model through one online engine: the routes and
    their handlers below. Bodies over max_request_bytes are refused with 413 (None:
    ``default_max_request_bytes``); with an api_key, the API's routes answer only a client
    that sends it (``RequireKey``)."""
    if FastAPI is None:
        raise ImportError("the server needs the serve extra: pip install -e '.[serve]'")
    check_request_bytes(max_request_bytes)
    if api_key is not None:
        check_api_key(api_key)
    model = online.model
    longest = None if model.tokenizer is None else longest_token_bytes(model.tokenizer)
    app = FastAPI(title="minitransformer", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.serving = App(online, name, max_request_bytes or default_max_request_bytes(model),
                            longest, ServingMetrics(name), int(time.time()))
    app.add_exception_handler(HTTPException,    # Starlette types a handler for any Exception,
                              framework_error)  # type: ignore[arg-type]  # this: HTTPException's
    for method, path, handler in ROUTES:
        app.add_api_route(path, handler, methods=[method])
    if api_key is not None:
        app.add_middleware(RequireKey, key=api_key)
    return app


class RequireKey:
    """ASGI middleware that lets the API's routes (``GUARDED``, /v1/... and the tokenizer's)
    answer only a request with ``Authorization: Bearer KEY``. Any other gets 401 in OpenAI's
    error body, which never shows a key; one with two Authorization headers gets 400 (servers
    and proxies disagree on which of them counts, so none does). The key is compared in constant time
    (hmac.compare_digest), so how long a comparison takes says nothing of where a guess goes
    wrong. /health and /metrics stay open, as vLLM's do: a supervisor and a scraper need no
    key."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and guarded(scope["path"]):
            sent = [value for name, value in scope["headers"] if name == b"authorization"]
            if len(sent) > 1:       # which one counts? Starlette and proxies read the first,
                await error(APIError(   # a dict of the headers keeps the last: neither
                    f"the request has {len(sent)} Authorization headers: send one",
                    code="invalid_api_key"))(scope, receive, send)
                return
            problem = self.refuse(sent[0] if sent else None)
            if problem:
                await error(APIError(
                    f"{problem}: send the header 'Authorization: Bearer KEY' with the key "
                    f"this server was started with", status=401, code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"}))(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def refuse(self, header) -> str:
        """Why this Authorization header is refused, or "" if it carries the key."""
        if header is None:
            return "this server needs an API key"
        scheme, _, token = header.partition(b" ")
        if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
            return "wrong API key"
        return ""


def guarded(path: str) -> bool:
    return any(path == p or path.startswith(p + "/") for p in GUARDED)


# --- the handlers, one per endpoint ----------------------------------------------------------
def serving(http: Request) -> App:
    return http.app.state.serving


def error(e: APIError):
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


async def framework_error(http: Request, e: HTTPException):
    """The framework's own 4xx (unknown path, wrong method) in OpenAI's body."""
    what = {404: f"no route {http.url.path!r:.200}: this server answers /v1/completions, "
                 "/v1/chat/completions, /v1/models, /tokenize, /detokenize, /tokenizer_info, "
                 "/health and /metrics",
            405: f"{http.method} is not allowed on {http.url.path}"}
    codes = {404: "not_found", 405: "method_not_allowed"}
    return error(APIError(what.get(e.status_code, str(e.detail)), status=e.status_code,
                          code=codes.get(e.status_code), headers=e.headers))


async def health(http: Request):
    error = serving(http).online.error     # the engine cannot go on: the server is stopping
    return PlainTextResponse("" if error is None else f"the engine failed: {error!r}\n",
                             status_code=200 if error is None else 503)


async def models(http: Request):
    app = serving(http)
    return {"object": "list", "data": [{
        "id": app.name, "object": "model", "created": app.created, "owned_by": "minitransformer",
        "max_model_len": app.online.model.config.max_position_embeddings}]}


async def prometheus(http: Request):
    app = serving(http)
    return PlainTextResponse(app.metrics.render(app.online.snapshot),
                             media_type="text/plain; version=0.0.4")


async def completions(http: Request):
    return await answer(http, "completion")


async def chat_completions(http: Request):
    return await answer(http, "chat")


async def tokenize(http: Request):
    return await tokenizer_endpoint(http, tokenize_body)


async def detokenize(http: Request):
    return await tokenizer_endpoint(http, detokenize_body)


async def tokenizer_information(http: Request):
    try:
        return tokenizer_info(serving(http).online.model)
    except APIError as e:
        return error(e)


ROUTES = [("GET", "/health", health), ("GET", "/v1/models", models),
          ("GET", "/metrics", prometheus), ("POST", "/v1/completions", completions),
          ("POST", "/v1/chat/completions", chat_completions), ("POST", "/tokenize", tokenize),
          ("POST", "/detokenize", detokenize), ("GET", "/tokenizer_info", tokenizer_information)]


# --- what the handlers share -----------------------------------------------------------------
async def answer(http: Request, kind: str):
    """/v1/completions and /v1/chat/completions: the body checked and submitted, the answer
    streamed as Server-Sent Events or returned whole."""
    app = serving(http)
    try:
        body = await read_json(http, app.limit)
        jobs = await asyncio.to_thread(parse, body, kind, app.online.model, app.name,
                                       app.online.sizes.pool_tokens,
                                       app.online.sizes.max_num_seqs, app.longest)
        for job in jobs:
            check_pool(app, job.request)
        stops = await asyncio.to_thread(StopStrings, jobs[0].stop)  # tables: linear in them
        tickets, tokens = submit_all(app, jobs, stops)
    except APIError as e:
        return error(e)
    except ClientDisconnect:    # gone before it finished sending: nobody to answer
        return PlainTextResponse("", status_code=400)
    rid = f"{'cmpl' if kind == 'completion' else 'chatcmpl'}-{uuid.uuid4().hex}"
    head, job = (rid, int(time.time()), app.name), jobs[0]  # job: the settings all share
    prompt_tokens = sum(len(j.request.prompt) for j in jobs)
    if job.stream:
        return StreamingResponse(events(app, job, len(jobs), prompt_tokens, head, tickets,
                                        tokens), media_type="text/event-stream",
                                 background=BackgroundTask(drain, app, tickets, tokens))
    count = len(jobs) * job.request.n
    texts, reasons, total = [""] * count, {}, 0
    named: list[list] = [[] for _ in range(count)]  # per choice, its NamedLogprobs
    try:
        async for i, piece, lps, reason, total in watch(app, http, tickets, tokens):
            texts[i] += piece
            named[i] += lps
            reasons[i] = reason
    except APIError as e:
        return error(e)
    choices = [choice(kind, texts[i], reasons.get(i), index=i,
                      logprobs=logprobs_object(job, named[i])[0]) for i in range(count)]
    return response(job, *head, choices, usage(prompt_tokens, total))


def logprobs_object(job, named, offset=0) -> tuple:
    """-> (the choice's logprobs object or None, the text offset after it)."""
    if not job.logprobs:
        return None, offset
    if job.kind == "chat":
        return chat_logprobs(named), offset
    return completion_logprobs(named, offset)


async def tokenizer_endpoint(http: Request, handle):
    """/tokenize and /detokenize (vLLM's): the body checked, the work off the loop."""
    app = serving(http)
    try:
        body = await read_json(http, app.limit)
        return await asyncio.to_thread(handle, body, app.online.model, app.name, app.longest)
    except APIError as e:
        return error(e)
    except ClientDisconnect:
        return PlainTextResponse("", status_code=400)


async def read_json(http: Request, limit: int):
    """The request's body as a JSON value: its Content-Type checked, its bytes read (413 past
    the limit), then decoded off the event loop."""
    check_content_type(http.headers.get("content-type"), http.headers.get("origin"))
    return await asyncio.to_thread(decode_json, await read_body(http, limit))


def check_content_type(value, origin=None) -> None:
    """A body is JSON, and its Content-Type must say so: application/json or any
    type/subtype+json, parameters (charset=utf-8) allowed; anything else is a 415. Bodies
    under text/plain, application/x-www-form-urlencoded and multipart/form-data are what any
    web page may send to any server without asking first (no CORS preflight), so a page the
    user visits could otherwise make a local server work for it. A missing Content-Type is
    taken as JSON, unless the request comes from a web page (it has an ``Origin``), since a
    page may send a body of no type (a Blob) without asking first too.

    >>> check_content_type("application/json; charset=utf-8")
    >>> check_content_type(None)
    >>> check_content_type("text/plain")
    Traceback (most recent call last):
    ...
    minitransformer.serve.openai_api.APIError: the body's Content-Type is 'text/plain', not \
JSON: send JSON with the header 'Content-Type: application/json'
    """
    if value is None and origin is None:
        return
    media = (value or "").split(";", 1)[0].strip().lower()
    kind, _, subtype = media.partition("/")
    if media == "application/json" or (kind and subtype.endswith("+json") and
                                        len(subtype) > len("+json")):
        return
    what = f"the body's Content-Type is {value!r:.100}, not JSON" if value is not None else \
        f"a body without a Content-Type from a web page (Origin: {origin!r:.100})"
    raise APIError(f"{what}: send JSON with the header 'Content-Type: application/json'",
                   status=415, code="unsupported_media_type")


async def read_body(http: Request, limit: int) -> bytes:
    """The body, refused with 413 as soon as it is known to exceed the limit: at once from its
    Content-Length, else when the bytes received pass it."""
    declared = http.headers.get("content-length", "0")
    if declared.isdigit() and int(declared) > limit:
        raise_too_large(limit, int(declared))
    chunks, size = [], 0
    async for chunk in http.stream():
        chunks.append(chunk)
        size += len(chunk)
        if size > limit:
            raise_too_large(limit, size, "at least ")
    return b"".join(chunks)


def raise_too_large(limit, size, at_least=""):
    raise APIError(f"the request body has {at_least}{size} bytes; this server takes at most "
                   f"{limit} (--max-request-bytes)", status=413, code="request_too_large")


def check_pool(app: App, request) -> None:
    """n samples that could never be held at once in the pool: a 400 naming n, before any
    answer starts (the prompt and max_tokens alone were checked by parse)."""
    length, sizes = len(request.prompt), app.online.sizes
    need = app.online.pool_need(request)
    if need > sizes.num_blocks:
        raise APIError(f"n={request.n} samples of a {length}-token prompt need {need} KV "
                       f"blocks of {sizes.block_size} tokens at once (the prompt and each "
                       f"sample's first token); the pool has {sizes.num_blocks}: ask for "
                       f"fewer samples", "n")


def submit_all(app: App, jobs, stops):
    """Hand every prompt's job to the engine, all or none (the queue takes the whole batch or
    refuses it) -> (their tickets, one async iterator of (choice index prompt x n + sample,
    text, NamedLogprobs, finish_reason or None, tokens so far over all)). Whoever iterates
    must cancel the tickets when done."""
    waiting = app.online.max_waiting
    if len(jobs) > waiting:     # it would get 429 however long the client waited
        raise APIError(f"a batch of {len(jobs)} prompts can never be queued here: at most "
                       f"{waiting} may wait (--max-waiting); split it into batches of at most "
                       f"{waiting}", "prompt")
    feeds = [feed(app) for _ in jobs]           # (listener, updates) per prompt
    try:
        tickets = app.online.submit_all([(job.request, listener)
                                         for job, (listener, _) in zip(jobs, feeds, strict=True)])
    except ValueError as e:     # the engine refuses it: a client's mistake, said before
        raise APIError(str(e)) from None    # any answer (or stream) starts
    except QueueFull as e:
        raise APIError(f"{e}: retry later", status=429, code="queue_full",
                       headers={"Retry-After": str(RETRY_AFTER_S)}) from None
    except Closed as e:
        raise APIError(str(e), status=503) from None
    for job in jobs:            # counted once the whole batch is in
        app.metrics.accepted(len(job.request.prompt))
    arrival = app.online.now()
    streams = [pieces(app, job, stops, ticket, updates, arrival)
               for job, ticket, (_, updates) in zip(jobs, tickets, feeds, strict=True)]
    return tickets, merged(streams, jobs[0].request.n)


async def merged(streams, n):
    """The items of each prompt's stream, as they come, numbered prompt x n + sample."""
    totals = [0] * len(streams)
    reads = {asyncio.ensure_future(anext(s)): p for p, s in enumerate(streams)}
    try:
        while reads:
            done, _ = await asyncio.wait(reads, return_when=asyncio.FIRST_COMPLETED)
            for read in done:
                p = reads.pop(read)
                try:
                    i, piece, named, reason, totals[p] = read.result()
                except StopAsyncIteration:
                    continue
                reads[asyncio.ensure_future(anext(streams[p]))] = p
                yield p * n + i, piece, named, reason, sum(totals)
    finally:                    # a read still pending is ended before its stream closes
        for read in reads:
            read.cancel()
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration, APIError):
                await read
        for stream in streams:
            await stream.aclose()


def feed(app: App):
    """-> (a listener for the engine's updates of one prompt, the queue it fills on this
    event loop), observing the tokens' timings for /metrics on the way."""
    loop = asyncio.get_running_loop()
    updates: asyncio.Queue = asyncio.Queue()  # the engine's Updates of this prompt, in order
    previous: dict[int, float] = {}  # per sample: when its last tokens were handed over

    def listener(update):       # runs on the engine's loop thread: observe, pass on
        if update.tokens:
            app.metrics.tokens(update.record.arrival, previous.get(update.choice),
                               update.time, len(update.tokens))
            previous[update.choice] = update.time
        loop.call_soon_threadsafe(updates.put_nowait, update)
    return listener, updates


async def pieces(app: App, job, stops, ticket, updates, arrival):
    """Per sample, text as it becomes final -> (sample, text, the NamedLogprobs of the tokens
    whose text it completes, finish_reason or None, tokens so far over all samples); a
    sample's last item carries its finish_reason. With echo, each sample opens with the prompt
    (and its tokens' logprobs); echo with max_tokens 0 is the prompt alone. A sample left
    before its end (the client went away) is counted as vLLM counts it: "abort"."""
    n, online, metrics = job.request.n, app.online, app.metrics
    samples = [Sample(app.online.model.tokenizer, job.request.prompt, stops) for _ in range(n)]
    counts, open_, echo = [0] * n, set(range(n)), None
    try:
        while open_:
            update = await updates.get()
            if update.status in ("rejected", "error"):
                open_.clear()   # never served: not a finished request
                raise APIError(update.reason, status=500 if update.status == "error" else 400)
            i, sample = update.choice, samples[update.choice]
            arrival = update.record.arrival
            if i not in open_:  # tokens made before its stop string's cancel took effect
                continue
            prompt_only = job.request.prompt_only and update.status == "finished"
            if job.echo and counts[i] == 0 and (update.tokens or prompt_only):
                if echo is None:    # the prompt's names: as long as the prompt, off the loop
                    echo = await asyncio.to_thread(
                        echo_named, app.online.model.tokenizer, job.request.prompt,
                        update.record.prompt_logprobs if job.logprobs else None)
                scored = echo if job.logprobs else []
                if prompt_only:         # max_tokens 0: the prompt is the whole answer
                    metrics.ended(arrival, online.now(), "length")
                    open_.discard(i)
                    yield i, "".join(s.text for s in echo), scored, "length", sum(counts)
                    continue
                yield i, "".join(s.text for s in echo), scored, None, sum(counts)
            piece, used = "", 0
            scores = update.logprobs if job.logprobs else (None,) * len(update.tokens)
            for token, scored in zip(update.tokens, scores, strict=True):
                used, piece = used + 1, piece + sample.add(token, scored)
                if sample.text.stopped:
                    online.cancel(ticket, i)    # a stop string: no more tokens needed
                    break
            counts[i] += used
            if sample.text.stopped or update.done:
                piece += sample.finish()
                eos = update.record.tokens and update.record.tokens[-1] in job.eos
                reason = "stop" if sample.text.stopped or eos else \
                    "length" if update.status == "finished" else "abort"
                metrics.ended(arrival, online.now(), reason)
                open_.discard(i)
                yield i, piece, sample.release(final=True), reason, sum(counts)
            else:
                scored = sample.release(final=False)
                if piece or scored:
                    yield i, piece, scored, None, sum(counts)
    finally:
        for _ in open_:
            metrics.ended(arrival, online.now(), "abort")


async def drain(app: App, tickets, tokens):
    """After a stream, however it ended. A client that left before its first chunk left the
    stream unstarted, and its cleanup with it: here its request is cancelled and its samples
    read to their end, so they are counted ("abort") as those of a stream left midway are.
    (Otherwise a no-op: the stream cancelled and closed them.)"""
    for ticket in tickets:
        app.online.cancel(ticket)
    async for _ in tokens:
        pass


async def watch(app: App, http: Request, tickets, tokens):
    """A non-streamed answer: wait for the next piece or the client leaving, whichever comes
    first (a client that left cancels its request, as a stream's does)."""
    gone = asyncio.ensure_future(disconnected(http))
    try:
        while True:
            piece = asyncio.ensure_future(anext(tokens))
            await asyncio.wait({piece, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not piece.done():     # the client left: end the pending read first, so
                piece.cancel()       # the generator runs its own cleanup before aclose
                with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                    await piece
                return
            try:
                yield piece.result()
            except StopAsyncIteration:
                return
    finally:                    # done, failed or left: a no-op if the request is over
        gone.cancel()
        for ticket in tickets:
            app.online.cancel(ticket)
        await tokens.aclose()


async def disconnected(http: Request):
    while not await http.is_disconnected():
        await asyncio.sleep(0.1)


async def events(app: App, job, prompts, prompt_tokens, head: tuple[str, int, str], tickets,
                 tokens):
    """The answer as Server-Sent Events: one chunk per piece of text, then the finish_reason,
    the usage and [DONE]. ``job`` holds the settings the request's prompts share."""
    def sse(reply):
        return f"data: {json.dumps(reply)}\n\n"

    def chunk(*args, **kwargs):
        return sse(response(job, *head, [choice(job.kind, *args, **kwargs)], chunk=True))
    count = prompts * job.request.n
    offsets = [0] * count       # completions: text_offset of each choice's next token
    total = 0
    try:
        if job.kind == "chat":  # a chat stream opens with the role
            for i in range(count):
                yield chunk("", None, True, True, index=i)
        async for i, piece, scored, reason, total in tokens:
            if piece or scored:
                logprobs, offsets[i] = logprobs_object(job, scored, offsets[i])
                yield chunk(piece, None, True, index=i, logprobs=logprobs)
            if reason:
                yield chunk("", reason, True, index=i)
        if job.include_usage:
            yield sse(response(job, *head, [], usage(prompt_tokens, total), chunk=True))
    except APIError as e:
        yield sse(e.body())
    finally:                    # also when the client disconnects mid-stream (the task
        for ticket in tickets:  # iterating this is cancelled): blocks freed at once
            app.online.cancel(ticket)
        await tokens.aclose()   # and the request counted now, not when collected
    yield "data: [DONE]\n\n"


class Sample:
    """One choice as it is written: its text (a TextStream, which holds back stop strings)
    and the NamedLogprobs of its tokens. A token's logprobs are sent once the text it names
    has been, so the tokens of the chunks sent so far join to the text sent so far, and at
    the end to the whole text."""

    def __init__(self, tokenizer, prompt, stop):
        self.text = TextStream(tokenizer, prompt, stop)
        self.held = []              # NamedLogprobs not sent yet
        self.offset = 0             # where held[0]'s text starts in the choice's text
        self.sent = 0               # characters of text sent

    def add(self, token, scored=None) -> str:
        """A new token (and its TokenLogprob, or None) -> the text now final."""
        if scored is not None:      # named before it is added: the text it adds
            self.held.append(name_logprobs(self.text.detokenizer, scored))
        piece = self.text.add(token)
        self.sent += len(piece)
        return piece

    def finish(self) -> str:
        """The text held back at the end (a last incomplete character: its last token's)."""
        piece = self.text.flush()
        if piece and self.held:
            self.held[-1] = replace(self.held[-1], text=self.held[-1].text + piece)
        self.sent += len(piece)
        return piece

    def release(self, final: bool) -> list:
        """The held NamedLogprobs whose text is sent, up to the last that names some text
        (one that names none yet, the first bytes of a character, waits for the next); at the
        end, all of them, cut to the text (a stop string ends it inside a token)."""
        keep, end, kept = 0, self.offset, self.offset
        for k, s in enumerate(self.held, 1):
            end += len(s.text)
            if end > self.sent and not final:
                break
            if s.text or final:
                keep, kept = k, end
        out = cut_to(self.held[:keep], self.offset, self.sent)
        self.held, self.offset = self.held[keep:], min(kept, self.sent)
        return out


def echo_named(tokenizer, prompt, scored=None) -> list:
    """A prompt's tokens named by the text each adds, as echo sends them; scored: the
    engine's prompt logprobs ([None, TokenLogprob, ...]), or None for the texts alone. The
    first token has a null logprob (nothing predicts it); a start token such as <s>, which
    adds no text, is kept in its place and named "" (vLLM names it "<s>", and its
    text_offset then counts 3 characters the text does not hold)."""
    detokenizer, out = Detokenizer(tokenizer), []
    for p, token in enumerate(prompt):
        s = scored[p] if scored is not None and scored[p] is not None else \
            TokenLogprob(token, None, None)
        out.append(name_logprobs(detokenizer, s))
        detokenizer.add(token)
    rest = detokenizer.flush()
    if rest:
        out[-1] = replace(out[-1], text=out[-1].text + rest)
    return out


def decode_json(raw: bytes):
    """A request body -> its JSON value, or a 400 saying why not. Refused are bytes that are
    not UTF-8 (a UTF-8 BOM is allowed; UTF-16 and UTF-32 are not, though Python's parser would
    take them), a key given twice in one object (Python's parser silently keeps the last; the
    error names the key's path, such as ``messages[0].role``), and what the parser refuses
    beyond the grammar (numbers of thousands of digits, nesting too deep)."""
    encoding = json.detect_encoding(raw)
    if encoding not in ("utf-8", "utf-8-sig"):
        raise APIError(f"the request body is {encoding.upper()}, not UTF-8: send UTF-8",
                       code="invalid_json")
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise APIError(f"the request body is not UTF-8 ({e.reason} at byte {e.start})",
                       code="invalid_json") from None
    twice: list[tuple] = []     # (the first object holding a key twice, the key)

    def unique(pairs):
        value = dict(pairs)
        if len(value) < len(pairs) and not twice:
            twice.append((value, duplicate_keys(pairs)[0]))
        return value
    try:
        value = json.loads(text, object_pairs_hook=unique)
    except RecursionError:
        raise APIError("the request body nests JSON arrays or objects too deeply") from None
    except ValueError as e:     # JSONDecodeError, the digit limit
        if "integer string conversion" in str(e):
            raise APIError(f"the request body holds an integer of more than "
                           f"{sys.get_int_max_str_digits()} digits") from None
        raise APIError(f"the request body is not JSON ({e})", code="invalid_json") from None
    if twice:
        where = key_path(value, *twice[0]).encode("utf-8", "replace").decode()
        raise APIError(f"the key {where!r:.200} is given twice in the request body (JSON "
                       f"keeps one of them; say which you mean)", where)
    return value


def key_path(value, holder, key) -> str:
    """Where the object ``holder`` sits in ``value``, then its ``key``, as a path of the body:
    ``max_tokens``, ``messages[0].role``.

    >>> body = {"messages": [{"role": "user"}]}
    >>> key_path(body, body["messages"][0], "role")
    'messages[0].role'
    """
    stack = [(value, "")]
    while stack:            # depth-first, no recursion: the body may nest deeply
        item, path = stack.pop()
        if item is holder:
            return f"{path}.{key}" if path else key
        if isinstance(item, dict):
            stack.extend((v, f"{path}.{k}" if path else k) for k, v in item.items())
        elif isinstance(item, list):
            stack.extend((v, f"{path}[{i}]") for i, v in enumerate(item))
    raise AssertionError("the holder is in the value it was parsed into")


def http_protocol(read_timeout: float = READ_TIMEOUT_S):
    """uvicorn's HTTP/1.1 protocol with two changes. A request that is not HTTP is answered
    with OpenAI's error body, as every other error is (uvicorn's own answer is plain text). And
    a request must arrive whole, head and body, within read_timeout seconds of the connection
    opening (or of the previous answer's end, on a kept-alive connection): a client still
    sending then is answered 408 and disconnected; one that sent nothing is disconnected. So
    clients sending a byte a second cannot hold the server's connections (uvicorn times out
    only an idle kept-alive connection, after 5 s)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class Protocol(H11Protocol):
        timeout = read_timeout
        deadline = None         # the timer of the request arriving now, if one is

        def connection_made(self, transport):
            super().connection_made(transport)
            self.watch()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self.watch()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self.watch()

        def connection_lost(self, exc) -> None:
            self.unwatch()
            super().connection_lost(exc)

        def watch(self) -> None:
            """Time the request while it arrives; stop once it is all in."""
            arriving = self.conn.their_state in (h11.IDLE, h11.SEND_BODY)
            if not arriving or self.transport.is_closing():
                self.unwatch()
            elif self.deadline is None:
                self.deadline = self.loop.call_later(self.timeout, self.too_slow)

        def unwatch(self) -> None:
            if self.deadline is not None:
                self.deadline.cancel()
                self.deadline = None

        def too_slow(self) -> None:
            self.deadline = None
            state = self.conn.their_state
            answered = state is h11.SEND_BODY and self.cycle.response_started  # (413)
            if answered or (state is h11.IDLE and not self.conn.trailing_data[0]):
                self.transport.close()  # nothing to say: no request, or already answered
                return
            self.send_error(408, APIError(
                f"the request did not arrive whole within {self.timeout:g} s "
                f"(--read-timeout): send its head and body without pausing",
                status=408, code="request_timeout"))

        def send_400_response(self, msg: str) -> None:
            self.send_error(400, APIError(f"not a valid HTTP/1.1 request "
                                          f"({msg.rstrip('.')})", code="malformed_request"))

        def send_error(self, status: int, e: APIError) -> None:
            """Answer with OpenAI's error body and close the connection (only close it if an
            answer is being written: its client sent more while it was)."""
            cycle = self.cycle
            if cycle is None or not cycle.response_started or cycle.response_complete:
                body = json.dumps(e.body()).encode()
                head = (f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\n"
                        f"content-type: application/json\r\nconnection: close\r\n"
                        f"content-length: {len(body)}\r\n\r\n")
                self.transport.write(head.encode() + body)
            self.transport.close()

    return Protocol


def draining_server(config, online: OnlineEngine, drain_timeout: float):
    """uvicorn's Server, whose shutdown (Ctrl-C) ends every answer rather than its task: the
    answers in flight have ``drain_timeout`` seconds to finish (or until a second Ctrl-C),
    then those left are cut short (``OnlineEngine.close(drain=False)``), so each stream ends
    with finish_reason "abort", its usage and [DONE], and each whole answer with the text so
    far. uvicorn itself would cancel the tasks writing them, mid-write: the client's stream
    ends with no reason, the server's log with a CancelledError's traceback. ``in_flight``
    and ``cut`` say what it found and cut (the line serve prints)."""
    import uvicorn

    class Server(uvicorn.Server):
        in_flight = cut = 0
        loop, hurried = None, False

        def handle_exit(self, sig, frame):
            """A second Ctrl-C ends the drain now (uvicorn's would quit at once, cutting the
            streams mid-write); a third quits as uvicorn does."""
            if sig == signal.SIGINT and self.should_exit and not self.hurried:
                self.hurried = True
                if self.loop is not None:   # shutting down: cut on the event loop, now
                    self.loop.call_soon_threadsafe(self.cut_short)
                return
            super().handle_exit(sig, frame)

        async def shutdown(self, sockets=None):
            self.loop, self.in_flight = asyncio.get_running_loop(), online.in_flight()
            timer = self.loop.call_later(0 if self.hurried else drain_timeout, self.cut_short)
            try:
                await super().shutdown(sockets)
            finally:
                timer.cancel()

        def cut_short(self):
            if online.closing:          # cut already
                return
            self.cut = online.in_flight()
            online.close(drain=False, timeout=0)    # the loop cuts them and hands them over
    config.timeout_graceful_shutdown = drain_timeout + CUT_GRACE_S
    return Server(config)


@dataclass(frozen=True)
class ServerLimits:
    """What the server takes from its clients, and from whom, beside the engine's own sizes
    (EngineConfig)."""
    max_waiting: int = MAX_WAITING      # waiting requests beyond which a new one gets 429
    max_request_bytes: int | None = None  # bodies above it get 413; None: the default (above)
    drain_timeout: float = 30.0         # seconds answers in flight may finish on shutdown
    read_timeout: float = READ_TIMEOUT_S    # seconds a request may take to arrive: then 408
    api_key: str | None = field(default=None, repr=False)  # None: any client is served

    def __post_init__(self):
        if not is_integer(self.max_waiting) or self.max_waiting < 1:
            raise ValueError(f"max_waiting={self.max_waiting!r}: expected an integer >= 1 "
                             f"(with 0, every request would be refused)")
        if not is_real(self.drain_timeout) or not 0 <= self.drain_timeout < math.inf:
            raise ValueError(f"drain_timeout={self.drain_timeout!r}: expected seconds >= 0")
        check_request_bytes(self.max_request_bytes)
        if not is_real(self.read_timeout) or not 0 < self.read_timeout < math.inf:
            raise ValueError(f"read_timeout={self.read_timeout!r}: expected seconds > 0")
        if self.api_key is not None:
            check_api_key(self.api_key)


def check_api_key(key) -> None:
    """A key a client can send in a header: printable ASCII, no spaces (the error never shows
    the key, which may sit in a log)."""
    if not isinstance(key, str) or not key or not all(33 <= ord(c) <= 126 for c in key):
        raise ValueError("the API key (--api-key, MT_API_KEY) must be a non-empty string of "
                         "printable ASCII without spaces")


def bound_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port for uvicorn to listen on (port 0 lets the system pick
    a free one). It is bound before the model loads, so a busy port is said at once, and the
    server says where it serves only once the address is its own. A port out of range is a
    ValueError; an address that cannot be had, an OSError naming it."""
    if not is_integer(port) or not 0 <= port <= 65535:
        raise ValueError(f"port={port!r}: expected an integer in 0..65535")
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as uvicorn binds
    try:
        sock.bind((host, port))
    except OSError as e:        # busy, not this machine's address, an unknown name
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def serve(model_path, config: EngineConfig | None = None, host: str = "127.0.0.1", port: int = 8000,
          limits: ServerLimits | None = None, name: str | None = None) -> None:
    """Load a model and serve it until interrupted (Ctrl-C drains, then cancels). ``config``
    is the engine's (EngineConfig's defaults when None); ``name`` is the model's name in the
    API (the checkpoint's folder name when None)."""
    try:
        import uvicorn
    except ImportError:
        raise ImportError("the server needs the serve extra: pip install -e '.[serve]'") from None
    import minitransformer as mt
    from minitransformer.kernels import threads
    from minitransformer.kernels.blas import expect_rows
    from minitransformer.serve.engine import Engine

    config, limits = config or EngineConfig(), limits or ServerLimits()
    if not config.batch_invariant:      # its steps multiply max_num_seqs rows: measured at load
        expect_rows(config.max_num_seqs)
    sock = bound_socket(host, port)
    online = None

    def stop(error):                # a failed engine: the server (made below) stops
        server.should_exit = True

    try:
        model = mt.load(model_path)
        name = name or Path(model.path).name
        engine = Engine(model, config)
        online = OnlineEngine(engine, max_waiting=limits.max_waiting, on_failure=stop)
        budget = config.max_num_batched_tokens
        chunks = "whole prompts" if budget is None else f"chunked prefill, {budget} tokens a step"
        limit = limits.max_request_bytes or default_max_request_bytes(model)
        where = f"[{host}]" if ":" in host else host
        print(f"serving {name!r} ({config.policy} batching, {config.max_num_seqs} slots, "
              f"{engine.cache.books.num_blocks} blocks of {config.block_size}, prefix caching "
              f"{'on' if config.enable_prefix_caching else 'off'}, {chunks}, "
              f"{config.kv_cache_dtype} cache, {config.attention} attention, bodies up to "
              f"{limit:,} bytes, {'an' if limits.api_key else 'no'} API key required, "
              f"{threads.describe()}) on "
              f"http://{where}:{sock.getsockname()[1]}/v1", file=sys.stderr)
        server = draining_server(uvicorn.Config(
            create_app(online, name, limit, limits.api_key),
            http=http_protocol(limits.read_timeout), log_level="warning"), online,
            limits.drain_timeout)
        try:
            server.run(sockets=[sock])
        except KeyboardInterrupt:   # Ctrl-C: uvicorn drained, stopped, then raised it again
            pass
        if online.error is None:
            print(f"stopped: of {server.in_flight} requests in flight, "
                  f"{server.in_flight - server.cut} finished and {server.cut} were cut short "
                  f"{'at a second Ctrl-C' if server.hurried else 'after the drain of'} "
                  f"{limits.drain_timeout:g} s (finish_reason \"abort\")",
                  file=sys.stderr)
    finally:
        sock.close()
        if online is not None:
            online.close(drain=False, timeout=10)
    if online.error is not None:    # drained; a supervisor restarts a process that exits 1
        raise SystemExit(f"error: the engine failed and cannot go on: {online.error!r}")
