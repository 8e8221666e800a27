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
(``finished_reason="abort"``). On shutdown uvicorn stops accepting, lets answers in flight
finish for up to ``drain_timeout`` seconds, then the rest are cancelled.

A client's mistake is a 4xx with OpenAI's error body, ``{"error": {"message", "type", "param",
"code"}}``, whatever it is: a bad field (400), an unknown model (404), an unknown path (404), a
wrong method (405), a body over ``max_request_bytes`` (413, refused before it is read), a full
queue (429 with ``Retry-After``), even a request that is not HTTP (400). No request stalls
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
Leaves out: authentication (any API key is accepted), tools.
"""
from __future__ import annotations      # Request below: the serve extra's, when installed

import asyncio
import contextlib
import json
import math
import socket
import sys
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path

from minitransformer.checks import is_integer, is_real
from minitransformer.logprobs import TokenLogprob
from minitransformer.serve.config import EngineConfig
from minitransformer.serve.detokenize import Detokenizer, StopStrings, TextStream
from minitransformer.serve.online import MAX_WAITING, Closed, OnlineEngine, QueueFull
from minitransformer.serve.openai_api import (APIError, chat_logprobs, choice,
                                              completion_logprobs, cut_to, detokenize_body,
                                              longest_token_bytes, name_logprobs, parse,
                                              response, tokenize_body, tokenizer_info,
                                              usage)
from minitransformer.serve.prometheus import ServingMetrics

try:                            # the serve extra; the library imports without it
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.background import BackgroundTask
    from starlette.exceptions import HTTPException
    from starlette.requests import ClientDisconnect
except ImportError:             # create_app says what to install
    FastAPI = None

RETRY_AFTER_S = 1               # what a 429 asks the client to wait
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
    longest: int                # bytes of the vocabulary's longest token (None: no tokenizer)
    metrics: ServingMetrics
    created: int                # when the server started, Unix seconds (/v1/models)

    @property
    def model(self):
        return self.online.engine.model

    @property
    def cache(self):
        return self.online.engine.cache


def check_request_bytes(max_request_bytes) -> None:
    """None (the default) or an integer >= 1, else a ValueError."""
    if max_request_bytes is not None and (not is_integer(max_request_bytes) or
                                          max_request_bytes < 1):
        raise ValueError(f"max_request_bytes={max_request_bytes!r}: expected an integer >= 1")


def create_app(online: OnlineEngine, name: str, max_request_bytes: int = None):
    """The FastAPI application serving one model through one online engine: the routes and
    their handlers below. Bodies over max_request_bytes are refused with 413 (None:
    ``default_max_request_bytes``)."""
    if FastAPI is None:
        raise ImportError("the server needs the serve extra: pip install -e '.[serve]'")
    check_request_bytes(max_request_bytes)
    model = online.engine.model
    longest = None if model.tokenizer is None else longest_token_bytes(model.tokenizer)
    app = FastAPI(title="minitransformer", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.serving = App(online, name, max_request_bytes or default_max_request_bytes(model),
                            longest, ServingMetrics(name), int(time.time()))
    app.add_exception_handler(HTTPException, framework_error)
    for method, path, handler in ROUTES:
        app.add_api_route(path, handler, methods=[method])
    return app


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
        "max_model_len": app.model.config.max_position_embeddings}]}


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
        return tokenizer_info(serving(http).model)
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
        raw = await read_body(http, app.limit)
        body = await asyncio.to_thread(decode_json, raw)
        jobs = await asyncio.to_thread(parse, body, kind, app.model, app.name,
                                       app.cache.num_blocks * app.cache.block_size,
                                       app.online.engine.config.max_num_seqs, app.longest)
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
    texts, named, reasons, total = [""] * count, [[] for _ in range(count)], {}, 0
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
        body = await asyncio.to_thread(decode_json, await read_body(http, app.limit))
        return await asyncio.to_thread(handle, body, app.model, app.name, app.longest)
    except APIError as e:
        return error(e)
    except ClientDisconnect:
        return PlainTextResponse("", status_code=400)


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
    length, cache = len(request.prompt), app.cache
    need = app.online.engine.pool_need(length, request.max_new_tokens, request.n)
    if need > cache.num_blocks:
        raise APIError(f"n={request.n} samples of a {length}-token prompt need {need} KV "
                       f"blocks of {cache.block_size} tokens at once (the prompt and each "
                       f"sample's first token); the pool has {cache.num_blocks}: ask for "
                       f"fewer samples", "n")


def submit_all(app: App, jobs, stops):
    """Hand every prompt's job to the engine, all or none (the queue takes the whole batch or
    refuses it) -> (their tickets, one async iterator of (choice index prompt x n + sample,
    text, NamedLogprobs, finish_reason or None, tokens so far over all)). Whoever iterates
    must cancel the tickets when done."""
    feeds = [feed(app) for _ in jobs]           # (listener, updates) per prompt
    try:
        tickets = app.online.submit_all([(job.request, listener)
                                         for job, (listener, _) in zip(jobs, feeds)])
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
               for job, ticket, (_, updates) in zip(jobs, tickets, feeds)]
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
    loop, updates = asyncio.get_running_loop(), asyncio.Queue()
    previous = {}               # per sample: when its last tokens were handed over

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
    samples = [Sample(app.model.tokenizer, job.request.prompt, stops) for _ in range(n)]
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
            if job.echo and counts[i] == 0 and update.tokens:
                if echo is None:    # the prompt's names: as long as the prompt, off the loop
                    echo = await asyncio.to_thread(
                        echo_named, app.model.tokenizer, job.request.prompt,
                        update.record.prompt_logprobs if job.logprobs else None)
                scored = echo if job.logprobs else []
                if job.prompt_only:     # its one token is not part of the answer
                    online.cancel(ticket, i)
                    metrics.ended(arrival, online.now(), "length")
                    open_.discard(i)
                    yield i, "".join(s.text for s in echo), scored, "length", sum(counts)
                    continue
                yield i, "".join(s.text for s in echo), scored, None, sum(counts)
            piece, used = "", 0
            scores = update.logprobs if job.logprobs else (None,) * len(update.tokens)
            for token, scored in zip(update.tokens, scores):
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


async def events(app: App, job, prompts, prompt_tokens, head, tickets, tokens):
    """Server-Sent Events: one chunk per piece, the finish_reason, usage, [DONE]; job: the
    settings the request's prompts share."""
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
    """One choice as it is written: its text (a TextStream: stop strings held back) and the
    NamedLogprobs of its tokens, each sent once the text it names is: so the tokens of every
    chunk so far join to the text sent so far, and at the end to the whole text."""

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
    """A request body -> its JSON value, or a 400 saying why not (also for what Python's
    parser refuses beyond the grammar: numbers of thousands of digits, nesting too deep)."""
    try:
        return json.loads(raw)
    except RecursionError:
        raise APIError("the request body nests JSON arrays or objects too deeply") from None
    except ValueError as e:     # JSONDecodeError, UnicodeDecodeError, the digit limit
        if "integer string conversion" in str(e):
            raise APIError(f"the request body holds an integer of more than "
                           f"{sys.get_int_max_str_digits()} digits") from None
        raise APIError(f"the request body is not JSON ({e})", code="invalid_json") from None


