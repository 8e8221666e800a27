"""Serving benchmark through real HTTP: four workloads, each with a feature on and off.

Every workload starts real servers (``python3 -m minitransformer serve``) on 127.0.0.1, one per
setting compared, both up at once and used in turn (rounds alternate, so a change in the
machine's load falls on both), and measures what clients see, as vLLM's benchmark_serving
measures it, per request:

    TTFT    time to first token: request sent -> first streamed event with output text
    TPOT    time per output token after the first: (end-to-end - TTFT) / (tokens - 1)
    E2E     end-to-end latency: request sent -> last event ([DONE])
    gap     time between two consecutive streamed events with output text

    poisson      experiment 13's comparison, static vs continuous batching: requests arrive as
                 a Poisson process at each --rates value, each a streamed /v1/completions call
                 from its own client thread; the workload is the chapter's shape scaled down
                 (sim/workload.py: skewed output lengths; end of sequence off; random prompts
                 of --prompt-len tokens; greedy). Per run, the output throughput too.
    chat         prefix caching on and off: --conversations chats of --turns turns through
                 /v1/chat/completions (greedy), each turn sending the whole history, which
                 grows to about 600 tokens on SmolLM2 (a system message holding a document,
                 short questions, the answers). With caching a turn finds the history's full
                 blocks cached and prefills only what is new. Each conversation opens with its
                 own number, so one never finds another's blocks.
    long-prompt  chunked prefill on and off: --streams requests are decoding when a prompt of
                 --long-prompt tokens arrives; with whole-prompt prefill every stream stops for
                 the whole of it, with chunked prefill (--max-num-batched-tokens) they keep
                 flowing. The streams' largest gap and the long request's own TTFT.
    streams      the batched step before and after: --concurrency values of streams at once
                 (each a prompt of --prompt-len random text tokens, --stream-tokens greedy
                 tokens), aggregate output tokens/s, on a server whose weights keep the
                 checkpoint's row-major layout (MT_LAYOUT=row-major: the engine before
                 kernels/blas.arrange) and one that lays each out as its products run fastest
                 here (the default), --rounds rounds alternating between them; slots enough for
                 the most streams. --markdown FILE writes its table (docs/benchmarks/).
    threads      one server at --threads 1 and one at --threads N (--side-threads, default the
                 cores this process may use), up together, --rounds rounds alternating: a
                 single stream's time per output token and the aggregate output tokens/s of
                 --thread-streams streams at once (default 8, 16), best and median; then each
                 idle server's CPU over 2 s (the pool's workers must block, not spin). Targets:
                 a single stream at N threads <= 0.6x its time per token at 1 (or near the read
                 floor: bench_decode.py's threads table measures it), 8 and 16 streams >= 1.8x
                 the tokens/s. Not in the default --workloads (ask for it by name).

Prompts, arrivals and lengths are seeded; the timings are the machine's (stated in the header
with its load). Traffic goes to 127.0.0.1 only. Leaves out: a dataset of real prompts,
goodput/SLOs.
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
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: _common, _table

from _common import (
    Progress,
    add_engine_arguments,
    add_model_argument,
    add_server_arguments,
    add_workload_arguments,
    load_model,
    model_name,
    numbers,
    positive_int,
    progress,
    say,
    workload_lengths,
)
from _table import Table
from bench_decode import write_markdown

from minitransformer.__main__ import engine_flags
from minitransformer.serve.config import EngineConfig
from sim.workload import make_workload

ROOT = Path(__file__).resolve().parents[2]
NAME = "bench"
WORKLOADS = ("poisson", "chat", "long-prompt", "streams", "threads")
DEFAULT_WORKLOADS = WORKLOADS[:4]
ONE_STREAM_TARGET, STREAMS_TARGET = 0.6, 1.8   # N threads against 1: time per token, tok/s
# the streams' two servers: "after" measures layouts even where the caller's MT_LAYOUT is set
LAYOUTS = {"before": {"MT_LAYOUT": "row-major"}, "after": {"MT_LAYOUT": ""}}
# The chat's system message: a document the questions are about (written for this benchmark).
DOCUMENT = (
    "You answer questions about the following note on a small lending library. The library "
    "of the village of Ashford Mill opened in 1923 in two rooms above the bakery, with four "
    "hundred books given by the families of the valley. Its first librarian, Ruth Callow, "
    "kept the loans in a ledger bound in green cloth, one line per book, and she wrote the "
    "date of return in red ink so that late books could be seen from across the room. In "
    "1951 the library moved into the old school house by the river, where it still stands. "
    "The move took three days and was done by the pupils of the new school, who carried the "
    "books in baskets along the towpath. The collection grew to six thousand volumes by 1970, "
    "most of them novels, local histories and books on farming, bee keeping and the care of "
    "horses. A reading room with a stove was added in 1964, paid for by a summer fair that "
    "the village still holds on the first Saturday of July. The library lends books for "
    "three weeks, and a loan may be renewed twice, by letter or in person. Children may "
    "borrow five books at a time and adults eight. The ledger was replaced by a card index "
    "in 1958 and by a computer in 1994, but the green ledger is kept in a glass case by the "
    "door, open at the page of the first loan: a book on the weather, returned four days "
    "late. Today the library is run by volunteers, opens on Tuesday, Thursday and Saturday "
    "mornings, and holds a story hour for young children every Saturday at ten. Its "
    "greatest treasure is a hand drawn map of the valley from 1802, which shows the mill, "
    "the ford and the path over the hill that the drovers used. Answer briefly and only "
    "from the note.")
QUESTIONS = ("When did the library open, and where?",
             "Who carried the books when the library moved?",
             "How many books may a child borrow?",
             "What is kept in the glass case by the door?")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine(args, **changes) -> EngineConfig:
    """The servers' engine: --slots and --block-size, with what a workload compares changed."""
    return EngineConfig(max_num_seqs=args.slots, block_size=args.block_size, **changes)


