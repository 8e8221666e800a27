"""Serving benchmark through real HTTP: static vs continuous batching under Poisson arrivals.

Experiment 13's comparison, measured from live traffic instead of the engine's own clock: for
each policy a real server (``python3 -m minitransformer serve``) is started on 127.0.0.1, and
requests arrive as a Poisson process at each --rates value, each one a streamed
/v1/completions call from its own client thread. The workload is the chapter's shape scaled
down (sim/workload.py: skewed output lengths with a given median, max and total; end of
sequence off, so each request makes exactly its length; random prompts of --prompt-len
tokens; greedy). Measured as vLLM's benchmark_serving measures them, per request:

    TTFT    time to first token: request sent -> first streamed event with output
    TPOT    time per output token after the first: (end-to-end - TTFT) / (tokens - 1)
    E2E     end-to-end latency: request sent -> last event ([DONE])

and per run the output throughput (tokens / wall time from first send to last answer). The
comparison table gives continuous over static for each rate, beside the chapter's figures.
Arrivals, lengths and prompts are seeded; the timings are the machine's (stated in the header).
Traffic goes to 127.0.0.1 only. Leaves out: a dataset of real prompts, goodput/SLOs.
"""
import argparse
import http.client
import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import numpy as np

from _common import (add_model_argument, add_workload_arguments, load_model, numbers,
                     positive_int, progress, say, workload_lengths)
from _table import Table
from sim.workload import make_workload

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAME = "bench"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args, policy, model_path, port):
    """A server process for one policy; returns once /health answers (or fails loudly)."""
    env = os.environ | {"OPENBLAS_NUM_THREADS": str(args.threads),
                        "OMP_NUM_THREADS": str(args.threads)}
    command = [sys.executable, "-m", "minitransformer", "serve", "--model", model_path,
               "--port", str(port), "--served-model-name", NAME, "--policy", policy,
               "--slots", str(args.slots), "--block-size", str(args.block_size),
               "--max-waiting", str(args.requests + 1)]
    server = subprocess.Popen(command, cwd=ROOT, env=env, stderr=subprocess.DEVNULL)
    for _ in range(1200):           # at most 120 s to load the model and bind
        if server.poll() is not None:
            raise SystemExit(f"error: the {policy} server exited with {server.returncode}")
        try:
            if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1).status == 200:
                return server
        except OSError:
            time.sleep(0.1)
    server.kill()
    raise SystemExit(f"error: the {policy} server did not come up in 120 s")


def one_request(port, prompt, max_tokens, timeout) -> dict:
    """Stream one completion; -> send time, first-text time, end time, tokens (from usage)."""
    body = json.dumps({"model": NAME, "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0, "stream": True, "ignore_eos": True,
                       "stream_options": {"include_usage": True}})
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    sent = time.perf_counter()
    connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    response = connection.getresponse()
    first, tokens = math.nan, 0
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}: {response.read()[:200]!r}")
    for line in response:           # SSE: "data: {...}" lines, blank lines between events
        if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
            continue
        event = json.loads(line[6:])
        if event["choices"] and math.isnan(first):  # the first event carrying output: a
            first = time.perf_counter()             # token's text (or the end, if none shows)
        if event.get("usage"):
            tokens = event["usage"]["completion_tokens"]
    connection.close()
    return {"sent": sent, "first": first, "end": time.perf_counter(), "tokens": tokens}


