"""A soak of the real server: many mixed requests, the server's memory after every thousand.

Starts ``python3 -m minitransformer serve`` on 127.0.0.1 (the default model unless --model
says otherwise, or with --tiny a random 2-layer model of width 64 with a trained byte-level BPE
tokenizer, written to a temporary folder: memory is what is measured, and a smaller model
sends more requests through in the time; --max-num-batched-tokens for chunked prefill,
--kv-cache-dtype q8_0 for a quantized cache) and sends --requests requests from --clients
client threads, each drawn from its own seeded generator:

    endpoint    /v1/completions, text prompts (or token ids, one in five)
    prompt      one of --prefixes shared opening texts (so the prefix cache finds blocks) and
                a few random words of its own
    stream      half streamed (Server-Sent Events), half not
    n           1 to 4 samples; temperature 0 or 0.8 with a seed
    logprobs    one in three asks for them (k 0 to 3), some with echo
    stop        one in four carries a stop string
    cancelled   one in ten: the client hangs up (a stream after its first event, a plain
                request right after sending it), which cancels the request on the server

After every --every answered requests the server's resident memory (VmRSS of its process,
from /proc) is read and printed; the table gives it per thousand requests and the slope of a
least-squares line through the points after --warmup requests, in MiB per 1,000 requests. At
the end, once nothing runs or waits, /metrics is read: the samples it counts
(vllm:request_success_total over its finish reasons) against the samples sent, the tokens
generated, and the KV cache's usage. Any answer other than 200 (a hang-up excepted), a 5xx
included, or a stream ending in an error event, stops the soak with an error.

Bounded: --requests in all, --timeout seconds per request, --max-seconds for the whole soak
(it stops early and says so). Progress goes to stderr, the table to stdout. Linux only (/proc).
"""
import argparse
import http.client
import json
import os
import signal
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: _common, _table

from _common import (
    add_engine_arguments,
    add_model_argument,
    add_server_arguments,
    load_model,
    positive_int,
    say,
)
from _table import Table
from bench_serving import NAME, engine, setting_lines, start_server

WORDS = ("once upon a time there was a little girl who lived in a village near the forest "
         "she liked to play with her dog and her red ball every day after school the sun was "
         "warm and the birds sang in the tall green trees").split()


def rss_mib(pid: int) -> float:
    """The resident memory of a process, MiB (VmRSS in /proc/PID/status)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise OSError(f"no VmRSS for process {pid}")


def make_body(rng, prefixes, vocab_size) -> tuple:
    """One request, drawn -> (its /v1/completions body, whether the client hangs up)."""
    words = " ".join(rng.choice(WORDS, size=int(rng.integers(1, 12))))
    prompt = f"{prefixes[rng.integers(len(prefixes))]} {words}"
    body = {"model": NAME, "prompt": prompt, "max_tokens": int(rng.integers(1, 17)),
            "n": int(rng.integers(1, 5)), "stream": bool(rng.random() < 0.5)}
    if rng.random() < 0.2:
        body["prompt"] = [int(i) for i in rng.integers(0, vocab_size, size=rng.integers(1, 40))]
    if rng.random() < 0.5:
        body |= {"temperature": 0.8, "seed": int(rng.integers(0, 2**31))}
    else:
        body["temperature"] = 0
    if rng.random() < 1 / 3:
        body["logprobs"] = int(rng.integers(0, 4))
        if rng.random() < 0.3 and not body["stream"]:
            body["echo"] = True
    if rng.random() < 0.25:
        body["stop"] = [str(rng.choice(WORDS))]
    return body, bool(rng.random() < 0.1)


def send(port, body, hang_up, timeout) -> int:
    """Send one request -> its HTTP status (0 when the client hung up before an answer). A
    stream is read to its end ([DONE]) unless the client hangs up after its first event."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        connection.request("POST", "/v1/completions", json.dumps(body),
                           {"Content-Type": "application/json"})
        if hang_up and not body["stream"]:
            return 0            # gone before the answer: the server cancels when it notices
        response = connection.getresponse()
        if response.status != 200 or not body["stream"]:
            response.read()
            return response.status
        for line in response:
            if line.startswith(b"data: "):
                if b'"error"' in line[:20]:
                    raise RuntimeError(f"the stream ended in an error: {line[:300]!r}")
                if hang_up:
                    return 0
        return 200
    finally:
        connection.close()


