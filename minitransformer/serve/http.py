"""An OpenAI-compatible HTTP server over the online engine (FastAPI on uvicorn, as vLLM).

    POST /v1/completions        text (or token ids) in, a continuation out
    POST /v1/chat/completions   messages in, laid out by the checkpoint's chat template
    GET  /v1/models             the one model served
    GET  /health                200 while the engine runs
    GET  /metrics               Prometheus text, vLLM's metric names (see prometheus.py)

Every request is submitted to the one ``OnlineEngine`` and answered from its tokens as they
come: the HTTP side never waits for one request before taking the next, so concurrent clients
share the engine's batch. With ``"stream": true`` each piece of text goes out at once as a
Server-Sent Event, ``data: {json}`` and a blank line, ending with ``data: [DONE]``, the framing
OpenAI and vLLM use. A client that disconnects cancels its request: its blocks go back to the
pool before the next step. A full queue answers 429 with ``Retry-After``; a bad field, 400.
On shutdown uvicorn stops accepting, lets answers in flight finish for up to
``drain_timeout`` seconds, then the rest are cancelled.

With ``n`` > 1 the answer has n choices (streamed chunks say which by their ``index``), and
with logprobs each piece carries the log-probabilities of the tokens it was made from.

Needs the ``serve`` extra (fastapi, uvicorn, jinja2); the library imports without it.
Leaves out: authentication (any API key is accepted), tools.
"""
import asyncio
import json
import sys
import time
import uuid
from pathlib import Path

from minitransformer.serve.detokenize import TextStream
from minitransformer.serve.engine import BLOCK_SIZE, SLOTS
from minitransformer.serve.online import MAX_WAITING, Closed, OnlineEngine, QueueFull
from minitransformer.serve.openai_api import (APIError, chat_logprobs, choice,
                                              completion_logprobs, parse, response,
                                              unpredicted, usage)
from minitransformer.serve.prometheus import ServingMetrics

RETRY_AFTER_S = 1               # what a 429 asks the client to wait


