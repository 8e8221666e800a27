"""Batched decode: B sequences of different lengths in one step. Batch-invariant mode gives each
row the bits it gets alone; the default fast mode gives the same logits within float rounding
and the same tokens except at near ties (conftest.assert_like_solo)."""

import numpy as np
import pytest

import conftest
import minitransformer as mt
from conftest import assert_like_solo
from minitransformer.checkpoints.synth import make_checkpoint, qwen2_config
from minitransformer.generate import last_logits, last_logits_alone
from minitransformer.kvcache import KVCache
from minitransformer.model import forward
from minitransformer.sampling import SamplingSettings, next_token
from minitransformer.serve.paged import PagedCache


def decode_step(model, tokens, cache, batch_invariant=False):
    """One new token per row, (B,) -> logits (B, V): forward with T = 1, then the head
    (batch-invariant: row by row, each as a batch of one)."""
    step = last_logits_alone if batch_invariant else last_logits
    return step(model, np.asarray(tokens).reshape(-1, 1), cache)


def solo_decode_logits(model, prompt, token):
    """Prefill the prompt alone, then decode one token: logits (V,), as generate computes."""
    kv = KVCache.allocate(model.config, 1, len(prompt) + 1)
    forward(model, np.array([prompt]), kv)
    return last_logits(model, np.array([[token]]), kv)[0]


def paged_batch(model, prompts, block_size, batch_invariant=False):
    """Each prompt prefilled alone into one paged cache, allocated as the engine allocates
    it in that mode (batch-invariant: every pass reads its blocks gathered) -> the cache."""
    cache = PagedCache.allocate(model.config, sum(len(p) // block_size + 2 for p in prompts),
                                block_size, in_place=not batch_invariant)
    for i, prompt in enumerate(prompts):
        held = cache.books.add(i, prompt)
        forward(model, np.array([prompt[held:]]), cache.view([i]))
    return cache


@pytest.mark.usefixtures("step_threads")
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("batch_invariant", [True, False])
def test_decode_step_is_the_solo_step(tiny_model, block_size, batch_invariant):
    rng = np.random.default_rng(block_size)
    V = tiny_model.config.vocab_size
    lengths = [1, 3, 3, 8, 17, 40]  # equal lengths share an attention call, others do not
    prompts = [rng.integers(0, V, n).tolist() for n in lengths]
    tokens = rng.integers(0, V, len(prompts)).tolist()
    cache = paged_batch(tiny_model, prompts, block_size, batch_invariant)
    cache.books.make_room(range(len(prompts)), 1)
    batched = decode_step(tiny_model, tokens, cache.view(range(6)), batch_invariant)
    for row, (prompt, token) in enumerate(zip(prompts, tokens, strict=True)):
        expected = solo_decode_logits(tiny_model, prompt, token)
        assert batched[row].dtype == expected.dtype
        if batch_invariant:  # bit for bit
            assert np.array_equal(batched[row], expected), f"row {row} ({len(prompt)} tokens)"
        else:                # float rounding only
            np.testing.assert_allclose(batched[row], expected, rtol=1e-5, atol=1e-5)


def test_decode_step_on_the_contiguous_cache(tiny_model):
    """Same-length rows prefilled into a KVCache row by row (each row a batch of one), then
    decoded batch-invariant: bit for bit."""
    rng = np.random.default_rng(3)
    prompts = rng.integers(0, tiny_model.config.vocab_size, (4, 9))
    kv = KVCache.allocate(tiny_model.config, 4, 12)
    for row in range(4):
        forward(tiny_model, prompts[row:row + 1], kv.row(row))
    batched = decode_step(tiny_model, [5, 6, 7, 8], kv, batch_invariant=True)
    assert kv.lengths.tolist() == [10] * 4
    for row in range(4):
        assert np.array_equal(batched[row],
                              solo_decode_logits(tiny_model, prompts[row].tolist(), 5 + row))


@pytest.mark.usefixtures("step_threads")
@pytest.mark.parametrize("batch_invariant", [True, False])
def test_many_batched_steps_give_generate_s_tokens(tiny_model, batch_invariant):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, tiny_model.config.vocab_size, n).tolist() for n in (2, 5, 11, 30)]
    cache = PagedCache.allocate(tiny_model.config, 64, 4)
    tokens = []
    for i, prompt in enumerate(prompts):  # prefill alone: it picks the first token
        cache.books.add(i, prompt)
        tokens.append([int(np.argmax(last_logits(tiny_model, np.array([prompt]),
                                                 cache.view([i]))[0]))])
    for _ in range(19):                   # then 19 batched steps, greedy
        cache.books.make_room(range(4), 1)
        logits = decode_step(tiny_model, [t[-1] for t in tokens], cache.view(range(4)),
                             batch_invariant)
        for row, row_logits in enumerate(logits):
            tokens[row].append(int(np.argmax(row_logits)))
    for prompt, made in zip(prompts, tokens, strict=True):
        assert_like_solo(tiny_model, made, mt.generate(tiny_model, prompt, 20, eos_token_id=[]),
                         prompt, batch_invariant=batch_invariant, eos_token_id=[])


