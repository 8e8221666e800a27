"""One forward pass per serving step: the step's decodes and its prompts (chunks with chunked
prefill, whole prompts without) go through the layers as one ragged batch of tokens
(paged.RaggedView), every weight multiplied once; tokens obey the near-tie rule, as a chunked
prefill's do (conftest's policy), and batch-invariant mode keeps each row's own calls. A
static batch's padding row rides beside a later prompt's chunks without growing; speculating,
the decodes' drafts are verified in that same pass."""
import numpy as np
import pytest

import minitransformer as mt
import minitransformer.linear as linear_module
import minitransformer.serve.runner as runner_module
from minitransformer.logprobs import log_softmax
from minitransformer.model import forward
from minitransformer.serve.config import EngineConfig, SpeculativeConfig
from minitransformer.serve.engine import Engine
from minitransformer.serve.records import Request
from test_engine import assert_pool_whole, assert_solo
from test_logprobs import TOLERANCE, assert_model_logprobs


def streams_and_a_prompt(model, budget=7, batch_invariant=False):
    """Two streams decode; then a 20-token prompt arrives (and a second behind it) ->
    the engine, stepped until the streams have made a token each."""
    engine = Engine(model, EngineConfig(max_num_seqs=4, num_gpu_blocks_override=40,
                                        block_size=4, max_num_batched_tokens=budget,
                                        batch_invariant=batch_invariant), history=True)
    for n in (2, 3):
        engine.submit(Request(tuple(range(1, n + 1)), 12, eos_token_id=[]))
    while not all(r.tokens for r in engine.results.values()):
        engine.step()
    for start in (5, 40):
        engine.submit(Request(tuple(range(start, start + 20)), 4, arrival=engine.clock,
                              eos_token_id=[]))
    return engine


def counted(monkeypatch):
    """-> (forward calls' ids shapes, products made) of the steps taken while counting."""
    passes, products, real_multiply = [], [], linear_module.multiply
    monkeypatch.setattr(runner_module, "forward", lambda model, ids, *a, **k:
                        passes.append(np.shape(ids)) or forward(model, ids, *a, **k))
    monkeypatch.setattr(linear_module, "multiply", lambda x, w, out=None:
                        products.append(x.shape[0]) or real_multiply(x, w, out))
    return passes, products


def test_a_step_of_decodes_and_a_chunk_reads_every_weight_once(tiny_model, monkeypatch):
    engine = streams_and_a_prompt(tiny_model)
    passes, products = counted(monkeypatch)
    engine.step()                   # two decodes and a chunk of 5 tokens (the budget's 7)
    layers = tiny_model.config.num_hidden_layers
    assert passes == [(1, 7)]
    assert len(products) == 4 * layers + 1            # qkv, o, gate_up, down; the head once
    assert products[:-1] == [7] * 4 * layers and products[-1] == 2   # head: the decodes'
    while engine.running() or engine.waiting:
        engine.step()
    assert all(shape[0] == 1 for shape in passes)     # every step one pass (or a lone decode)
    assert_solo(tiny_model, engine.results.values())  # the near-tie rule
    assert_pool_whole(engine)


def test_a_step_of_decodes_and_whole_prompts_reads_every_weight_once(tiny_model, monkeypatch):
    """No token budget: both 20-token prompts prefill whole, in the decodes' pass; the head
    takes the two decodes' rows and each prompt's last."""
    engine = streams_and_a_prompt(tiny_model, budget=None)
    passes, products = counted(monkeypatch)
    engine.step()
    layers = tiny_model.config.num_hidden_layers
    assert passes == [(1, 42)]
    assert products == [42] * 4 * layers + [4]
    assert all(engine.results[i].prefill_chunks == 1 for i in (2, 3))
    while engine.running() or engine.waiting:
        engine.step()
    assert all(shape[0] == 1 for shape in passes)
    assert_solo(tiny_model, engine.results.values())  # the near-tie rule
    assert_pool_whole(engine)


def test_batch_invariant_mode_keeps_each_rows_own_calls(tiny_model, monkeypatch):
    engine = streams_and_a_prompt(tiny_model, batch_invariant=True)
    _, products = counted(monkeypatch)
    engine.step()
    layers = tiny_model.config.num_hidden_layers      # each decode alone, then the chunk
    assert products == [1] * (4 * layers + 1) * 2 + [5] * 4 * layers   # (no head: not last)
    while engine.running() or engine.waiting:
        engine.step()
    assert_solo(tiny_model, engine.results.values(), batch_invariant=True)


@pytest.mark.usefixtures("step_threads")
@pytest.mark.parametrize("budget", [5, 9, 30, None])
def test_mixed_steps_keep_every_token_and_logprob_within_the_rule(tiny_model, budget):
    """Prompt logprobs and token logprobs from a mixed pass's rows, and prompts that end
    inside it (their first tokens from the chunk's last row)."""
    engine = streams_and_a_prompt(tiny_model, budget)
    prompt = tuple(range(60, 75))
    first = engine.submit(Request(prompt, 3, eos_token_id=[], logprobs=1, prompt_logprobs=1,
                                  arrival=engine.clock))
    while engine.running() or engine.waiting:
        engine.step()
    result = engine.results[first]
    scored, ref = result.prompt_logprobs, log_softmax(mt.logits(tiny_model, list(prompt)))
    assert scored[0] is None and [s.token for s in scored[1:]] == list(prompt[1:])
    assert max(abs(s.logprob - ref[t, s.token]) for t, s in enumerate(scored[1:])) < TOLERANCE
    assert_model_logprobs(tiny_model, prompt, result.logprobs, 1)
    assert_solo(tiny_model, engine.results.values())
    assert_pool_whole(engine)