def start_server(args, label, config, model_path, env=None):
    """A server process with this engine config (and these environment variables besides)
    -> (process, port), once /health answers (or fails loudly)."""
    port = free_port()
    say(f"starting the {label} server on 127.0.0.1:{port}")
    env = os.environ | {"OPENBLAS_NUM_THREADS": str(args.threads),
                        "OMP_NUM_THREADS": str(args.threads),
                        "MT_THREADS": str(args.threads)} | (env or {})
    command = [sys.executable, "-m", "minitransformer", "serve", "--model", model_path,
               "--port", str(port), "--served-model-name", NAME,
               "--max-waiting", str(args.requests + 1), *engine_flags(config)]
    server = subprocess.Popen(command, cwd=ROOT, env=env, stderr=subprocess.DEVNULL)
    for _ in range(1200):           # at most 120 s to load the model and bind
        if server.poll() is not None:
            raise SystemExit(f"error: the {label} server exited with {server.returncode}")
        try:
            if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1).status == 200:
                return server, port
        except OSError:
            time.sleep(0.1)
    server.kill()
    raise SystemExit(f"error: the {label} server did not come up in 120 s")


class Servers:
    """The servers compared, by label, up together; stopped (Ctrl-C, as a person would) on
    leaving the with block."""

    last = None                  # the servers of the latest with block (for their processes)

    def __init__(self, args, model_path, settings, envs=None):
        self.running = {}
        Servers.last = self
        try:
            for label, config in settings.items():
                self.running[label] = start_server(args, label, config, model_path,
                                                   (envs or {}).get(label))
        except BaseException:
            self.__exit__()
            raise

    def __enter__(self):
        return {label: port for label, (_, port) in self.running.items()}

    def __exit__(self, *_):
        for server, _ in self.running.values():
            server.send_signal(signal.SIGINT)
        for server, _ in self.running.values():
            server.wait(30)


def one_request(port, body, timeout, on_text=None) -> dict:
    """Stream one request (a /v1/completions body, or /v1/chat/completions if it has messages)
    -> send time, the time of every event with output text, end time, tokens (from usage),
    the text. on_text(record), if given, is called at each such event."""
    chat = "messages" in body
    body = json.dumps(body | {"model": NAME, "stream": True,
                              "stream_options": {"include_usage": True}})
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    record = {"sent": time.perf_counter(), "events": [], "tokens": 0, "text": "",
              "prompt_tokens": 0}
    connection.request("POST", "/v1/chat/completions" if chat else "/v1/completions", body,
                       {"Content-Type": "application/json"})
    response = connection.getresponse()
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}: {response.read()[:200]!r}")
    for line in response:           # SSE: "data: {...}" lines, blank lines between events
        if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
            continue
        event = json.loads(line[6:])
        if "error" in event:
            raise RuntimeError(f"the stream ended in an error: {event['error']}")
        for c in event["choices"]:
            piece = (c["delta"].get("content") or "") if chat else c["text"]
            if piece or (c["finish_reason"] and not record["events"]):   # (or the end, if
                record["events"].append(time.perf_counter())              # no text shows)
                record["text"] += piece
                if on_text:
                    on_text(record)
        if event.get("usage"):
            record["tokens"] = event["usage"]["completion_tokens"]
            record["prompt_tokens"] = event["usage"]["prompt_tokens"]
    connection.close()
    record["end"] = time.perf_counter()
    record["first"] = record["events"][0] if record["events"] else math.nan
    return record