def http_protocol():
    """uvicorn's HTTP/1.1 protocol, answering a request that is not HTTP with OpenAI's error
    body as every other error is answered (uvicorn's own answer is plain text)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class Protocol(H11Protocol):
        def send_400_response(self, msg: str) -> None:
            body = json.dumps(APIError(f"not a valid HTTP/1.1 request ({msg.rstrip('.')})",
                                       code="malformed_request").body()).encode()
            headers = [(b"content-type", b"application/json"), (b"connection", b"close"),
                       (b"content-length", str(len(body)).encode())]
            for event in (h11.Response(status_code=400, headers=headers), h11.Data(data=body),
                          h11.EndOfMessage()):
                self.transport.write(self.conn.send(event))
            self.transport.close()

    return Protocol


@dataclass(frozen=True)
class ServerLimits:
    """What the server takes from its clients, beside the engine's own sizes (EngineConfig)."""
    max_waiting: int = MAX_WAITING      # waiting requests beyond which a new one gets 429
    max_request_bytes: int = None       # bodies above it get 413; None: the default (above)
    drain_timeout: float = 30.0         # seconds answers in flight may finish on shutdown

    def __post_init__(self):
        if not is_integer(self.max_waiting) or self.max_waiting < 0:
            raise ValueError(f"max_waiting={self.max_waiting!r}: expected an integer >= 0")
        if not is_real(self.drain_timeout) or not 0 <= self.drain_timeout < math.inf:
            raise ValueError(f"drain_timeout={self.drain_timeout!r}: expected seconds >= 0")
        check_request_bytes(self.max_request_bytes)


