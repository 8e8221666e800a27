"""What the server counts and what it keeps: /v1/models, /health and vLLM's /metrics against the
engine's records, label values escaped; a server left running keeps nothing per request while
/metrics counts every one, and the engine keeps its timeline only when asked (history)."""
import urllib.request
from collections import deque

import pytest

from conftest import wait_for
from minitransformer.checkpoints.synth import qwen2_config
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


def test_models_health_and_metrics(served):
    online, url, client = served
    assert [m.id for m in client.models.list().data] == [NAME]
    assert urllib.request.urlopen(url + "/health").status == 200
    for _ in range(2):              # the second finds the first's full blocks cached
        client.completions.create(model=NAME, prompt="The sun rose over the hills",
                                  max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    text = urllib.request.urlopen(url + "/metrics").read().decode()
    samples = dict(line.rsplit(" ", 1) for line in text.splitlines() if line[:1] != "#")
    label = f'{{model_name="{NAME}"}}'
    made = sum(len(r.tokens) for r in online.engine.results.values())
    assert int(samples["vllm:generation_tokens_total" + label]) == made
    assert int(samples["vllm:prompt_tokens_total" + label]) == \
        sum(len(r.request.prompt) for r in online.engine.results.values())
    results = list(online.engine.results.values())
    hits = int(samples["vllm:prefix_cache_hits_total" + label])
    assert int(samples["vllm:prefix_cache_queries_total" + label]) == \
        sum(len(r.request.prompt) for r in results if r.prefill_chunks)  # the admitted
    assert hits == sum(r.cached_tokens for r in results) >= results[-1].cached_tokens > 0
    assert results[-1].cached_tokens == (len(results[-1].request.prompt) - 1) // 4 * 4
    assert samples["vllm:num_requests_running" + label] == "0"
    assert float(samples["vllm:kv_cache_usage_perc" + label]) == 0.0
    finished = sum(r.status == "finished" for r in online.engine.results.values())
    assert int(samples["vllm:e2e_request_latency_seconds_count" + label]) >= finished
    for name in ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                 "vllm:num_preemptions_total", "vllm:num_requests_waiting"):
        assert f"# TYPE {name}" in text


def test_a_model_name_is_escaped_in_the_metrics_labels():
    """--served-model-name is the client's word; quoted into a label it must stay one label."""
    from minitransformer.serve.prometheus import ServingMetrics

    assert ServingMetrics('my "best"\\model\n').labels == \
        'model_name="my \\"best\\"\\\\model\\n"'


# --- a server left running --------------------------------------------------------------------
def footprint(*objects) -> dict:
    """The length of every list, dict, deque and set the objects hold: what grows if something
    is kept per request or per step."""
    return {(type(o).__name__, name): len(value) for o in objects
            for name, value in vars(o).items() if isinstance(value, (list, dict, deque, set))}


def metric_samples(url) -> dict:
    text = urllib.request.urlopen(url + "/metrics").read().decode()
    return dict(line.rsplit(" ", 1) for line in text.splitlines() if line[:1] != "#")


def test_a_long_run_keeps_no_record_per_request_and_metrics_count_them_all(model):
    """Without history the engine forgets each request once its end is handed over, and keeps
    no per-step list: its footprint after 2N requests is its footprint after N, while /metrics
    has counted every one of them."""
    online = OnlineEngine(Engine(model, EngineConfig(max_num_seqs=2, num_gpu_blocks_override=32,
                                                     block_size=4)))
    server = Background(create_app(online, NAME))
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    samples = tokens = prompt_tokens = 0

    def requests(count):
        nonlocal samples, tokens, prompt_tokens
        for i in range(count):
            n, stream = 1 + i % 2, i % 3 == 0
            body = dict(model=NAME, prompt=f"Request {samples} of many", max_tokens=3, n=n,
                        logprobs=i % 2, temperature=0.5, seed=i)
            if stream:
                chunks = list(client.completions.create(
                    stream=True, stream_options={"include_usage": True}, **body))
                usage = chunks[-1].usage
            else:
                usage = client.completions.create(**body).usage
            samples, tokens = samples + n, tokens + usage.completion_tokens
            prompt_tokens += usage.prompt_tokens
        # at rest: a request's handler cancels its ticket (a no-op once over) when its answer
        # is sent, so the loop may not have taken that cancel from its inbox yet
        wait_for(lambda: not online.live and online.snapshot.running == 0 and not online.inbox)
        cache = online.engine.cache             # its lists and maps: at most one per block
        assert max(footprint(cache).values()) <= cache.books.num_blocks
        return footprint(online.engine, online)
    try:
        after_n = requests(6)
        assert online.engine.results == {} and online.engine.memory == []
        assert requests(12) == after_n                    # 18 requests: nothing grew
        counted = metric_samples(server.url)
        label = f'model_name="{NAME}"'
        assert sum(int(counted[f'vllm:request_success_total{{finished_reason="{r}",{label}}}'])
                   for r in ("stop", "length", "abort")) == samples
        assert int(counted[f"vllm:generation_tokens_total{{{label}}}"]) == tokens
        assert int(counted[f"vllm:prompt_tokens_total{{{label}}}"]) == prompt_tokens
        assert int(counted[f"vllm:e2e_request_latency_seconds_count{{{label}}}"]) == samples
    finally:
        server.stop()
        online.close()


def test_history_keeps_the_timeline_and_run_hands_its_records_over():
    """An experiment asks for the timeline (history=True): a decode entry per decoding step, a
    pool reading per step. Without it run() still returns every record, and the engine keeps
    none of them once run() is over."""
    from minitransformer.checkpoints.synth import random_model
    model = random_model(qwen2_config())
    requests = [Request((1, 2, 3), 4, eos_token_id=[]), Request((4, 5), 2, eos_token_id=[])]
    kept = Engine(model, EngineConfig(max_num_seqs=2), history=True)
    run = kept.run(requests)
    assert len(run.memory) == run.steps and len(run.decode_times) == run.steps - 1
    assert sorted(kept.results) == [0, 1] and [len(r.tokens) for r in run.results] == [4, 2]
    lean = Engine(model, EngineConfig(max_num_seqs=2))
    run = lean.run(requests)
    assert [len(r.tokens) for r in run.results] == [4, 2] and lean.results == {}
    assert run.memory == run.decode_times == run.prefill_times == ()
    rid = lean.submit(requests[0])
    with pytest.raises(ValueError, match="not over"):
        lean.release(rid)           # a running request's record is never dropped
