"""Log-probabilities are the model's own: log_softmax of ``mt.logits`` on the same tokens (within
1e-4), before any sampling setting, taken from the logits that chose each token (no second
forward pass), through ``generate`` and through the engine, for new tokens and prompt tokens."""
import importlib

import numpy as np
import pytest

import minitransformer as mt
import minitransformer.serve.runner as runner_module
from minitransformer.logprobs import MAX_LOGPROBS, check_top, log_softmax, token_logprob
from minitransformer.model import forward
from minitransformer.sampling import SamplingSettings
from minitransformer.serve.config import EngineConfig
from minitransformer.serve.engine import Engine
from minitransformer.serve.records import Request

generate_module = importlib.import_module("minitransformer.generate")  # (not the function)
TOLERANCE = 1e-4
PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38]
SAMPLING = [dict(), dict(sampling=SamplingSettings(do_sample=True, temperature=0.6, top_k=5,
                                                  repetition_penalty=1.3), seed=4)]


def reference(model, prompt, tokens):
    """log_softmax of one full forward pass over prompt + tokens: (len(tokens), V)."""
    return log_softmax(mt.logits(model, list(prompt) + list(tokens)))[len(prompt) - 1:-1]


def assert_model_logprobs(model, prompt, scored, k):
    """Each TokenLogprob against the reference: its own logprob and its top k (the k largest,
    in order)."""
    ref = reference(model, prompt, [s.token for s in scored])
    for row, s in zip(ref, scored, strict=True):
        assert abs(s.logprob - row[s.token]) < TOLERANCE
        assert len(s.top) == k
        top_ids = [t for t, _ in s.top]
        assert np.allclose([p for _, p in s.top], row[top_ids], atol=TOLERANCE)
        assert sorted(row, reverse=True)[:k] == pytest.approx([p for _, p in s.top],
                                                              abs=TOLERANCE)


@pytest.mark.parametrize("sampling", SAMPLING, ids=["greedy", "sampled"])
@pytest.mark.parametrize("cache", [True, False])
def test_generate_returns_the_models_own_logprobs(tiny_model, sampling, cache):
    scored = mt.generate(tiny_model, PROMPT, 12, cache=cache, logprobs=4, eos_token_id=[],
                         **sampling)
    tokens = mt.generate(tiny_model, PROMPT, 12, cache=cache, eos_token_id=[], **sampling)
    assert [s.token for s in scored] == tokens          # asking for logprobs changes nothing
    assert_model_logprobs(tiny_model, PROMPT, scored, 4)


def test_logprobs_are_taken_before_the_sampling_settings(tiny_model):
    """Temperature, top-k and the penalty change which token is drawn, never its logprob:
    the same tokens (forced by a greedy run) score the same under any settings."""
    greedy = mt.generate(tiny_model, PROMPT, 6, logprobs=0, eos_token_id=[])
    z = mt.logits(tiny_model, PROMPT)[-1]
    hot = token_logprob(z, greedy[0].token)
    assert hot.logprob == pytest.approx(greedy[0].logprob, abs=TOLERANCE)
    hot = SamplingSettings(do_sample=True, temperature=1.9, repetition_penalty=2.0)
    sampled = mt.generate(tiny_model, PROMPT, 6, logprobs=0, eos_token_id=[], sampling=hot,
                          seed=1)
    assert_model_logprobs(tiny_model, PROMPT, sampled, 0)


