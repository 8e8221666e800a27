"""A client that leaves is cancelled, whenever it leaves: mid-stream (its blocks freed), while
waiting (no error logged), before the stream's first chunk; and each cancelled sample is
counted as an abort in /metrics."""
import json
import time
import urllib.request

import pytest

from conftest import wait_for
from minitransformer.serve.config import EngineConfig
from minitransformer.serve.engine import Engine
from minitransformer.serve.online import OnlineEngine
from minitransformer.serve.records import Request

pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
import openai

from minitransformer.serve.http import create_app
from servers import NAME, Background


def test_a_client_that_disconnects_frees_its_blocks(served):
    online, url, client = served
    stream = client.completions.create(model=NAME, prompt="Once upon a time", max_tokens=150,
                                       stream=True, extra_body={"ignore_eos": True})
    pieces = [next(iter(stream)) for _ in range(3)]
    assert pieces and online.snapshot.blocks_used > 0
    stream.close()                  # the client goes away mid-answer
    wait_for(lambda: online.snapshot.blocks_used == 0 and online.snapshot.running == 0)
    record = online.engine.results[max(online.engine.results)]
    assert record.status == "cancelled" and len(record.tokens) < 150


def test_a_waiting_client_that_gives_up_is_cancelled(model):
    """Not streamed: a client that times out while its request waits leaves the queue, and
    the server logs no error for it (a client leaving is not the server's fault)."""
    import logging

    errors = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = errors.append
    logging.getLogger("uvicorn.error").addHandler(handler)
    online = OnlineEngine(Engine(model, EngineConfig(max_num_seqs=1, num_gpu_blocks_override=64,
                                                     block_size=4), history=True))
    server = Background(create_app(online, NAME))
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    try:                            # a slow listener keeps the only slot busy for seconds
        hog = online.submit(Request((1, 2), 200, eos_token_id=[]),
                            lambda update: time.sleep(0.02))
        wait_for(lambda: online.snapshot.running == 1)
        with pytest.raises(openai.APITimeoutError):
            client.completions.create(model=NAME, prompt="b", max_tokens=5, timeout=0.3)
        wait_for(lambda: len(online.engine.results) == 2 and
                 online.engine.results[1].status == "cancelled", timeout=5)
        assert online.engine.results[1].tokens == [] and online.engine.results[0].status == \
            "running"
        online.cancel(hog)
        time.sleep(0.3)             # the handler's cleanup after the client left
        assert not errors, [record.getMessage() for record in errors]
    finally:
        logging.getLogger("uvicorn.error").removeHandler(handler)
        server.stop()
        online.close()


def test_cancelled_requests_are_counted_as_abort(served):
    online, url, client = served

    def aborted():
        text = urllib.request.urlopen(url + "/metrics").read().decode()
        line = f'vllm:request_success_total{{finished_reason="abort",model_name="{NAME}"}} '
        return int(next(s for s in text.splitlines() if s.startswith(line)).split()[-1])

    before = aborted()
    stream = client.completions.create(model=NAME, prompt="Once upon a time", max_tokens=150,
                                       stream=True, extra_body={"ignore_eos": True})
    next(iter(stream))
    stream.close()                  # the client goes away mid-answer
    wait_for(lambda: aborted() == before + 1)
    client.completions.create(model=NAME, prompt="The end", max_tokens=3)
    assert aborted() == before + 1  # a finished request is not an abort
    stream = client.completions.create(model=NAME, prompt="Once upon a time", max_tokens=150,
                                       n=2, stream=True, extra_body={"ignore_eos": True})
    next(iter(stream))
    stream.close()                  # two samples, each counted as its own finished sequence
    wait_for(lambda: aborted() == before + 3)


def test_a_stream_left_before_its_first_chunk_is_cancelled_and_counted(model):
    """A client gone while the answer is starting, before the stream's first chunk (the stream
    never started, so its own cleanup never ran): its request is cancelled and counted as an
    abort all the same. Played at the ASGI level: the response's start is never sent, and
    the client says it left."""
    import asyncio

    online = OnlineEngine(Engine(model, EngineConfig(max_num_seqs=1, block_size=4)))
    app = create_app(online, NAME)
    body = json.dumps({"model": NAME, "prompt": [5, 6], "max_tokens": 100, "stream": True,
                       "ignore_eos": True}).encode()
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
             "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"",
             "root_path": "", "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80),
             "headers": [(b"content-type", b"application/json"),
                         (b"content-length", str(len(body)).encode())]}

    async def client():
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive():
            return messages.pop(0) if messages else {"type": "http.disconnect"}

        async def send(message):
            if message["type"] == "http.response.start":
                await asyncio.Event().wait()        # held: no chunk ever goes out
        await app(scope, receive, send)
    try:
        asyncio.run(asyncio.wait_for(client(), 60))
        metrics = app.state.serving.metrics
        wait_for(lambda: 'finished_reason="abort",model_name="tiny-chat"} 1' in
                 metrics.render(online.snapshot))
        assert online.snapshot.running == online.snapshot.waiting == 0
    finally:
        online.close()
