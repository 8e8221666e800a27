"""Sampling rules, checked on hand-made logits where the right answer is easy to see."""
import numpy as np
import pytest

from minitransformer.sampling import (SamplingSettings, apply_repetition_penalty, draw,
                                      next_token, probabilities)

LOGITS = np.log(np.array([0.5, 0.2, 0.15, 0.1, 0.05], dtype=np.float32))


def test_repetition_penalty_divides_positive_and_multiplies_negative():
    logits = np.array([2.0, -1.0, 0.5, 3.0], dtype=np.float32)
    out = apply_repetition_penalty(logits, [0, 1, 1], 2.0)
    np.testing.assert_array_equal(out, [1.0, -2.0, 0.5, 3.0])
    np.testing.assert_array_equal(logits, [2.0, -1.0, 0.5, 3.0])  # input untouched


def test_top_k_keeps_k_most_likely():
    p = probabilities(LOGITS, SamplingSettings(do_sample=True, top_k=2))
    np.testing.assert_allclose(p, [0.5 / 0.7, 0.2 / 0.7, 0, 0, 0], rtol=1e-6)


def test_top_p_keeps_smallest_set_reaching_p():
    # 0.5 + 0.2 = 0.7 < 0.75, so 0.15 is needed too; 0.85 >= 0.75 stops there.
    p = probabilities(LOGITS, SamplingSettings(do_sample=True, top_p=0.75))
    np.testing.assert_allclose(p, np.array([0.5, 0.2, 0.15, 0, 0]) / 0.85, rtol=1e-6)
    p = probabilities(LOGITS, SamplingSettings(do_sample=True, top_p=0.01))
    np.testing.assert_array_equal(p > 0, [True, False, False, False, False])


def test_temperature_sharpens_and_flattens():
    cold = probabilities(LOGITS, SamplingSettings(do_sample=True, temperature=0.5))
    hot = probabilities(LOGITS, SamplingSettings(do_sample=True, temperature=2.0))
    p = np.array([0.5, 0.2, 0.15, 0.1, 0.05])
    np.testing.assert_allclose(cold, p ** 2 / (p ** 2).sum(), rtol=1e-5)
    np.testing.assert_allclose(hot, np.sqrt(p) / np.sqrt(p).sum(), rtol=1e-5)


def test_draw_follows_the_distribution():
    rng = np.random.default_rng(0)
    p = np.array([0.5, 0.0, 0.3, 0.2], dtype=np.float32)
    counts = np.bincount([draw(p, rng) for _ in range(20000)], minlength=4)
    assert counts[1] == 0
    np.testing.assert_allclose(counts / 20000, p, atol=0.015)


def test_greedy_ignores_temperature_and_temperature_zero_is_greedy():
    rng = np.random.default_rng(0)
    assert next_token(LOGITS, [], SamplingSettings(temperature=5.0), rng) == 0
    assert next_token(LOGITS, [], SamplingSettings(do_sample=True, temperature=0), rng) == 0
    # the penalty applies to greedy decoding too (as in Hugging Face)
    assert next_token(LOGITS, [0], SamplingSettings(repetition_penalty=10.0), rng) == 1


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-1), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(top_k=1.5), "top_k"), (dict(top_k=True), "top_k"), (dict(top_p=0), "top_p"),
    (dict(repetition_penalty=-1), "repetition_penalty"),
])
def test_bad_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingSettings(do_sample=True, **kwargs)
