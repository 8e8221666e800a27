"""What serving is measured in: a request, what happened to it, a run, its metrics (exp. 13).

One vocabulary for the real engine (minitransformer/serve/engine.py) and the simulation
(sim/batching.py), so that their tables are computed by the same function:

    Request   what a client asks: a prompt, how many new tokens at most, when it arrives,
              how to sample. (The simulation has no prompts: its workload is a list of
              sim.workload.Arrival, an arrival time and an output length.)
    Result    what happened to one request, filled in as it is served: its new tokens, its
              status, and three times on the serving clock: ``first_token``, ``ended``
              (its last token, or its cancelling) and ``returned``, when the answer was
              handed back (static batching returns a batch as a whole, so that can be later
              than it ended).
    Run       a whole run: the results and what each step cost.
    metrics   throughput and latencies over the finished results.

Times are seconds on one clock: the engine's measured compute time, or the simulation's.
Percentiles are numpy's (linear interpolation). Leaves out: streaming (time per token of each
request), queueing statistics beyond TTFT, anything about cancelled requests.

>>> r = Result(0, arrival=1.0, tokens=[7, 8, 9], status="finished",
...            first_token=2.0, ended=4.0, returned=5.0)
>>> r.ttft, r.per_token, r.latency         # 1 s to the first token, 1 s between tokens
(1.0, 1.0, 4.0)
>>> m = metrics([r])
>>> m.tokens, m.throughput, m.normalised    # 3 tokens in the 4 s from arrival to return
(3, 0.75, 1.3333333333333333)
"""
import math
from dataclasses import dataclass, field

import numpy as np

from minitransformer.sampling import GREEDY, SamplingSettings

STATUSES = ("waiting", "running", "finished", "cancelled", "rejected", "error")


@dataclass(frozen=True)
class Request:
    prompt: tuple                   # token ids
    max_new_tokens: int
    arrival: float = 0.0            # seconds on the serving clock
    sampling: SamplingSettings = GREEDY
    seed: int | None = None         # of the request's own numpy Generator
    eos_token_id: object = None     # as generate: None = the model's ids, [] = never stop
    n: int = 1                      # parallel samples of the prompt; choice i seeded seed + i
    logprobs: int | None = None     # None, or k: each new token's logprob and the top k
    prompt_logprobs: int | None = None  # None, or k: the same for the prompt's tokens

    @property
    def prompt_only(self) -> bool:
        """No new token (max_new_tokens 0; the OpenAI API's max_tokens 0, an echo or the
        prompt logprobs alone). What it does, decided here for the engine and the scheduler:
        it holds its prompt's blocks and no room for a token (admission, ``pool_need``), its
        prompt's pass picks no token and it is done once that pass ran, and with no prompt
        logprobs asked there is nothing to compute: it is finished when it is queued."""
        return self.max_new_tokens == 0


@dataclass
class Result:
    """One request's outcome. The simulation makes no token ids, only tokens: its results
    hold None for each."""
    id: int
    arrival: float                  # seconds on the serving clock (the request's)
    request: Request = None  # type: ignore[assignment]  # the engine's (None: sim/'s, unread)
    tokens: list = field(default_factory=list)   # new tokens only, as generate returns them
    status: str = "waiting"         # one of STATUSES
    reason: str = ""                # why it was rejected, or what error ended it
    first_token: float = math.nan   # times on the serving clock (seconds)
    ended: float = math.nan         # its last token made (or when it was cancelled, failed)
    returned: float = math.nan      # handed back: static batching returns a batch as a whole
    cached_tokens: int = 0          # prompt tokens found in the prefix cache
    prefill_chunks: int = 0         # forward passes its prompt took (1: prefilled whole)
    preemptions: int = 0
    choice: int = 0                 # which of the request's n samples (results id - choice ..)
    logprobs: list = field(default_factory=list)  # a TokenLogprob per token, when asked
    prompt_logprobs: list | None = None  # [None, TokenLogprob, ...] per prompt token, when asked

    @property
    def ttft(self) -> float:
        """Time to first token: what a streaming client waits before seeing anything."""
        return self.first_token - self.arrival

    @property
    def latency(self) -> float:
        """End to end: arrival to the answer handed back."""
        return self.returned - self.arrival

    @property
    def per_token(self) -> float:
        """Seconds between consecutive tokens after the first (nan for one token)."""
        n = len(self.tokens)
        return (self.ended - self.first_token) / (n - 1) if n > 1 else math.nan


@dataclass(frozen=True)
class Run:
    policy: str                     # "static" or "continuous"
    results: tuple                  # Result, in submission order
    steps: int                      # forward passes (engine) or decode steps (simulation)
    elapsed: float                  # seconds on the serving clock
    decode_times: tuple = ()        # engine: (batch size, seconds) per decode step
    prefill_times: tuple = ()       # engine: (tokens prefilled, seconds) per prefill
    memory: tuple = ()              # engine: PagedStats after each step's work
    preemptions: int = 0


@dataclass(frozen=True)
class Metrics:
    requests: float                 # finished ones, with at least one token (sim: a mean)
    tokens: float
    throughput: float               # new tokens / s, first arrival to last return
    latency_mean: float             # end-to-end seconds, arrival to return
    latency_p50: float
    latency_p99: float
    normalised: float               # mean of latency / output tokens, s/token (Orca, vLLM)
    ttft_mean: float                # arrival to first token
    per_token_mean: float           # seconds between tokens after the first (nan: none)


def metrics(results) -> Metrics:
    """Over the finished results with tokens; a ValueError when there are none."""
    done = [r for r in results if r.status == "finished" and r.tokens]
    if not done:
        raise ValueError("no finished request with tokens to measure")
    latency = np.array([r.latency for r in done])
    tokens = np.array([len(r.tokens) for r in done])
    span = max(r.returned for r in done) - min(r.arrival for r in done)
    per_token = [r.per_token for r in done if len(r.tokens) > 1]
    return Metrics(
        requests=len(done),
        tokens=int(tokens.sum()),
        throughput=float(tokens.sum() / span),
        latency_mean=float(latency.mean()),
        latency_p50=float(np.percentile(latency, 50)),
        latency_p99=float(np.percentile(latency, 99)),
        normalised=float((latency / tokens).mean()),
        ttft_mean=float(np.mean([r.ttft for r in done])),
        per_token_mean=float(np.mean(per_token)) if per_token else math.nan,
    )