def test_a_prompt_cached_in_full_behind_the_chunk_that_fills_it_copies_after_that_pass(
        tiny_model, monkeypatch):
    """A stream decodes while two equal 8-token prompts arrive: the second finds both of the
    first's blocks named in the same plan and copies the last before writing its last token;
    the copy must read what the first's pass wrote, so that step runs its passes apart."""
    engine = Engine(tiny_model, EngineConfig(max_num_seqs=3, num_gpu_blocks_override=20,
                                             block_size=4, max_num_batched_tokens=12),
                    history=True)
    engine.submit(Request((1, 2, 3), 6, eos_token_id=[]))
    engine.step()
    prompt = tuple(range(30, 38))
    for _ in range(2):
        engine.submit(Request(prompt, 3, arrival=engine.clock, eos_token_id=[]))
    passes, _ = counted(monkeypatch)
    engine.step()
    assert engine.results[2].cached_tokens == 7 and passes == [(1, 8), (1, 1)]
    while engine.running() or engine.waiting:
        engine.step()
    assert engine.results[1].tokens == engine.results[2].tokens
    assert_solo(tiny_model, engine.results.values())


def count_passes(monkeypatch) -> list:
    """The engine's forward passes, a 1 for each: its own (prompts, mixed steps) and its
    decodes' (last_logits)."""
    calls = []
    for name in ("forward", "last_logits"):
        real = getattr(runner_module, name)
        monkeypatch.setattr(runner_module, name,
                            lambda *a, real=real, **k: calls.append(1) or real(*a, **k))
    return calls


@pytest.mark.parametrize("prompts", [[(3, 4, 5)], [(3, 4, 5), (6, 7)]])
def test_a_decode_and_new_prompts_share_one_forward_pass(tiny_model, monkeypatch, prompts):
    """A running request decodes while one or two new prompts prefill: the step is ONE
    forward pass over them all (the default mode), and every request gets its tokens."""
    calls = count_passes(monkeypatch)
    engine = Engine(tiny_model, EngineConfig(max_num_seqs=1 + len(prompts)))
    a = engine.submit(Request((1, 2), 3, eos_token_id=[]))
    engine.step()
    new = [engine.submit(Request(prompt, 2, eos_token_id=[])) for prompt in prompts]
    calls.clear()
    engine.step()
    assert calls == [1]
    assert [len(engine.results[i].tokens) for i in (a, *new)] == [2] + [1] * len(prompts)


def test_a_speculating_step_verifies_its_drafts_beside_new_prompts_in_one_pass(tiny_model,
                                                                              monkeypatch):
    """A decoding sequence drafts 2 tokens while a 20-token prompt arrives: its verification
    and the prompt go through the layers in ONE ragged pass (its last token, its 2
    proposals, the prompt), and the prompt's first token comes from it."""
    spec = SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_max=2)
    engine = Engine(tiny_model, EngineConfig(max_num_seqs=2, speculative_config=spec))
    a = engine.submit(Request((1, 2), 12, eos_token_id=[]))
    engine.step()
    proposer = engine.speculator.proposer    # whatever the text, every ask gets its n
    monkeypatch.setattr(proposer, "propose", lambda asks: [([7] * ask.n, [None] * ask.n)
                                                           for ask in asks])
    b = engine.submit(Request(tuple(range(5, 25)), 2, eos_token_id=[]))
    passes, _ = counted(monkeypatch)
    engine.step()
    assert engine.speculator.counters.draft_tokens == 2 and passes == [(1, 1 + 2 + 20)]
    assert len(engine.results[a].tokens) >= 2 and len(engine.results[b].tokens) == 1


def test_a_static_padding_row_beside_a_later_chunk_holds_its_length(tiny_model):
    """Static batching, a budget of 4: the short request finishes at its first token and
    stays as a padding row while the long prompt prefills in chunks beside it, in the same
    passes; the padding row never grows, and the pool is whole at the end."""
    engine = Engine(tiny_model, EngineConfig(max_num_seqs=2, policy="static",
                                             max_num_batched_tokens=4))
    short = engine.submit(Request((1, 2), 1, eos_token_id=[]))
    long = engine.submit(Request(tuple(range(3, 17)), 2, eos_token_id=[]))
    lengths = []
    while engine.waiting or engine.running():
        engine.step()
        if short in engine.cache.books.seqs:
            lengths.append(engine.cache.books.seqs[short].length)
        engine.cache.books.check()
    assert len(lengths) >= 3 and set(lengths) == {2}
    assert len(engine.results[short].tokens) == 1 and len(engine.results[long].tokens) == 2
    assert engine.cache.books.num_free == engine.cache.books.num_blocks