def bound_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port (port 0: a free one the system picks), for uvicorn to
    listen on: bound before the model loads, so a busy port is said at once, and the server
    says where it serves only once the address is its own. A port out of range is a
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


def serve(model_path, config: EngineConfig = None, host: str = "127.0.0.1", port: int = 8000,
          limits: ServerLimits = None, name: str = None) -> None:
    """Load a model and serve it until interrupted (Ctrl-C drains, then cancels). config: the
    engine's (None: EngineConfig's defaults); name: the model's name in the API (None: the
    checkpoint's folder name)."""
    try:
        import uvicorn
    except ImportError:
        raise ImportError("the server needs the serve extra: pip install -e '.[serve]'") from None
    import minitransformer as mt
    from minitransformer.kernels.blas import expect_rows
    from minitransformer.serve.engine import Engine

    config, limits = config or EngineConfig(), limits or ServerLimits()
    if not config.batch_invariant:      # its steps multiply max_num_seqs rows: measured at load
        expect_rows(config.max_num_seqs)
    sock = bound_socket(host, port)
    online = None
    try:
        model = mt.load(model_path)
        name = name or Path(model.path).name
        engine = Engine(model, config)
        online = OnlineEngine(engine, max_waiting=limits.max_waiting,   # a failed engine:
                              on_failure=lambda error: setattr(server, "should_exit", True))
        budget = config.max_num_batched_tokens
        chunks = "whole prompts" if budget is None else f"chunked prefill, {budget} tokens a step"
        limit = limits.max_request_bytes or default_max_request_bytes(model)
        where = f"[{host}]" if ":" in host else host
        print(f"serving {name!r} ({config.policy} batching, {config.max_num_seqs} slots, "
              f"{engine.cache.num_blocks} blocks of {config.block_size}, prefix caching "
              f"{'on' if config.enable_prefix_caching else 'off'}, {chunks}, "
              f"{config.kv_cache_dtype} cache, {config.attention} attention, bodies up to "
              f"{limit:,} bytes) on http://{where}:{sock.getsockname()[1]}/v1", file=sys.stderr)
        server = uvicorn.Server(uvicorn.Config(
            create_app(online, name, limit), http=http_protocol(), log_level="warning",
            timeout_graceful_shutdown=limits.drain_timeout))
        try:
            server.run(sockets=[sock])
        except KeyboardInterrupt:   # Ctrl-C: uvicorn drained, stopped, then raised it again
            pass
    finally:
        sock.close()
        if online is not None:
            online.close(drain=False, timeout=10)
    if online.error is not None:    # drained; a supervisor restarts a process that exits 1
        raise SystemExit(f"error: the engine failed and cannot go on: {online.error!r}")