def run_rate(port, workload, prompts, args, label) -> list:
    """Send every request at its arrival time, each from its own thread; -> their records."""
    records, threads = [None] * len(workload), []
    start = time.perf_counter()

    def client(i, arrival):
        time.sleep(max(0.0, start + arrival.time - time.perf_counter()))
        body = {"prompt": prompts[i], "max_tokens": arrival.output_len, "temperature": 0,
                "ignore_eos": True}
        try:
            records[i] = one_request(port, body, args.timeout)
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


def counters(port) -> dict:
    """The server's own counters from /metrics: name -> value (without labels)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {line.split("{", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith("vllm:") and line.split("{", 1)[0].endswith("_total")}


def setting_lines(args, model) -> list:
    from threadpoolctl import threadpool_info

    from minitransformer.measure.timing import machine
    kernels = sorted({str(p.get("architecture")) for p in threadpool_info()
                      if p["user_api"] == "blas"}) or ["?"]
    return [f"model {model_name(model)}; servers with --threads {args.threads}, {args.slots} "
            f"slots, blocks of {args.block_size}; {machine()}; BLAS kernel "
            f"{', '.join(kernels)}; times are wall-clock, client and servers sharing the cores"]


def ms(v):
    return f"{1000 * v:.0f}"


PERCENTILE_COLUMNS = [("TTFT mean ms", ms), ("TTFT p50 ms", ms), ("TTFT p99 ms", ms),
                      ("TPOT mean ms", ms), ("TPOT p99 ms", ms), ("E2E mean s", ".2f"),
                      ("E2E p99 s", ".2f")]


def percentiles(s) -> list:
    return [s["ttft_mean"], s["ttft_p50"], s["ttft_p99"], s["tpot_mean"], s["tpot_p99"],
            s["e2e_mean"], s["e2e_p99"]]


# --- the three workloads ----------------------------------------------------------------------
def poisson(args, model) -> list:
    """Static vs continuous batching under Poisson arrivals (experiment 13)."""
    lengths = workload_lengths(args)
    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(0, model.config.vocab_size, args.prompt_len).tolist()
               for _ in lengths]
    results = {}
    settings = {policy: engine(args, policy=policy) for policy in ("static", "continuous")}
    with Servers(args, model.path, settings) as ports:
        for policy, port in ports.items():
            one_request(port, {"prompt": prompts[0], "max_tokens": 2, "ignore_eos": True},
                        args.timeout)                   # warm: exactly 2 tokens, counted below
            sent = 2
            for rate in args.rates:
                workload = make_workload(lengths, rate, seed=args.seed)
                records = run_rate(port, workload, prompts, args, f"{policy} at {rate:g} req/s")
                results[policy, rate] = summary(records)
                sent += results[policy, rate]["tokens"]
            counted = counters(port)["vllm:generation_tokens_total"]
            if counted != sent:
                raise SystemExit(f"error: the {policy} server counted {counted:.0f} tokens, "
                                 f"the clients received {sent}")

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
                 f"tokens; greedy; each a streamed /v1/completions call",
                 *setting_lines(args, model))
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
    return [table.show()]


def chat(args, model) -> list:
    """Multi-turn chats with prefix caching off and on, the same conversations, greedy."""
    document = " ".join(DOCUMENT.split()[:args.document_words])
    settings = {"caching off": engine(args, enable_prefix_caching=False),
                "caching on": engine(args, enable_prefix_caching=True)}
    turns = {label: [] for label in settings}         # label -> [[record per turn] per chat]
    progress_line = Progress(args.conversations * len(settings), "chat")
    with Servers(args, model.path, settings) as ports:
        for port in ports.values():                   # warm-up: first-call costs, no caching
            one_request(port, {"prompt": [1, 2, 3], "max_tokens": 2}, args.timeout)
        for c in range(args.conversations):
            for label, port in ports.items():          # the same chat on each, in turn
                messages = [{"role": "system", "content": f"Conversation {c + 1}. {document}"}]
                records = []
                for t in range(args.turns):
                    messages.append({"role": "user", "content": QUESTIONS[t % len(QUESTIONS)]})
                    record = one_request(port, {"messages": messages, "temperature": 0,
                                                "max_tokens": args.answer_tokens}, args.timeout)
                    messages.append({"role": "assistant", "content": record["text"]})
                    records.append(record)
                turns[label].append(records)
                progress_line(f"{label}, conversation {c + 1}: TTFT per turn "
                              + ", ".join(f"{r['first'] - r['sent']:.2f}" for r in records)
                              + " s")
        hits = counters(ports["caching on"])

    table = Table("Prefix caching: a multi-turn chat through HTTP, time to first token per turn",
                  experiment=13, chapter=False,
                  columns=[("turn", "d"), ("prompt tokens", "d"), ("off min ms", ms),
                           ("off median ms", ms), ("on min ms", ms), ("on median ms", ms),
                           ("off / on", ".1f")])
    table.header(f"{args.conversations} conversations of {args.turns} turns, each turn the "
                 f"whole history through /v1/chat/completions (streamed, greedy, answers of at "
                 f"most {args.answer_tokens} tokens); the same conversations on a server with "
                 f"prefix caching off and one with it on, alternating", *setting_lines(args, model))
    ratios = []
    for t in range(args.turns):
        off = [chat_[t]["first"] - chat_[t]["sent"] for chat_ in turns["caching off"]]
        on = [chat_[t]["first"] - chat_[t]["sent"] for chat_ in turns["caching on"]]
        prompt = int(np.median([chat_[t]["prompt_tokens"] for chat_ in turns["caching on"]]))
        ratio = np.median(off) / np.median(on)
        ratios += [ratio] if t else []
        table.row(t + 1, prompt, min(off), np.median(off), min(on), np.median(on), ratio)
    same = sum(a["text"] == b["text"]
               for x, y in zip(turns["caching off"], turns["caching on"], strict=True)
               for a, b in zip(x, y, strict=True))
    queries = hits.get("vllm:prefix_cache_queries_total", 0)
    rate = hits.get("vllm:prefix_cache_hits_total", 0) / queries if queries else math.nan
    if ratios:
        table.note(f"turns 2-{args.turns}: time to first token {min(ratios):.1f}x to "
                   f"{max(ratios):.1f}x lower with prefix caching (median over the "
                   f"conversations; target: at least 3x)")
    table.note(f"answers identical with caching on and off: {same} of "
               f"{args.conversations * args.turns}; the caching server's prefix cache hit "
               f"rate: {rate:.0%} of {queries:,.0f} prompt tokens (vllm:prefix_cache_*)")
    requests = {label: summary([r for chat_ in turns[label] for r in chat_])
                for label in settings}
    return [table.show(), percentile_table("Prefix caching: the chat requests' percentiles",
                                           "caching", requests)]


def long_prompt(args, model) -> list:
    """Streams decoding when a long prompt arrives: whole-prompt prefill against chunked."""
    settings = {"whole prefill": engine(args),
                "chunked prefill": engine(args, max_num_batched_tokens=args.max_num_batched_tokens)}
    rounds = {label: [] for label in settings}
    rng, ids = np.random.default_rng(args.seed), text_ids(model)
    progress_line = Progress(args.rounds * len(settings), "long prompt")
    with Servers(args, model.path, settings) as ports:
        for port in ports.values():
            one_request(port, {"prompt": [1, 2, 3], "max_tokens": 2}, args.timeout)
        for r in range(args.rounds):
            short = [rng.choice(ids, args.prompt_len).tolist() for _ in range(args.streams)]
            long = rng.choice(ids, args.long_prompt).tolist()
            for label, port in ports.items():
                rounds[label].append(arrival_among_streams(port, short, long, args))
                streams, long_record = rounds[label][-1]
                progress_line(f"{label}, round {r + 1}: largest gap "
                              f"{largest_gap(streams):.2f} s, long TTFT "
                              f"{long_record['first'] - long_record['sent']:.2f} s")

    table = Table(f"Chunked prefill: {args.streams} streams decoding when a "
                  f"{args.long_prompt:,}-token prompt arrives", experiment=13, chapter=False,
                  columns=[("prefill", ""), ("largest gap min s", ".2f"),
                           ("largest gap median s", ".2f"), ("gap p50 ms", ms),
                           ("gap p99 ms", ms), ("long TTFT min s", ".2f"),
                           ("long TTFT median s", ".2f")])
    table.header(f"{args.rounds} rounds; each: {args.streams} streamed /v1/completions calls "
                 f"(prompts of {args.prompt_len} tokens, {args.stream_tokens} tokens each, "
                 f"greedy) and, once each has streamed {args.wait_tokens} pieces, one of "
                 f"{args.long_prompt:,} random text tokens; chunked prefill: at most "
                 f"{args.max_num_batched_tokens} tokens a step (--max-num-batched-tokens)",
                 *setting_lines(args, model))
    figures = {}
    for label, runs in rounds.items():
        worst = [largest_gap(streams) for streams, _ in runs]
        gaps = np.concatenate([np.diff(s["events"]) for streams, _ in runs for s in streams])
        ttft = [long_record["first"] - long_record["sent"] for _, long_record in runs]
        figures[label] = np.median(worst), np.median(ttft)
        table.row(label, min(worst), np.median(worst), np.percentile(gaps, 50),
                  np.percentile(gaps, 99), min(ttft), np.median(ttft))
    (gap_off, ttft_off), (gap_on, ttft_on) = figures["whole prefill"], figures["chunked prefill"]
    table.note(f"chunked prefill: the streams' largest gap {gap_off / gap_on:.1f}x smaller "
               f"(target: at least 3x); the long request's own time to first token "
               f"{ttft_on / ttft_off:.2f}x that of whole-prompt prefill (target: at most 1.5x); "
               f"medians over the rounds")
    streamed = {label: summary([s for streams, _ in runs for s in streams])
                for label, runs in rounds.items()}
    return [table.show(), percentile_table("Chunked prefill: the streams' percentiles",
                                           "prefill", streamed)]


def streams(args, model) -> list:
    """Aggregate output tokens/s at each --concurrency, the engine before and after."""
    slots = max(args.concurrency)
    settings = {label: EngineConfig(max_num_seqs=slots, block_size=args.block_size)
                for label in LAYOUTS}
    rng, ids = np.random.default_rng(args.seed), text_ids(model)
    rates = {(label, n): [] for label in LAYOUTS for n in args.concurrency}
    load = os.getloadavg()[0]
    progress_line = Progress(args.rounds * len(rates), "streams")
    with Servers(args, model.path, settings, LAYOUTS) as ports:
        for port in ports.values():
            one_request(port, {"prompt": [1, 2, 3], "max_tokens": 2}, args.timeout)
        for r in range(args.rounds):
            for n in args.concurrency:
                prompts = [rng.choice(ids, args.prompt_len).tolist() for _ in range(n)]
                for label, port in ports.items():
                    rates[label, n].append(at_once(port, prompts, args)["throughput"])
                    progress_line(f"{label}, {n} streams, round {r + 1}: "
                                  f"{rates[label, n][-1]:.1f} tok/s")
    table = Table("Batched steps: aggregate output tokens/s by concurrent streams, before and "
                  "after", experiment=13, chapter=False,
                  columns=[("streams", ""), ("before tok/s best", ".1f"),
                           ("before median", ".1f"), ("after tok/s best", ".1f"),
                           ("after median", ".1f"), ("after / before best", ".2f"),
                           ("after / before median", ".2f")])
    table.header(f"{args.rounds} rounds alternating between the two servers; each round: n "
                 f"streamed /v1/completions calls at once, prompts of {args.prompt_len} random "
                 f"text tokens, {args.stream_tokens} greedy tokens each (end of sequence "
                 f"ignored); tok/s: all the streams' output tokens over the span from the first "
                 f"sent to the last done",
                 "before: every weight in the checkpoint's row-major layout (MT_LAYOUT=row-major)"
                 "; after: each laid out as its products run fastest here (kernels/blas.arrange)"
                 f"; both {slots} slots",
                 *setting_lines(argparse.Namespace(**vars(args) | {"slots": slots}), model),
                 f"load average {load:.1f} before the servers started, "
                 f"{os.getloadavg()[0]:.1f} at the end")
    for n in args.concurrency:
        before, after = rates["before", n], rates["after", n]
        table.row(n, max(before), np.median(before), max(after), np.median(after),
                  max(after) / max(before), np.median(after) / np.median(before))
    return [table.show()]


def threads_workload(args, model) -> list:
    """A single stream's time per token and --thread-streams streams' tokens/s, on a server at
    1 thread and one at N, rounds alternating; each idle server's CPU after."""
    from minitransformer.kernels.threads import default_count
    N = args.side_threads or default_count()
    slots = max(args.thread_streams)
    counts = dict.fromkeys(("1 thread", f"{N} threads"))
    envs = {label: {name: str(n) for name in ("MT_THREADS", "OPENBLAS_NUM_THREADS",
                                              "OMP_NUM_THREADS")}
            for label, n in zip(counts, (1, N), strict=True)}
    settings = {label: EngineConfig(max_num_seqs=slots, block_size=args.block_size)
                for label in counts}
    rng, ids = np.random.default_rng(args.seed), text_ids(model)
    concurrency = [1, *args.thread_streams]
    found = {(label, n): [] for label in counts for n in concurrency}   # tok/s; 1: s per token
    load = os.getloadavg()[0]
    progress_line = Progress(args.rounds * len(found), "threads")
    with Servers(args, model.path, settings, envs) as ports:
        for port in ports.values():
            one_request(port, {"prompt": [1, 2, 3], "max_tokens": 2}, args.timeout)
        for r in range(args.rounds):
            for n in concurrency:
                prompts = [rng.choice(ids, args.prompt_len).tolist() for _ in range(n)]
                for label, port in ports.items():
                    done = at_once(port, prompts, args)
                    found[label, n].append(done["tpot_mean"] if n == 1 else done["throughput"])
                    progress_line(f"{label}, {n} stream{'s' if n > 1 else ''}, round {r + 1}")
        idle = {label: idle_cpu(server) for label, (server, _) in Servers.last.running.items()}
    one, many = counts
    table = Table(f"Threads: a server at 1 and at {N} threads, side by side", experiment=13,
                  chapter=False,
                  columns=[("streams", ""), ("figure", ""), ("1 thread best", ".1f"),
                           ("median", ".1f"), (f"{N} threads best", ".1f"), ("median", ".1f"),
                           (f"{N} / 1 best", ".2f"), ("median / median", ".2f"),
                           ("target", ""), ("met", "")])
    table.header(f"{args.rounds} rounds alternating between the two servers; each round: n "
                 f"streamed /v1/completions calls at once, prompts of {args.prompt_len} random "
                 f"text tokens, {args.stream_tokens} greedy tokens each (end of sequence "
                 "ignored); 1 stream: its time per output token after the first (TPOT); "
                 "more: all the streams' output tokens over the span from the first sent to "
                 "the last done",
                 f"servers with --threads 1 and --threads {N} (MT_THREADS and BLAS's own "
                 f"threads alike), {slots} slots, blocks of {args.block_size}",
                 *setting_lines(argparse.Namespace(**vars(args) | {"slots": slots,
                                                                   "threads": f"1 and {N}"}),
                                model)[:1],
                 f"load average {load:.1f} before the servers started, "
                 f"{os.getloadavg()[0]:.1f} at the end")
    for n in concurrency:
        a, b = found[one, n], found[many, n]
        if n == 1:
            a, b = [1e3 * t for t in a], [1e3 * t for t in b]
            ratio, med = min(b) / min(a), np.median(b) / np.median(a)
            table.row(n, "ms per token", min(a), np.median(a), min(b), np.median(b), ratio,
                      med, f"<= {ONE_STREAM_TARGET}x", "yes" if ratio <= ONE_STREAM_TARGET
                      else "no")
        else:
            ratio, med = max(b) / max(a), np.median(b) / np.median(a)
            table.row(n, "tokens/s", max(a), np.median(a), max(b), np.median(b), ratio, med,
                      f">= {STREAMS_TARGET}x", "yes" if ratio >= STREAMS_TARGET else "no")
    table.note("idle: " + ", ".join(f"the {label} server {cpu:.1%} of a core over 2 s"
                                    for label, cpu in idle.items()),
               "a step's products split across the threads only where the server measured "
               "them faster (kernels/blas.py: parts): a ratio near 1 is the measured choice of "
               "one thread")
    return [table.show()]


