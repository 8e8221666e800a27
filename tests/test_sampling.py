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


# Tiny legal settings: a temperature below float32's range (1e-38) or a top_p below its
# smallest subnormal (1.4e-45) once gave NaN probabilities and always the last id.
TIED = np.array([1.0, 3.0, 2.0, 3.0, -1.0], dtype=np.float32)


@pytest.mark.parametrize("settings", [
    SamplingSettings(do_sample=True, temperature=1e-39),
    SamplingSettings(do_sample=True, temperature=5e-324),
    SamplingSettings(do_sample=True, temperature=1e-30, top_k=3),
    SamplingSettings(do_sample=True, top_p=1e-46),
    SamplingSettings(do_sample=True, top_p=5e-324, temperature=1e-300),
])
def test_tiny_settings_degrade_to_greedy_not_to_nan(settings):
    p = probabilities(TIED, settings)
    assert np.isfinite(p).all() and p.sum() == pytest.approx(1.0)
    assert set(np.flatnonzero(p)) <= {1, 3}  # only the tied maxima keep any mass
    drawn = {next_token(TIED, [], settings, np.random.default_rng(seed)) for seed in range(40)}
    assert drawn <= {1, 3}
    strict = np.array([1.0, 3.0, 2.0, 2.5], dtype=np.float32)  # one maximum: always it
    assert {next_token(strict, [], settings, np.random.default_rng(s)) for s in range(20)} == {1}


def test_numpy_scalars_are_accepted_as_settings():
    s = SamplingSettings(np.bool_(True), np.float32(0.5), np.int64(2), np.float64(0.9),
                         np.float32(1.1))
    ref = SamplingSettings(True, 0.5, 2, 0.9, float(np.float32(1.1)))
    np.testing.assert_array_equal(probabilities(LOGITS, s), probabilities(LOGITS, ref))


@pytest.mark.parametrize("field, value", [("temperature", True), ("temperature", "0.5"),
                                          ("top_k", 2.0), ("top_p", np.float32(np.nan)),
                                          ("repetition_penalty", np.inf)])
def test_bad_settings_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingSettings(do_sample=True, **{field: value})


def test_nan_logits_are_an_error_not_token_zero():
    with pytest.raises(ValueError, match="NaN"):
        next_token(np.array([np.nan, 1.0], np.float32), [], SamplingSettings(), None)