def create_app(online: OnlineEngine, name: str):
    """The FastAPI application serving one model through one online engine."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

    model, cache = online.engine.model, online.engine.cache
    metrics = ServingMetrics(name)
    app = FastAPI(title="minitransformer", docs_url=None, redoc_url=None)
    created = int(time.time())

    def error(e: APIError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.get("/health")
    async def health():
        return PlainTextResponse("", status_code=503 if online.error else 200)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": name, "object": "model", "created": created, "owned_by": "minitransformer",
            "max_model_len": model.config.max_position_embeddings}]}

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(metrics.render(online.snapshot),
                                 media_type="text/plain; version=0.0.4")

    async def answer(http: Request, kind: str):
        try:
            body = await http.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return error(APIError(f"the request body is not JSON ({e})"))
        try:
            job = parse(body, kind, model, name, cache.num_blocks * cache.block_size,
                        max_n=len(online.engine.slots))
            ticket, tokens = submit(job)
        except APIError as e:
            return error(e)
        rid = f"{'cmpl' if kind == 'completion' else 'chatcmpl'}-{uuid.uuid4().hex}"
        head = (rid, int(time.time()), name)
        if job.stream:
            return StreamingResponse(events(job, head, ticket, tokens),
                                     media_type="text/event-stream")
        n = job.request.n
        texts, scored, reasons, total = [""] * n, [[] for _ in range(n)], {}, 0
        try:
            async for i, piece, lps, reason, total in watch(http, ticket, tokens):
                texts[i] += piece
                scored[i] += lps
                reasons[i] = reason
        except APIError as e:
            return error(e)
        choices = [choice(kind, texts[i], reasons.get(i), index=i,
                          logprobs=logprobs_object(job, scored[i])[0])
                   for i in range(job.request.n)]
        return response(job, *head, choices, usage(len(job.request.prompt), total))

    def logprobs_object(job, scored, offset=0) -> tuple:
        """-> (the choice's logprobs object or None, the text offset after it)."""
        if not job.logprobs:
            return None, offset
        if job.kind == "chat":
            return chat_logprobs(model.tokenizer, scored), offset
        return completion_logprobs(model.tokenizer, scored, offset)

    @app.post("/v1/completions")
    async def completions(http: Request):
        return await answer(http, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(http: Request):
        return await answer(http, "chat")

    def submit(job):
        """Hand the job to the engine -> (its ticket, an async iterator of (text,
        finish_reason, tokens so far)). Whoever iterates must cancel the ticket when done."""
        loop, updates = asyncio.get_running_loop(), asyncio.Queue()
        previous = {}               # per sample: when its last tokens were handed over

        def listener(update):       # runs on the engine's loop thread: observe, pass on
            if update.tokens:
                metrics.tokens(update.record.arrival, previous.get(update.choice), update.time,
                               len(update.tokens))
                previous[update.choice] = update.time
            loop.call_soon_threadsafe(updates.put_nowait, update)
        try:
            ticket = online.submit(job.request, listener)
        except QueueFull as e:
            raise APIError(f"{e}: retry later", status=429, code="queue_full",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except Closed as e:
            raise APIError(str(e), status=503) from None
        metrics.accepted(len(job.request.prompt))
        return ticket, pieces(job, ticket, updates)

    async def pieces(job, ticket, updates):
        """Per sample, text as it becomes final -> (sample, text, the TokenLogprobs of the
        tokens it came from, finish_reason or None, tokens so far over all samples); a
        sample's last item carries its finish_reason. With echo, each sample opens with the
        prompt (and its tokens' logprobs)."""
        n = job.request.n
        texts = [TextStream(model.tokenizer, job.request.prompt, job.stop) for _ in range(n)]
        counts, open_ = [0] * n, set(range(n))
        while open_:
            update = await updates.get()
            if update.status in ("rejected", "error"):
                raise APIError(update.reason, status=500 if update.status == "error" else 400)
            i, text = update.choice, texts[update.choice]
            if i not in open_:      # tokens made before its stop string's cancel took effect
                continue
            if job.echo is not None and counts[i] == 0 and update.tokens:
                prompt = job.request.prompt
                scored = [unpredicted(prompt[0])] + update.record.prompt_logprobs[1:] \
                    if job.logprobs else []
                yield i, job.echo, scored, None, sum(counts)
            piece, used = "", 0
            for token in update.tokens:
                used, piece = used + 1, piece + text.add(token)
                if text.stopped:
                    online.cancel(ticket, i)    # a stop string: no more tokens needed
                    break
            counts[i] += used
            scored = list(update.logprobs[:used])
            if text.stopped or update.done:
                eos = update.record.tokens and update.record.tokens[-1] in job.eos
                reason = "stop" if text.stopped or eos else \
                    "length" if update.status == "finished" else "abort"
                metrics.ended(update.record.arrival, online.now(), reason)
                open_.discard(i)
                yield i, piece + ("" if text.stopped else text.flush()), scored, reason, \
                    sum(counts)
            elif piece or scored:
                yield i, piece, scored, None, sum(counts)

    async def watch(http, ticket, tokens):
        """A non-streamed answer: wait for the next piece or the client leaving, whichever
        comes first (a client that left cancels its request, as a stream's does)."""
        gone = asyncio.ensure_future(disconnected(http))
        try:
            while True:
                piece = asyncio.ensure_future(anext(tokens))
                await asyncio.wait({piece, gone}, return_when=asyncio.FIRST_COMPLETED)
                if not piece.done():
                    piece.cancel()
                    return
                try:
                    yield piece.result()
                except StopAsyncIteration:
                    return
        finally:                    # done, failed or left: a no-op if the request is over
            gone.cancel()
            online.cancel(ticket)
            await tokens.aclose()

    async def disconnected(http):
        while not await http.is_disconnected():
            await asyncio.sleep(0.1)

    async def events(job, head, ticket, tokens):
        """Server-Sent Events: one chunk per piece, the finish_reason, usage, [DONE]."""
        def sse(reply):
            return f"data: {json.dumps(reply)}\n\n"

        def chunk(*args, **kwargs):
            return sse(response(job, *head, [choice(job.kind, *args, **kwargs)], chunk=True))
        offsets = [0] * job.request.n   # completions: text_offset of each sample's next token
        total = 0
        try:
            if job.kind == "chat":  # a chat stream opens with the role
                for i in range(job.request.n):
                    yield chunk("", None, True, True, index=i)
            async for i, piece, scored, reason, total in tokens:
                if piece or scored:
                    logprobs, offsets[i] = logprobs_object(job, scored, offsets[i])
                    yield chunk(piece, None, True, index=i, logprobs=logprobs)
                if reason:
                    yield chunk("", reason, True, index=i)
            if job.include_usage:
                yield sse(response(job, *head, [], usage(len(job.request.prompt), total),
                                   chunk=True))
        except APIError as e:
            yield sse(e.body())
        finally:                    # also when the client disconnects mid-stream (the task
            online.cancel(ticket)   # iterating this is cancelled): blocks freed at once
        yield "data: [DONE]\n\n"

    return app


def serve(model_path, host="127.0.0.1", port=8000, name=None, slots=SLOTS, num_blocks=None,
          block_size=BLOCK_SIZE, policy="continuous", max_waiting=MAX_WAITING,
          batch_invariant=False, drain_timeout=30.0, prefix_caching=True,
          max_num_batched_tokens=None) -> None:
    """Load a model and serve it until interrupted (Ctrl-C drains, then cancels)."""
    try:
        import uvicorn
    except ImportError:
        raise ImportError("the server needs the serve extra: pip install -e '.[serve]'") from None
    import minitransformer as mt
    from minitransformer.serve.engine import Engine

    model = mt.load(model_path)
    name = name or Path(model.path).name
    engine = Engine(model, slots=slots, num_blocks=num_blocks, block_size=block_size,
                    policy=policy, batch_invariant=batch_invariant,
                    prefix_caching=prefix_caching, max_num_batched_tokens=max_num_batched_tokens)
    online = OnlineEngine(engine, max_waiting=max_waiting)
    chunks = "whole prompts" if max_num_batched_tokens is None else \
        f"chunked prefill, {max_num_batched_tokens} tokens a step"
    print(f"serving {name!r} ({policy} batching, {slots} slots, {engine.cache.num_blocks} "
          f"blocks of {block_size}, prefix caching {'on' if prefix_caching else 'off'}, "
          f"{chunks}) on http://{host}:{port}/v1", file=sys.stderr)
    try:
        uvicorn.run(create_app(online, name), host=host, port=port, log_level="warning",
                    timeout_graceful_shutdown=drain_timeout)
    finally:
        online.close(drain=False, timeout=10)
