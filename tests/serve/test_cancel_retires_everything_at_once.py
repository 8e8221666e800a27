"""A cancel retires everything the sequence held, at the cancel: its blocks, and what
speculation keeps for it (its acceptance books, a draft model's cache of it). When the cancel
leaves nothing running no step follows, so nothing left for "the next step" would ever go."""
import pytest

from minitransformer.checkpoints.synth import qwen2_config, random_model
from minitransformer.serve.config import EngineConfig, SpeculativeConfig
from minitransformer.serve.engine import Engine
from minitransformer.serve.records import Request
from minitransformer.speculative import first_layers

PROMPT = (1, 2, 3, 1, 2, 3, 1, 2)      # repeats: the lookup proposes


@pytest.fixture(scope="module")
def model():
    return random_model(qwen2_config())


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_a_cancel_leaving_nothing_running_retires_speculations_books_and_draft(model, method):
    spec = SpeculativeConfig(num_speculative_tokens=3, method=method,
                             model="-" if method == "draft_model" else None)
    engine = Engine(model, EngineConfig(max_num_seqs=2, num_gpu_blocks_override=16,
                                        block_size=4, speculative_config=spec),
                    draft_model=first_layers(model, 1) if method == "draft_model" else None)
    rid = engine.submit(Request(PROMPT, 20, eos_token_id=[]))
    for _ in range(3):                          # the prefill, then verifications
        engine.step()
    speculator = engine.speculator
    assert rid in speculator.judged and speculator.counters.draft_tokens > 0
    if method == "draft_model":
        assert rid in speculator.proposer.holding()
    assert engine.cancel(rid)
    assert not engine.running() and not engine.waiting
    assert speculator.judged == {} and speculator.proposer.holding() == set()
    books = engine.cache.books
    assert books.seqs == {} and books.num_free == books.num_blocks
    assert engine.results[rid].status == "cancelled"
