"""A request of max_new_tokens=0 asking for prompt logprobs gets them through Engine.run (its
prompt's one prefill, no token made), and needs only its prompt's blocks: no room is held for
a token it will never write."""
import pytest

from minitransformer.checkpoints.synth import qwen2_config, random_model
from minitransformer.serve.config import EngineConfig
from minitransformer.serve.engine import Engine
from minitransformer.serve.records import Request

PROMPT = (5, 6, 7, 8, 9, 10, 11, 12)    # two blocks of 4


@pytest.fixture(scope="module")
def model():
    return random_model(qwen2_config())


def bounded(engine):
    """Engine.run's on_step: a request that decoded on would run for ever; it takes 3 steps."""
    assert engine.steps <= 3, "still running after 3 steps"


def engine(model, blocks, **config):
    return Engine(model, EngineConfig(max_num_seqs=2, num_gpu_blocks_override=blocks,
                                      block_size=4, **config))


@pytest.mark.parametrize("config", [{}, {"batch_invariant": True},
                                    {"max_num_batched_tokens": 5}], ids=str)
def test_no_new_tokens_gives_the_prompt_logprobs_of_the_same_prefill(model, config):
    """The same logprobs, bit for bit, as the request making one token (the same prefill
    passes), whole or in chunks; no token, status finished."""
    alone, = engine(model, 8, **config).run([Request(PROMPT, 0, prompt_logprobs=2)],
                                            bounded).results
    one, = engine(model, 8, **config).run([Request(PROMPT, 1, prompt_logprobs=2)]).results
    assert alone.status == "finished" and alone.tokens == [] and alone.logprobs == []
    assert len(alone.prompt_logprobs) == len(PROMPT) and alone.prompt_logprobs[0] is None
    assert alone.prompt_logprobs == one.prompt_logprobs


def test_no_new_tokens_needs_only_its_prompts_blocks(model):
    """An 8-token prompt in blocks of 4 through a pool of 2: accepted and answered, n = 2
    samples sharing its blocks too; making one token would need a third block."""
    e = engine(model, 2)
    assert e.pool_need(Request(PROMPT, 0, n=2)) == 2 and e.pool_need(Request(PROMPT, 1)) == 3
    run = e.run([Request(PROMPT, 0, prompt_logprobs=0, n=2)], bounded)
    assert [r.status for r in run.results] == ["finished"] * 2
    assert run.results[0].prompt_logprobs == run.results[1].prompt_logprobs
    assert len(run.results[0].prompt_logprobs) == len(PROMPT)
    assert e.cache.books.num_free == 2
    rejected, = engine(model, 2).run([Request(PROMPT, 1, prompt_logprobs=0)]).results
    assert rejected.status == "rejected" and "needs up to 3 blocks" in rejected.reason


def test_no_new_tokens_without_prompt_logprobs_computes_nothing(model):
    e = engine(model, 2)
    run = e.run([Request(PROMPT, 0)])
    assert run.results[0].status == "finished" and run.steps == 0