def idle_cpu(server, seconds=2.0) -> float:
    """A server process's CPU time over `seconds` of no requests, as a share of one core
    (Linux's /proc; NaN elsewhere)."""
    def cpu():
        fields = Path(f"/proc/{server.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime
    try:
        before = cpu()
        time.sleep(seconds)
        return (cpu() - before) / seconds
    except OSError:
        return float("nan")


def at_once(port, prompts, args) -> dict:
    """Every prompt sent at once, each from its own thread -> summary of their records."""
    records = [None] * len(prompts)

    def client(i):
        try:
            records[i] = one_request(port, {"prompt": prompts[i], "temperature": 0,
                                            "max_tokens": args.stream_tokens,
                                            "ignore_eos": True}, args.timeout)
        except (OSError, RuntimeError) as e:
            records[i] = {"error": str(e)}
    threads = [threading.Thread(target=client, args=(i,), daemon=True)
               for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(args.timeout)
    failed = [r for r in records if r is None or "error" in r]
    if failed:
        raise SystemExit(f"error: {len(failed)} streams failed, e.g. {failed[0]}")
    return summary(records)


def text_ids(model):
    """Token ids that decode on their own to printable ASCII: random prompts of these read as
    (nonsense) text, and the streams' answers come out as text a piece per token (a prompt of
    any ids can lead a model to bytes of an unfinished character, held back until complete,
    which would hide the gaps measured)."""
    tokenizer = model.tokenizer
    if tokenizer is None:
        raise ValueError(f"{model.path}: the long-prompt workload needs a tokenizer")
    texts = [tokenizer.decode([i]) for i in range(model.config.vocab_size)]
    return np.array([i for i, t in enumerate(texts) if t and t.isascii() and t.isprintable()])


def arrival_among_streams(port, short, long, args) -> tuple:
    """Start the streams; once each has streamed wait_tokens pieces, send the long prompt
    -> (the streams' records, the long request's record)."""
    records, started = [None] * len(short), threading.Semaphore(0)

    def stream(i):
        def on_text(record):
            if len(record["events"]) == args.wait_tokens:
                started.release()
        try:
            records[i] = one_request(port, {"prompt": short[i], "max_tokens": args.stream_tokens,
                                            "temperature": 0, "ignore_eos": True},
                                     args.timeout, on_text)
        except (OSError, RuntimeError) as e:
            records[i] = {"error": str(e)}
        if len(records[i].get("events", ())) < args.wait_tokens:
            started.release()       # over before it got there: the check below says so
    threads = [threading.Thread(target=stream, args=(i,), daemon=True)
               for i in range(len(short))]
    for thread in threads:
        thread.start()
    for _ in threads:
        started.acquire(timeout=args.timeout)
    long_record = one_request(port, {"prompt": long, "max_tokens": 4, "temperature": 0,
                                     "ignore_eos": True}, args.timeout)
    for thread in threads:
        thread.join(args.timeout)
    failed = [r for r in records if r is None or "error" in r]
    if failed:
        raise SystemExit(f"error: {len(failed)} streams failed, e.g. {failed[0]}")
    if any(r["events"][-1] < long_record["first"] for r in records):
        raise SystemExit("error: a stream ended before the long prompt's first token: give "
                         "--stream-tokens more")
    return records, long_record


def largest_gap(streams) -> float:
    """The longest wait between two pieces of text of any stream (seconds)."""
    return max(float(np.diff(s["events"]).max()) for s in streams)


def percentile_table(title, what, summaries) -> Table:
    table = Table(title, experiment=13, chapter=False,
                  columns=[(what, ""), ("tok/s", ".1f"), *PERCENTILE_COLUMNS])
    for label, s in summaries.items():
        table.row(label, s["throughput"], *percentiles(s))
    return table.show()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_argument(parser)
    parser.add_argument("--workloads", type=workloads, default=list(DEFAULT_WORKLOADS),
                        help=f"comma-separated, of {', '.join(WORKLOADS)} (default: "
                             f"{', '.join(DEFAULT_WORKLOADS)})")
    add_engine_arguments(parser)
    add_server_arguments(parser, timeout=600)
    group = parser.add_argument_group("poisson: static vs continuous batching")
    group.add_argument("--rates", type=rates, default=[1.0, 4.0, math.inf],
                       help="Poisson arrival rates, requests/s (inf: all at once)")
    group.add_argument("--prompt-len", type=positive_int, default=16,
                       help="tokens per prompt (also the streams' of long-prompt)")
    add_workload_arguments(parser, requests=32, median=12, max_len=96, total=700)
    group = parser.add_argument_group("chat: prefix caching off vs on")
    group.add_argument("--conversations", type=positive_int, default=3)
    group.add_argument("--turns", type=positive_int, default=4)
    group.add_argument("--answer-tokens", type=positive_int, default=64,
                       help="max_tokens of each answer")
    group.add_argument("--document-words", type=positive_int, default=len(DOCUMENT.split()),
                       help="words of the system message's document (default: all of it)")
    group = parser.add_argument_group("long-prompt: whole vs chunked prefill")
    group.add_argument("--rounds", type=positive_int, default=3)
    group.add_argument("--streams", type=positive_int, default=4)
    group.add_argument("--stream-tokens", type=positive_int, default=64,
                       help="tokens each stream makes")
    group.add_argument("--wait-tokens", type=positive_int, default=4,
                       help="pieces each stream has streamed when the long prompt is sent")
    group.add_argument("--long-prompt", type=positive_int, default=1500, help="its tokens")
    group.add_argument("--max-num-batched-tokens", type=positive_int, default=256,
                       help="the chunked server's token budget per step")
    group = parser.add_argument_group("streams: the batched step before and after (also "
                                      "--rounds, --prompt-len, --stream-tokens)")
    group.add_argument("--concurrency", type=counts, default=[1, 4, 8, 16],
                       help="streams at once, comma-separated (default: 1,4,8,16)")
    group = parser.add_argument_group("threads: a server at 1 and at N threads (also "
                                      "--rounds, --prompt-len, --stream-tokens)")
    group.add_argument("--side-threads", type=positive_int, default=None, metavar="N",
                       help="N, the second server's threads (default: the cores this process "
                            "may use)")
    group.add_argument("--thread-streams", type=counts, default=[8, 16],
                       help="streams at once besides the single stream (default: 8,16)")
    group.add_argument("--markdown", metavar="FILE",
                       help="also write the tables as Markdown to FILE (docs/benchmarks/: "
                            "serving-streams.md, serving-prefix-chunked.md)")
    args = parser.parse_args(argv)
    if "poisson" in args.workloads:
        try:
            workload_lengths(args)
        except ValueError as e:
            parser.error(str(e))
    if args.wait_tokens >= args.stream_tokens:
        parser.error("--wait-tokens must be below --stream-tokens")
    if args.streams >= args.slots:
        parser.error("--streams must leave a slot for the long prompt (--slots)")
    if args.max_num_batched_tokens <= args.slots:
        parser.error("--max-num-batched-tokens must exceed --slots (the decodes come first)")
    model = load_model(args.model)
    tables = []
    for name in args.workloads:
        try:
            tables += {"poisson": poisson, "chat": chat, "long-prompt": long_prompt,
                       "streams": streams, "threads": threads_workload}[name](args, model)
        except RuntimeError as e:   # a request refused or failed: the server's own words
            raise SystemExit(f"error: {name}: {e}") from None
    if args.markdown:
        title = "the batched step before and after" if args.workloads == ["streams"] else \
            ", ".join(args.workloads)
        write_markdown(args.markdown, tables, argv, title=f"Serving benchmark: {title}",
                       script="bench_serving.py")
    return 0


def rates(text):
    values = numbers(text)
    if not all(v > 0 for v in values):
        raise argparse.ArgumentTypeError("every rate must be > 0 requests/s")
    return values


def counts(text):
    values = numbers(text)
    if not all(math.isfinite(v) and v >= 1 and v == int(v) for v in values):
        raise argparse.ArgumentTypeError("every count of streams must be a whole number >= 1")
    return [int(v) for v in values]


def workloads(text):
    names = [name for name in text.split(",") if name]
    unknown = [name for name in names if name not in WORKLOADS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown workload(s) {', '.join(unknown) or '(none)'}"
                                         f"; choose from {', '.join(WORKLOADS)}")
    return names


if __name__ == "__main__":
    from _common import run
    run(main)
