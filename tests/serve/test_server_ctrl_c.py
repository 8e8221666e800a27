"""Ctrl-C (a real SIGINT to a real `serve` process) ends every open stream before the server
exits: past the drain time, a stream still running gets its finish_reason ("abort"), its
usage and [DONE], not a connection cut mid-answer; the server prints one line saying what it
drained and what it cut, never a traceback. The embedded default model answers 3,000 tokens
(ignore_eos), which no machine makes before the signal arrives."""
import json
import signal
import time
import types
import urllib.request

import pytest

pytest.importorskip("openai")
pytest.importorskip("uvicorn")
from conftest import wait_for
from servers import serve_command

DEFAULT = types.SimpleNamespace(path="default")      # serve's --model default


def refused(url) -> bool:
    try:
        urllib.request.urlopen(url, timeout=5)
        return False
    except OSError:
        return True


@pytest.mark.parametrize("drain, twice", [("0", False), ("0.5", False), ("600", True)])
def test_ctrl_c_ends_an_open_stream_with_a_finish_reason_and_one_line(drain, twice):
    """Past the drain, or at a second Ctrl-C (sent once the server has stopped accepting, so
    the first was seen), the stream still open ends with "abort"."""
    process, client = serve_command(DEFAULT, "--drain-timeout", drain)
    try:
        body = json.dumps({"model": "tiny-chat", "prompt": "Once", "max_tokens": 3000,
                           "ignore_eos": True, "stream": True,
                           "stream_options": {"include_usage": True}}).encode()
        request = urllib.request.Request(f"{client.base_url}completions", body,
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as stream:
            first = stream.readline()
            assert first.startswith(b"data: {"), first
            process.send_signal(signal.SIGINT)
            if twice:
                wait_for(lambda: time.sleep(0.1) or refused(f"{client.base_url}models"),
                         timeout=60)
                process.send_signal(signal.SIGINT)
            events = [e.strip() for e in stream.read().decode().split("\n\n") if e.strip()]
        assert process.wait(120) == 0
        said = process.stderr.read()
    finally:
        process.kill()
        process.wait()
        process.stderr.close()
    assert events[-1] == "data: [DONE]", events[-3:]
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    reasons = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert reasons[-1] == "abort" and reasons.count("abort") == 1, chunks[-3:]
    assert chunks[-1]["usage"]["completion_tokens"] < 3000
    assert "Traceback" not in said and "Error" not in said, said
    when = "at a second Ctrl-C" if twice else "after the drain of"
    assert said.splitlines()[-1] == (f"stopped: of 1 requests in flight, 0 finished and 1 "
                                     f"were cut short {when} {float(drain):g} s "
                                     f"(finish_reason \"abort\")"), said
