"""What a server reports at GET /metrics: Prometheus' text format, under vLLM's metric names.

A dashboard built for vLLM reads these unchanged:

    vllm:num_requests_running / _waiting    gauges: requests in slots / in the queue
    vllm:kv_cache_usage_perc                gauge: fraction of KV blocks held (0..1)
    vllm:prompt_tokens_total                counter: prompt tokens of accepted requests
    vllm:generation_tokens_total            counter: tokens generated
    vllm:num_preemptions_total              counter: sequences swapped out for memory
    vllm:prefix_cache_queries_total         counter: prompt tokens looked up in the prefix cache
    vllm:prefix_cache_hits_total            counter: of those, tokens found cached (hit rate =
                                            hits / queries, as vLLM's dashboards compute it)
    vllm:request_success_total              counter, by finished_reason (stop, length, abort)
    vllm:time_to_first_token_seconds        histogram: arrival to first token
    vllm:inter_token_latency_seconds        histogram: gap between consecutive tokens
    vllm:time_per_output_token_seconds      the same gaps under vLLM's older (V0) name
    vllm:e2e_request_latency_seconds        histogram: arrival to the end of the answer

and with speculative decoding on (speculate.py), its counters:

    vllm:spec_decode_num_drafts_total       drafts verified (a sequence's proposal in a step)
    vllm:spec_decode_num_draft_tokens_total tokens proposed in them
    vllm:spec_decode_num_accepted_tokens_total  of those, accepted (acceptance rate =
                                            accepted / draft tokens; tokens per draft =
                                            1 + accepted / drafts)
    vllm:spec_decode_num_accepted_tokens_per_pos_total  by position in the draft
                                            (label position = 0, 1, ...)

A histogram is cumulative buckets (``le`` = less or equal) plus a count and a sum, so a
quantile is read off with PromQL's ``histogram_quantile``. Times are measured where the server
hands tokens over, on the online engine's clock. Leaves out: multiprocess collection, the
``_created`` samples.

>>> h = Histogram("vllm:e2e_request_latency_seconds", "End to end.", (0.5, 1.0))
>>> h.observe(0.3); h.observe(0.7)
>>> print("\\n".join(h.lines('model_name="m"')))
# HELP vllm:e2e_request_latency_seconds End to end.
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{le="0.5",model_name="m"} 1
vllm:e2e_request_latency_seconds_bucket{le="1.0",model_name="m"} 2
vllm:e2e_request_latency_seconds_bucket{le="+Inf",model_name="m"} 2
vllm:e2e_request_latency_seconds_count{model_name="m"} 2
vllm:e2e_request_latency_seconds_sum{model_name="m"} 1.0
"""
import bisect
import threading

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
FINISH_REASONS = ("stop", "length", "abort")


class Histogram:
    def __init__(self, name, help_text, buckets):
        self.name, self.help, self.buckets = name, help_text, tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)    # per bucket, the last one is +Inf
        self.total, self.sum = 0, 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1   # le: value <= bound
        self.total += 1
        self.sum += value

    def lines(self, labels: str, name=None, help_text=None) -> list:
        """Prometheus text lines, under this histogram's name or another one given."""
        name, help_text = name or self.name, help_text or self.help
        out, cumulative = header(name, help_text, "histogram"), 0
        for bound, count in zip((*map(repr, self.buckets), "+Inf"), self.counts, strict=True):
            cumulative += count
            out.append(f'{name}_bucket{{le="{bound}",{labels}}} {cumulative}')
        return out + [f"{name}_count{{{labels}}} {self.total}",
                      f"{name}_sum{{{labels}}} {self.sum!r}"]


def header(name, help_text, kind) -> list:
    return [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]