def test_one_forward_pass_per_token_with_or_without_logprobs(tiny_model, monkeypatch):
    """Not a second pass to score a token: the same number of forward calls either way."""
    calls = []
    real = generate_module.forward
    monkeypatch.setattr(generate_module, "forward",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    mt.generate(tiny_model, PROMPT, 7, eos_token_id=[])
    plain = len(calls)
    mt.generate(tiny_model, PROMPT, 7, eos_token_id=[], logprobs=MAX_LOGPROBS)
    assert len(calls) - plain == plain == 7      # a prefill and six decodes, each time


@pytest.mark.parametrize("k", [-1, MAX_LOGPROBS + 1, True, 2.0, "3", None])
def test_a_bad_number_of_alternatives_is_named(tiny_model, k):
    with pytest.raises(ValueError, match=f"logprobs must be an integer in \\[0, {MAX_LOGPROBS}"):
        check_top(k)
    if k is not None:           # None is "no logprobs" for generate
        with pytest.raises(ValueError, match="logprobs must be an integer"):
            mt.generate(tiny_model, PROMPT, 2, logprobs=k)


def test_log_softmax_is_a_distribution_even_for_huge_logits():
    z = np.array([1e30, 1e30 - 1e24, -1e30, 0.0], dtype=np.float32)
    logp = log_softmax(z)
    assert np.isfinite(logp[:2]).all() and np.exp(logp).sum() == pytest.approx(1.0)
    assert token_logprob(z, 3, k=2).top[0][0] == 0          # ties broken by the lower id


@pytest.mark.parametrize("batch_invariant", [True, False])
def test_the_engine_scores_new_and_prompt_tokens_as_the_model(tiny_model, monkeypatch,
                                                              batch_invariant):
    """Batched decoding and paging move logits in their last bits only: within 1e-4. The
    prompt's tokens come from its one prefill; the first has none (nothing predicts it)."""
    calls = []
    for module in (runner_module, generate_module):    # prefills here, decodes in last_logits
        monkeypatch.setattr(module, "forward", lambda *a, **k: calls.append(1) or forward(*a, **k))
    settings = SamplingSettings(do_sample=True, temperature=0.8)
    requests = [Request(tuple(PROMPT[:n]), 9, sampling=settings, seed=n, eos_token_id=[],
                        logprobs=2, prompt_logprobs=3) for n in (4, 7, 10)]
    run = Engine(tiny_model, EngineConfig(max_num_seqs=3, block_size=4,
                                          batch_invariant=batch_invariant)).run(
        requests)
    decodes = 8 * 3 if batch_invariant else 8   # eight steps of 3 rows: row by row, or batched
    prefills = 3 if batch_invariant else 1      # the first step's three prompts: one pass
    assert len(calls) == prefills + decodes     # the prefills, the decodes: no extra pass
    for result in run.results:
        prompt = result.request.prompt
        assert_model_logprobs(tiny_model, prompt, result.logprobs, 2)
        assert result.prompt_logprobs[0] is None and len(result.prompt_logprobs) == len(prompt)
        ref = log_softmax(mt.logits(tiny_model, list(prompt)))
        for t, s in enumerate(result.prompt_logprobs[1:], start=1):
            assert s.token == prompt[t] and len(s.top) == 3
            assert abs(s.logprob - ref[t - 1, prompt[t]]) < TOLERANCE


def test_prompt_logprobs_compute_the_whole_prompt_even_when_its_blocks_are_cached(tiny_model):
    """A prompt whose blocks another request holds is still prefilled whole when its
    prompt's logprobs are asked for (they need every position's logits)."""
    prompt = tuple(PROMPT * 2)
    engine = Engine(tiny_model, EngineConfig(max_num_seqs=2, block_size=4))
    first = engine.submit(Request(prompt, 30, eos_token_id=[]))
    engine.step()
    second = engine.submit(Request(prompt, 2, eos_token_id=[], prompt_logprobs=0))
    third = engine.submit(Request(prompt, 2, eos_token_id=[]))
    while engine.waiting or engine.running():
        engine.step()
    assert engine.results[second].cached_tokens == 0
    assert engine.results[third].cached_tokens > 0          # caching still works for others
    assert len(engine.results[second].prompt_logprobs) == len(prompt)
    assert engine.results[first].prompt_logprobs is None


def test_prompt_logprobs_of_a_prompt_prefilled_in_chunks(tiny_model):
    """Chunks of 3 tokens: each chunk's positions score the next prompt tokens, in order."""
    prompt = tuple(PROMPT + PROMPT[:3])
    engine = Engine(tiny_model, EngineConfig(max_num_seqs=2, block_size=4,
                                             max_num_batched_tokens=3))
    run = engine.run([Request(prompt, 2, eos_token_id=[], prompt_logprobs=2, n=2)])
    ref = log_softmax(mt.logits(tiny_model, list(prompt)))
    for result in run.results:
        assert result.prefill_chunks == 5 and result.prompt_logprobs[0] is None
        scored = result.prompt_logprobs[1:]
        assert [s.token for s in scored] == list(prompt[1:])
        assert max(abs(s.logprob - ref[t, s.token]) for t, s in enumerate(scored)) < TOLERANCE


def test_prompt_logprobs_of_chunks_that_share_a_pass_with_a_decode(tiny_model):
    """A request decodes while a prompt goes in chunks of 3 beside it (a budget of 4): each
    step's decode and chunk run as one pass, and each chunk's positions still score the next
    prompt tokens, in order."""
    prompt = tuple(PROMPT + PROMPT[:3])
    engine = Engine(tiny_model, EngineConfig(max_num_seqs=2, block_size=4,
                                             max_num_batched_tokens=4))
    engine.submit(Request((1, 2), 30, eos_token_id=[]))
    engine.step()
    rid = engine.submit(Request(prompt, 2, eos_token_id=[], prompt_logprobs=2,
                                arrival=engine.clock))
    while engine.waiting or engine.running():
        engine.step()
    result = engine.results[rid]
    ref = log_softmax(mt.logits(tiny_model, list(prompt)))
    assert result.prefill_chunks == -(-len(prompt) // 3) and result.prompt_logprobs[0] is None
    scored = result.prompt_logprobs[1:]
    assert [s.token for s in scored] == list(prompt[1:])
    assert max(abs(s.logprob - ref[t, s.token]) for t, s in enumerate(scored)) < TOLERANCE


@pytest.mark.parametrize("field, value", [("logprobs", -1), ("logprobs", 21),
                                          ("prompt_logprobs", True), ("logprobs", 1.0)])
def test_the_engine_names_a_bad_logprobs_field(tiny_model, field, value):
    engine = Engine(tiny_model, EngineConfig(max_num_seqs=2))
    with pytest.raises(ValueError, match=field):
        engine.submit(Request((1, 2), 3, **{field: value}))
    assert not engine.waiting and not engine.results


def test_smollm2_logprobs_equal_log_softmax_of_its_logits(smollm2):
    """The real model: a greedy continuation and a sampled one, through generate and the
    engine, within 1e-4 of one full forward pass."""
    model = smollm2
    prompt = model.tokenizer.encode("The capital of France is")
    assert_model_logprobs(model, prompt, mt.generate(model, prompt, 8, logprobs=5), 5)
    run = Engine(model, EngineConfig(max_num_seqs=2, block_size=16)).run([
        Request(tuple(prompt), 8, sampling=SamplingSettings(do_sample=True), seed=3, n=2,
                logprobs=5, prompt_logprobs=1)])
    for result in run.results:
        assert_model_logprobs(model, prompt, result.logprobs, 5)
    ref = log_softmax(mt.logits(model, prompt))
    scored = run.results[0].prompt_logprobs
    assert max(abs(s.logprob - ref[t - 1, prompt[t]]) for t, s in enumerate(scored[1:], 1)) \
        < TOLERANCE