def run_rate(port, workload, prompts, args, label) -> list:
    """Send every request at its arrival time, each from its own thread; -> their records."""
    records, threads = [None] * len(workload), []
    start = time.perf_counter()

    def client(i, arrival):
        time.sleep(max(0.0, start + arrival.time - time.perf_counter()))
        try:
            records[i] = one_request(port, prompts[i], arrival.output_len, args.timeout)
        except (OSError, RuntimeError) as e:
            records[i] = {"error": str(e)}
    for i, arrival in enumerate(workload):
        threads.append(threading.Thread(target=client, args=(i, arrival), daemon=True))
        threads[-1].start()
    for i, thread in enumerate(threads, start=1):
        thread.join(args.timeout)
        if i % max(1, len(threads) // 4) == 0 or i == len(threads):
            progress(i, len(threads), f"{label}: answered ({time.perf_counter() - start:.1f} s)")
    failed = [r for r in records if r is None or "error" in r]
    if failed:
        raise SystemExit(f"error: {len(failed)} requests failed, e.g. {failed[0]}")
    return records


def summary(records) -> dict:
    """vLLM benchmark_serving's figures over one run (times in seconds)."""
    ttft = np.array([r["first"] - r["sent"] for r in records])
    e2e = np.array([r["end"] - r["sent"] for r in records])
    tpot = np.array([(r["end"] - r["first"]) / (r["tokens"] - 1) for r in records
                     if r["tokens"] > 1])
    tokens = sum(r["tokens"] for r in records)
    span = max(r["end"] for r in records) - min(r["sent"] for r in records)
    return {"tokens": tokens, "span": span, "throughput": tokens / span,
            **{f"{name}_{stat}": float(f(values)) if len(values) else math.nan
               for name, values in (("ttft", ttft), ("tpot", tpot), ("e2e", e2e))
               for stat, f in (("mean", np.mean), ("p50", np.median),
                               ("p99", lambda v: np.percentile(v, 99)))}}


def served_tokens(port) -> int:
    """vllm:generation_tokens_total as the server counted it."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return next(int(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                if line.startswith("vllm:generation_tokens_total{"))


def rates(text):
    values = numbers(text)
    if not all(v > 0 for v in values):
        raise argparse.ArgumentTypeError("every rate must be > 0 requests/s")
    return values


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_argument(parser)
    parser.add_argument("--rates", type=rates, default=[1.0, 4.0, math.inf],
                        help="Poisson arrival rates, requests/s (inf: all at once)")
    add_workload_arguments(parser, requests=32, median=12, max_len=96, total=700)
    parser.add_argument("--prompt-len", type=positive_int, default=16, help="tokens per prompt")
    parser.add_argument("--slots", type=positive_int, default=8)
    parser.add_argument("--block-size", type=positive_int, default=16)
    parser.add_argument("--threads", type=positive_int, default=1,
                        help="BLAS threads of the servers")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600, help="seconds per request")
    args = parser.parse_args(argv)
    try:
        lengths = workload_lengths(args)
    except ValueError as e:
        parser.error(str(e))
    model = load_model(args.model)
    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(0, model.config.vocab_size, args.prompt_len).tolist()
               for _ in lengths]

    results = {}
    for policy in ("static", "continuous"):
        port = free_port()
        say(f"starting the {policy} server on 127.0.0.1:{port}")
        server = start_server(args, policy, model.path, port)
        try:
            one_request(port, prompts[0], 2, args.timeout)  # warm-up: first-call costs
            sent = 2
            for rate in args.rates:
                workload = make_workload(lengths, rate, seed=args.seed)
                records = run_rate(port, workload, prompts, args, f"{policy} at {rate:g} req/s")
                results[policy, rate] = summary(records)
                sent += results[policy, rate]["tokens"]
            counted = served_tokens(port)
            if counted != sent:
                raise SystemExit(f"error: the {policy} server counted {counted} tokens, "
                                 f"the clients received {sent}")
        finally:
            server.send_signal(signal.SIGINT)
            server.wait(30)

    ms = lambda v: f"{1000 * v:.0f}"  # noqa: E731
    table = Table("Serving through HTTP: static vs continuous batching, Poisson arrivals",
                  experiment=13,
                  differs="live HTTP traffic on this machine (client, server, tokenizer and "
                          "SSE costs included), a smaller workload (--requests, --total): the "
                          "ratios, not the seconds, carry over",
                  columns=[("policy", ""), ("req/s", "g"), ("tok/s", ".1f"),
                           ("TTFT mean ms", ms), ("TTFT p99 ms", ms), ("TPOT mean ms", ms),
                           ("TPOT p99 ms", ms), ("E2E mean s", ".2f"), ("E2E p50 s", ".2f"),
                           ("E2E p99 s", ".2f")])
    table.header(f"{args.requests} requests per rate, output tokens median {np.median(lengths):g}"
                 f", max {max(lengths)}, total {sum(lengths):,}; prompts of {args.prompt_len} "
                 f"tokens; {args.slots} slots; greedy; each a streamed /v1/completions call",
                 f"model {model.path}; servers with {args.threads} BLAS thread(s); times are "
                 f"wall-clock on this machine, client and servers sharing its cores")
    for (policy, rate), s in results.items():
        table.row(policy, rate, s["throughput"], s["ttft_mean"], s["ttft_p99"], s["tpot_mean"],
                  s["tpot_p99"], s["e2e_mean"], s["e2e_p50"], s["e2e_p99"])
    for rate in args.rates:
        st, co = results["static", rate], results["continuous", rate]
        table.note(f"at {rate:g} req/s continuous vs static: throughput "
                   f"{co['throughput'] / st['throughput']:.2f}x, mean E2E latency "
                   f"{st['e2e_mean'] / co['e2e_mean']:.1f}x better, p99 "
                   f"{st['e2e_p99'] / co['e2e_p99']:.1f}x better, mean TTFT "
                   f"{st['ttft_mean'] / co['ttft_mean']:.1f}x better")
    table.show()
    return 0


if __name__ == "__main__":
    from _common import run
    run(main)