def speculative_lines(labels: str, counters) -> list:
    """Speculation's counters (a speculate.SpecCounters) under vLLM's names.

    >>> from minitransformer.serve.speculate import SpecCounters
    >>> c = SpecCounters(); c.count(2, 1)
    >>> print("\\n".join(speculative_lines('model_name="m"', c)[-4:]))
    # HELP vllm:spec_decode_num_accepted_tokens_per_pos_total Number of accepted tokens per draft position.
    # TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter
    vllm:spec_decode_num_accepted_tokens_per_pos_total{position="0",model_name="m"} 1
    vllm:spec_decode_num_accepted_tokens_per_pos_total{position="1",model_name="m"} 0
    """
    out = []
    for name, help_text, value in (
            ("vllm:spec_decode_num_drafts_total", "Number of spec decoding drafts.",
             counters.drafts),
            ("vllm:spec_decode_num_draft_tokens_total", "Number of draft tokens.",
             counters.draft_tokens),
            ("vllm:spec_decode_num_accepted_tokens_total", "Number of accepted tokens.",
             counters.accepted_tokens)):
        out += header(name, help_text, "counter") + [f"{name}{{{labels}}} {value}"]
    name = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
    out += header(name, "Number of accepted tokens per draft position.", "counter")
    return out + [f'{name}{{position="{i}",{labels}}} {n}'
                  for i, n in enumerate(counters.per_position)]


class ServingMetrics:
    """Counters and histograms of one server, fed by the engine loop, read by /metrics."""

    def __init__(self, model_name: str):
        # a label value, escaped as Prometheus's text format asks: \\, \" and \n
        escaped = model_name.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
        self.labels = f'model_name="{escaped}"'
        self.lock = threading.Lock()    # observations come from the loop thread
        self.prompt_tokens = self.generation_tokens = 0
        self.finished = dict.fromkeys(FINISH_REASONS, 0)
        self.ttft = Histogram("vllm:time_to_first_token_seconds",
                              "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.itl = Histogram("vllm:inter_token_latency_seconds",
                             "Histogram of inter-token latency in seconds.", TOKEN_BUCKETS)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds",
                             "Histogram of end to end request latency in seconds.", E2E_BUCKETS)

    def accepted(self, prompt_tokens: int) -> None:
        with self.lock:
            self.prompt_tokens += prompt_tokens

    def tokens(self, arrival: float, previous: float | None, now: float, n: int) -> None:
        """n tokens handed over at now; previous: when the last ones were (None: first).
        Gaps are what a client sees: tokens handed over together are 0 s apart."""
        with self.lock:
            self.generation_tokens += n
            if previous is None:
                self.ttft.observe(now - arrival)
            gaps = ([] if previous is None else [now - previous]) + [0.0] * (n - 1)
            for gap in gaps:
                self.itl.observe(gap)   # also served as time per output token (see render)

    def ended(self, arrival: float, now: float, finish_reason: str) -> None:
        with self.lock:
            self.e2e.observe(now - arrival)
            self.finished[finish_reason] += 1

    def render(self, snapshot) -> str:
        """The text served at /metrics, from counters and the engine's snapshot."""
        lab = self.labels
        gauges = [("vllm:num_requests_running", "Number of requests in model execution "
                   "batches.", snapshot.running),
                  ("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                   snapshot.waiting),
                  ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                   snapshot.blocks_used / snapshot.blocks_total)]
        with self.lock:
            counters = [("vllm:prompt_tokens_total", "Number of prefill tokens processed.",
                         self.prompt_tokens),
                        ("vllm:generation_tokens_total", "Number of generation tokens "
                         "processed.", self.generation_tokens),
                        ("vllm:num_preemptions_total", "Cumulative number of preemptions.",
                         snapshot.preemptions),
                        ("vllm:prefix_cache_queries_total", "Prefix cache queries, in terms of "
                         "number of queried tokens.", snapshot.prefix_queries),
                        ("vllm:prefix_cache_hits_total", "Prefix cache hits, in terms of "
                         "number of cached tokens.", snapshot.prefix_hits)]
            out = []
            for name, help_text, value in gauges:
                out += header(name, help_text, "gauge") + [f"{name}{{{lab}}} {value!r}"]
            for name, help_text, value in counters:
                out += header(name, help_text, "counter") + [f"{name}{{{lab}}} {value}"]
            out += header("vllm:request_success_total", "Count of successfully processed "
                          "requests.", "counter")
            out += [f'vllm:request_success_total{{finished_reason="{reason}",{lab}}} {n}'
                    for reason, n in self.finished.items()]
            out += self.ttft.lines(lab) + self.itl.lines(lab)
            out += self.itl.lines(lab, "vllm:time_per_output_token_seconds",   # its V0 name:
                                  "Histogram of time per output token in seconds (V0 name).")
            out += self.e2e.lines(lab)
            if snapshot.speculative is not None:
                out += speculative_lines(lab, snapshot.speculative)
        return "\n".join(out) + "\n"
