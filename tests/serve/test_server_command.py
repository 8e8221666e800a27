"""The `serve` command in its own process: Ctrl-C drains the answers in flight (and cuts those
past the drain, below), a quantized cache and tiled attention give generate's text,
speculation streams generate's text and counts its drafts; and the server module imports
without the serve extra.

Ctrl-C (a real SIGINT to a real `serve` process) ends every open stream before the server
exits: past the drain time, a stream still running gets its finish_reason ("abort"), its
usage and [DONE], not a connection cut mid-answer; the server prints one line saying what it
drained and what it cut, never a traceback. The embedded default model answers 3,000 tokens
(ignore_eos), which no machine makes before the signal arrives."""
import json
import signal
import subprocess
import sys
import time
import types
import urllib.request

import pytest

from conftest import wait_for
from minitransformer.kernels import blas

pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
from servers import NAME, ROOT, expected, serve_command


def test_serve_command_drains_answers_in_flight_on_ctrl_c(model):
    """The real command in its own process: Ctrl-C lets a stream in flight finish."""
    process, client = serve_command(model)
    try:
        stream = iter(client.completions.create(model=NAME, prompt="The robot", max_tokens=40,
                                                stream=True, extra_body={"ignore_eos": True}))
        chunks = [next(stream)]
        process.send_signal(signal.SIGINT)      # shut down while the answer is half made
        chunks += list(stream)
        assert chunks[-1].choices[0].finish_reason == "length"
        assert process.wait(30) == 0
    finally:
        process.kill()
        process.wait()
    assert "serving 'tiny-chat'" in process.stderr.read()


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



def test_serve_command_with_a_quantized_cache_and_tiled_attention(model, monkeypatch):
    """--kv-cache-dtype q8_0 --attention tiled: the client's text is generate's with the same
    cache format and attention (batch-invariant, and both processes multiplying by the flat route:
    the same BLAS calls, bit for bit); a bad format is refused."""
    monkeypatch.setattr(blas, "FIXED", "flat")
    bad = subprocess.run([sys.executable, "-m", "minitransformer", "serve", "--model", model.path,
                          "--kv-cache-dtype", "int8"], cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode == 2 and "--kv-cache-dtype: invalid choice: 'int8'" in bad.stderr
    assert all(name in bad.stderr.splitlines()[-1] for name in ("f32", "f16", "q8_0", "q4_0"))
    process, client = serve_command(model, "--kv-cache-dtype", "q8_0", "--attention", "tiled",
                                    "--batch-invariant")
    try:
        prompt = "The cat sat on the mat."
        ids = model.tokenizer.encode(prompt)
        tokens, text, finish = expected(model, ids, 24, kv_dtype="q8_0", attention="tiled")
        reply = client.completions.create(model=NAME, prompt=prompt, max_tokens=24,
                                          temperature=0)
        assert reply.choices[0].text == text and reply.choices[0].finish_reason == finish
    finally:
        process.kill()
        process.wait()
    assert "q8_0 cache, tiled attention" in process.stderr.read()


def test_serve_command_speculating_streams_generates_text_and_counts_drafts(model, monkeypatch):
    """--speculative-config (prompt lookup) with --batch-invariant: a prompt the answer copies
    from, streamed: the text is generate's, events carry the several tokens a step verified
    (fewer events than tokens), and /metrics shows vLLM's spec_decode counters."""
    monkeypatch.setattr(blas, "FIXED", "flat")
    process, client = serve_command(model, "--batch-invariant", "--speculative-config",
                                    '{"method": "ngram", "num_speculative_tokens": 4}')
    try:
        prompt = "the cat sat on the mat. " * 4
        ids = model.tokenizer.encode(prompt)
        tokens, text, _ = expected(model, ids, 32, eos_token_id=[])
        events = [c.choices[0].text for c in client.completions.create(
            model=NAME, prompt=prompt, max_tokens=32, temperature=0, stream=True,
            extra_body={"ignore_eos": True})]
        port = client.base_url.port
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
    finally:
        process.kill()
        process.wait()
    assert "".join(events) == text and len([e for e in events if e]) < len(tokens)
    samples = dict(line.rsplit(" ", 1) for line in metrics.splitlines() if line[:1] != "#")
    label = f'{{model_name="{NAME}"}}'
    drafted = int(samples["vllm:spec_decode_num_draft_tokens_total" + label])
    accepted = int(samples["vllm:spec_decode_num_accepted_tokens_total" + label])
    assert 0 < accepted <= drafted and int(samples["vllm:spec_decode_num_drafts_total" + label])
    assert int(samples[f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{position="0",'
                       f'model_name="{NAME}"}}']) > 0


def test_the_server_module_imports_without_the_serve_extra():
    """The library imports without fastapi (doctests collect every module); the server says
    what to install when it is asked for."""
    code = ("import sys; sys.modules['fastapi'] = None\n"
            "from minitransformer.serve import http\n"
            "try:\n    http.create_app(None, 'x')\n"
            "except ImportError as e:\n    print(e)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "the server needs the serve extra: pip install -e '.[serve]'\n"