def soak(port, pid, args, prefixes, vocab_size) -> tuple:
    """Send the requests from the client threads -> ([(requests answered, RSS MiB)], answers
    by status, stopped early)."""
    lock, state = threading.Lock(), {"next": 0, "done": 0, "samples": 0, "error": None}
    statuses, points = {}, [(0, rss_mib(pid))]
    deadline = time.perf_counter() + args.max_seconds
    start = time.perf_counter()

    def client(c):
        while True:
            with lock:
                i = state["next"]
                if i >= args.requests or state["error"] or time.perf_counter() > deadline:
                    return
                state["next"] += 1
            body, hang_up = make_body(np.random.default_rng([args.seed, i]), prefixes,
                                      vocab_size)
            try:
                status = send(port, body, hang_up, args.timeout)
                if status not in (0, 200):
                    raise RuntimeError(f"HTTP {status} for {json.dumps(body)[:300]}")
            except (OSError, RuntimeError) as e:
                with lock:
                    state["error"] = state["error"] or f"request {i}: {e}"
                return
            with lock:
                statuses[status] = statuses.get(status, 0) + 1
                state["samples"] += body["n"]
                state["done"] += 1
                if state["done"] % args.every == 0:
                    points.append((state["done"], rss_mib(pid)))
                    elapsed = time.perf_counter() - start
                    say(f"[{state['done']}/{args.requests}] RSS {points[-1][1]:.1f} MiB "
                        f"({elapsed:.0f} s, about "
                        f"{elapsed / state['done'] * (args.requests - state['done']):.0f} s "
                        f"left)")
    threads = [threading.Thread(target=client, args=(c,), daemon=True)
               for c in range(args.clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if state["error"]:
        raise SystemExit(f"error: {state['error']}")
    return points, statuses, state["samples"], state["done"] < args.requests


def slope(points, warmup) -> float:
    """MiB per 1,000 requests: a least-squares line through the points after warm-up."""
    x, y = np.array([p for p in points if p[0] >= warmup]).T
    return float(np.polyfit(x / 1000, y, 1)[0]) if len(x) >= 2 else float("nan")


def scrape(port) -> dict:
    """/metrics as {sample name with its labels: value}."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith("vllm:")}
def scrape_when_idle(port, timeout=60.0) -> dict:
    """/metrics once nothing runs or waits (a client that hung up is noticed within a moment),
    or after timeout seconds."""
    end = time.perf_counter() + timeout
    while True:
        samples = scrape(port)
        busy = counted(samples, "vllm:num_requests_running{") + \
            counted(samples, "vllm:num_requests_waiting{")
        if not busy or time.perf_counter() > end:
            return samples
        time.sleep(0.2)


def counted(samples, prefix):
    """The sum of the samples whose name (with labels) starts with prefix."""
    return sum(v for k, v in samples.items() if k.startswith(prefix))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_argument(parser)
    parser.add_argument("--tiny", action="store_true",
                        help="serve a tiny random model instead of --model (see above)")
    parser.add_argument("--requests", type=positive_int, default=20000)
    parser.add_argument("--clients", type=positive_int, default=8)
    parser.add_argument("--every", type=positive_int, default=1000,
                        help="requests between two readings of the server's memory")
    parser.add_argument("--warmup", type=int, default=4000,
                        help="requests before the slope is fitted (allocator and caches warm)")
    parser.add_argument("--prefixes", type=positive_int, default=4,
                        help="shared prompt openings")
    add_engine_arguments(parser)
    parser.add_argument("--max-num-batched-tokens", type=positive_int, default=None,
                        help="the server's chunked prefill budget (default: off)")
    parser.add_argument("--kv-cache-dtype", default="f32", help="the server's KV cache format")
    add_server_arguments(parser, timeout=120)
    parser.add_argument("--max-seconds", type=float, default=3600,
                        help="the whole soak at most (it stops early and says so)")
    args = parser.parse_args(argv)
    if args.warmup < 0 or args.warmup >= args.requests:
        parser.error("--warmup must be in [0, --requests)")
    with tempfile.TemporaryDirectory() as folder:
        return soak_and_report(args, tiny_checkpoint(folder) if args.tiny else args.model)


def tiny_checkpoint(folder) -> str:
    from minitransformer.checkpoints.synth import make_checkpoint, qwen2_config, train_tokenizer
    config = qwen2_config(vocab_size=320, hidden_size=64, intermediate_size=128,
                          num_hidden_layers=2, max_position_embeddings=512)
    return str(make_checkpoint(os.path.join(folder, "tiny"), config,
                               tokenizer=train_tokenizer(300)))


def soak_and_report(args, model_path):
    model = load_model(model_path)
    prefixes = [" ".join(np.random.default_rng([args.seed, 10**9, k]).choice(WORDS, size=24))
                for k in range(args.prefixes)]
    config = engine(args, kv_cache_dtype=args.kv_cache_dtype,
                    max_num_batched_tokens=args.max_num_batched_tokens)
    server, port = start_server(args, "soak", config, model.path)
    try:
        start = time.perf_counter()
        points, statuses, samples, early = soak(port, server.pid, args, prefixes,
                                       model.config.vocab_size)
        elapsed = time.perf_counter() - start
        answered = points[-1][0] if points else 0
        samples_now = scrape_when_idle(port)
    finally:
        server.send_signal(signal.SIGINT)
        server.wait(60)
    chunks = "whole prompts" if args.max_num_batched_tokens is None else \
        f"chunked prefill ({args.max_num_batched_tokens} tokens a step)"
    table = Table("Server memory over a soak of mixed requests", chapter=False,
                  columns=[("requests", ","), ("RSS MiB", ".1f"), ("MiB per 1,000 since last",
                                                                  "+.2f")])
    table.header(*setting_lines(args, model),
                 f"{args.clients} clients, {args.kv_cache_dtype} KV cache, {chunks}, "
                 f"{args.prefixes} shared prefixes, seed {args.seed}; {elapsed:.0f} s")
    for (n0, m0), (n1, m1) in zip([(None, None)] + points[:-1], points, strict=True):
        table.row(n1, m1, (m1 - m0) / (n1 - n0) * 1000 if n0 is not None else float("nan"))
    done = sum(statuses.values())
    fitted = sum(p[0] >= args.warmup for p in points)
    table.note(f"slope after {args.warmup:,} requests: {slope(points, args.warmup):+.2f} MiB "
               f"per 1,000 requests (least squares over {fitted} readings)",
               f"answered {statuses.get(200, 0):,} with 200, {statuses.get(0, 0):,} cancelled by "
               f"the client hanging up, of {done:,} sent ({samples:,} samples)"
               + ("; STOPPED EARLY at --max-seconds" if early else ""),
               f"/metrics: {counted(samples_now, 'vllm:request_success_total{'):,.0f} samples "
               f"over (request_success_total), "
               f"{counted(samples_now, 'vllm:generation_tokens_total{'):,.0f} tokens generated, "
               f"KV cache usage {counted(samples_now, 'vllm:kv_cache_usage_perc{'):.3f} once "
               f"idle")
    table.show()
    return 1 if early or answered == 0 else 0


if __name__ == "__main__":
    from _common import run
    run(main)