def test_long_rows_past_the_blas_size_switch(tmp_path):
    """Attention shaped like the default model's (8 q heads, 2 kv heads, d = 64), rows long
    enough (> 300 slots) that OpenBLAS picks another kernel for q @ k.T than for short rows:
    padding the short rows would change their bits; batch-invariant mode's rows alone keep
    them."""
    config = qwen2_config(hidden_size=64, intermediate_size=96, num_attention_heads=8,
                          num_key_value_heads=2, head_dim=64, max_position_embeddings=1024)
    model = mt.load(make_checkpoint(tmp_path / "wide-heads", config, seed=5))
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 96, n).tolist() for n in (5, 64, 64, 299, 301, 420)]
    tokens = rng.integers(0, 96, len(prompts)).tolist()
    cache = paged_batch(model, prompts, 16, batch_invariant=True)
    cache.books.make_room(range(len(prompts)), 1)
    batched = decode_step(model, tokens, cache.view(range(len(prompts))), batch_invariant=True)
    for row, (prompt, token) in enumerate(zip(prompts, tokens, strict=True)):
        assert np.array_equal(batched[row], solo_decode_logits(model, prompt, token)), row


def test_a_single_row_gets_the_same_bits_in_both_modes(tiny_model):
    """Batch 1 makes the very same calls either way (one (T, D) matrix per product): the solo
    reference is one, and last_logits_alone hands it back as it is."""
    ids = np.random.default_rng(4).integers(0, tiny_model.config.vocab_size, (1, 7))
    fast, exact = last_logits(tiny_model, ids), last_logits_alone(tiny_model, ids)
    assert np.array_equal(fast, exact)


def test_the_policy_allows_a_different_token_only_at_a_near_tie(tiny_model):
    never, greedy = dict(eos_token_id=[]), SamplingSettings()
    for first in range(tiny_model.config.vocab_size):   # a prompt whose step 1 is clearer
        prompt = [1, 2, first]                            # than its step 0 (the tiny models
        alone = mt.generate(tiny_model, prompt, 8, **never)   # repeat a token, less and
        gap = conftest.solo_margins(tiny_model, prompt, alone[:1], greedy, None)[0]  # less
        runner_up = int(np.argsort(mt.logits(tiny_model, prompt)[-1])[-2])    # sure of it)
        went_on = prompt + [runner_up]             # step 0 took the solo run's second choice,
        diverged = went_on[3:] + mt.generate(tiny_model, went_on, 7, **never)  # then went on
        later = conftest.solo_margins(tiny_model, went_on, diverged[1:], greedy, None)
        if later.max() > gap:
            break
    at = 0
    assert gap > conftest.NEAR_TIE and later.max() > gap   # clear choices: no excuse to differ
    with pytest.raises(AssertionError, match="not a near tie"):
        assert_like_solo(tiny_model, diverged, alone, prompt, **never)
    with pytest.raises(AssertionError):
        assert_like_solo(tiny_model, alone[:3], alone, prompt, **never)   # stopped early
    with pytest.raises(AssertionError):
        assert_like_solo(tiny_model, diverged, alone, prompt, batch_invariant=True, **never)
    assert_like_solo(tiny_model, diverged, alone, prompt, tolerance=gap, **never)  # wider
    assert conftest.NEAR_TIES.pop() == (3, at, gap)  # counted (and taken back off the report)
    # past the forgiven step the request is still checked, against the solo run continued
    # from the token taken: its clearest later choice, made otherwise, is not forgiven
    step = at + 1 + int(np.argmax(later))
    wrong = int(np.argsort(mt.logits(tiny_model, prompt + diverged[:step])[-1])[-2])
    with pytest.raises(AssertionError, match=f"token {step} differs"):
        assert_like_solo(tiny_model, diverged[:step] + [wrong] + diverged[step + 1:], alone,
                         prompt, tolerance=gap, **never)
    assert conftest.NEAR_TIES.pop() == (3, at, gap)
    with pytest.raises(AssertionError, match="one run stopped"):     # and its length
        assert_like_solo(tiny_model, diverged[:-1], alone, prompt, tolerance=gap, **never)
    assert conftest.NEAR_TIES.pop() == (3, at, gap)


@pytest.mark.parametrize("settings", [SamplingSettings(),
                                      SamplingSettings(do_sample=True, temperature=1.0),
                                      SamplingSettings(do_sample=True, temperature=0.5)])
def test_a_margin_is_the_logit_change_that_changes_the_choice(settings):
    """conftest.logit_margin against a direct search: moving every logit by 0.99 x the margin
    changes no choice; by 1.01 x, one way of moving them does. The worst way for a boundary k of
    the cumulative distribution raises the logits up to k and lowers the rest (greedy: raises
    the runner-up, lowers the top)."""
    rng, tried = np.random.default_rng(3), 0
    for trial in range(12):
        z = rng.normal(0, 1, 24).astype(np.float32)
        margin = conftest.logit_margin(z, [], settings, np.random.default_rng(trial)) \
            * np.abs(z).max()
        if margin < 1e-4:                  # within float32 rounding of the sum: nothing to see
            continue

        def chosen(shift):
            return next_token(z + shift.astype(np.float32), [], settings,
                              np.random.default_rng(trial))
        ways = [np.where(np.arange(z.size) <= k, sign, -sign)
                for k in range(z.size) for sign in (1.0, -1.0)]
        before = chosen(np.zeros(z.size))
        assert all(chosen(0.99 * margin * way) == before for way in ways), trial
        assert any(chosen(1.01 * margin * way) != before for way in ways), trial
        tried += 1
    assert tried >= 8


def test_bad_token_ids_are_refused(tiny_model):
    cache = paged_batch(tiny_model, [[1, 2]], 4)
    cache.books.make_room([0], 1)
    with pytest.raises(ValueError, match="token ids"):
        decode_step(tiny_model, [tiny_model.config.vocab_size], cache.view([0]))


def test_decode_without_room_is_refused(tiny_model):
    cache = paged_batch(tiny_model, [[1, 2, 3, 4]], 4)  # one full block, no room made
    with pytest.raises(ValueError, match="make_room"):
        decode_step(tiny_model, [1], cache.view([0]))
