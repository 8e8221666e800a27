"""Sampling rules, checked on hand-made logits where the right answer is easy to see, and at their
edges: each setting's legal range up to its end points, the penalty's sign rule for small
logits, top-k and top-p where the cut falls exactly on a token, ties at the cut, and draws that
must never land on a token of probability 0."""
import math
import warnings

import numpy as np
import pytest

from minitransformer.sampling import (
    SamplingSettings,
    apply_repetition_penalty,
    check_sampling,
    draw,
    next_token,
    probabilities,
)

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


class FixedDraw:
    """A generator whose random() returns the given numbers in turn: a draw at a chosen u."""

    def __init__(self, *u):
        self.u = list(u)

    def random(self):
        return self.u.pop(0)


@pytest.mark.parametrize("field, value", [
    ("temperature", math.inf), ("top_p", 1.5), ("top_p", 1 + 1e-12),
    ("repetition_penalty", 0.0), ("top_k", -1),
])
def test_each_setting_is_refused_just_past_its_range(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingSettings(do_sample=True, **{field: value})


@pytest.mark.parametrize("field, value", [
    ("temperature", 0.0), ("top_p", 1.0), ("top_k", 0), ("repetition_penalty", 1e-300),
])
def test_each_setting_is_accepted_at_the_edge_of_its_range(field, value):
    assert getattr(SamplingSettings(do_sample=True, **{field: value}), field) == value


def test_the_penalty_divides_every_positive_logit_even_below_one():
    logits = np.array([0.5, 0.25, -0.5, 0.0, 4.0], dtype=np.float32)
    out = apply_repetition_penalty(logits, [0, 1, 2, 3], 2.0)
    np.testing.assert_array_equal(out, [0.25, 0.125, -1.0, 0.0, 4.0])


def test_a_penalty_with_nothing_before_changes_nothing():
    logits = np.array([0.5, -1.0, 2.0], dtype=np.float32)
    np.testing.assert_array_equal(apply_repetition_penalty(logits, [], 1.3), logits)
    assert next_token(logits, [], SamplingSettings(repetition_penalty=1.3), None) == 2


def test_top_k_one_is_the_argmax_alone():
    logits = np.log(np.array([0.1, 0.6, 0.3], dtype=np.float32))
    p = probabilities(logits, SamplingSettings(do_sample=True, top_k=1))
    np.testing.assert_array_equal(p, [0.0, 1.0, 0.0])


@pytest.mark.parametrize("k", [1, 7, 50, 999])
def test_top_k_keeps_exactly_the_k_largest_of_many(k):
    """1000 random logits (a vocabulary's worth, where a partition leaves most of the array
    unordered): the kept set is the k largest, found by sorting."""
    logits = np.random.default_rng(k).normal(size=1000).astype(np.float32)
    p = probabilities(logits, SamplingSettings(do_sample=True, top_k=k))
    assert set(np.flatnonzero(p)) == set(np.argsort(logits)[-k:])


def test_top_p_stops_where_the_mass_reaches_p_exactly():
    """Four equal tokens, p = 0.5: two of them reach it exactly (0.25 + 0.25, no rounding);
    a third is not needed."""
    p = probabilities(np.zeros(4, np.float32), SamplingSettings(do_sample=True, top_p=0.5))
    np.testing.assert_array_equal(p, [0.5, 0.5, 0.0, 0.0])


def test_top_p_one_cuts_nothing_however_small_a_token():
    """The two large tokens already hold all the mass float64 can count (0.5 + 0.5 = 1.0); the
    third, about 5e-21, must keep its probability under top_p = 1 all the same."""
    logits = np.array([0.0, 0.0, -46.0], dtype=np.float32)
    p = probabilities(logits, SamplingSettings(do_sample=True, top_p=1.0))
    assert p[2] > 0
    np.testing.assert_allclose(p[2], np.exp(-46.0) / 2, rtol=1e-5)


def test_ties_at_the_top_p_cut_go_to_the_lower_token_ids():
    """64 tokens on three logit levels, p = 0.5: the cut falls inside a level. Kept: every
    token above that level, and of the level's tokens the lowest ids, as many as the mass
    needs (not whichever ones an unstable sort happens to put first)."""
    logits = np.random.default_rng(0).integers(0, 3, 64).astype(np.float32)
    p = probabilities(logits, SamplingSettings(do_sample=True, top_p=0.5))
    kept = np.flatnonzero(p)
    cut = logits[kept].min()                                  # the level the cut falls in
    assert set(np.flatnonzero(logits > cut)) <= set(kept)
    level = np.flatnonzero(logits == cut)
    at_cut = [i for i in kept if logits[i] == cut]
    assert 0 < len(at_cut) < len(level)                       # the cut splits a tie
    np.testing.assert_array_equal(at_cut, level[:len(at_cut)])


def test_the_distribution_is_float32():
    assert probabilities(np.zeros(3, np.float32), SamplingSettings(do_sample=True)).dtype \
        == np.float32


def test_a_tiny_temperature_raises_no_floating_point_warning():
    """(z - max) / 5e-324 overflows float64 to -inf on purpose; a server must not log a
    warning for it."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        p = probabilities(np.array([1.0, 3.0, 2.0], np.float32),
                          SamplingSettings(do_sample=True, temperature=5e-324))
    np.testing.assert_array_equal(p, [0.0, 1.0, 0.0])


def test_a_token_of_probability_zero_is_never_drawn_even_at_u_zero():
    assert draw(np.array([0.0, 0.5, 0.5], np.float32), FixedDraw(0.0)) == 1
    assert draw(np.array([0.5, 0.0, 0.5], np.float32), FixedDraw(0.5)) == 2


def test_draw_follows_weights_that_do_not_sum_to_one():
    """The speculative residual max(0, p - q) is drawn from as it is: draw scales u by the
    total. Weights 0.1 and 0.3 (total 0.4): token 0 below u = 0.25, token 1 above."""
    weights = np.array([0.1, 0.3], np.float32)
    assert draw(weights, FixedDraw(0.24)) == 0
    assert draw(weights, FixedDraw(0.26)) == 1
    assert draw(weights, FixedDraw(0.99)) == 1


def test_bad_logits_say_what_to_suspect():
    with pytest.raises(ValueError, match=r"NaN or \+inf \(max nan\): the model's numbers "
                                         r"overflowed or its weights are broken$"):
        next_token(np.array([np.nan, 1.0], np.float32), [], SamplingSettings(), None)


def test_sampling_is_given_as_settings_or_refused_by_name():
    settings = SamplingSettings(do_sample=True, top_k=3)
    assert check_sampling(settings) is settings
    with pytest.raises(ValueError, match="sampling must be a SamplingSettings, got"):
        check_sampling({"do_sample": True})


@pytest.mark.parametrize("bad", ["no", 1, None, 0.0])
def test_do_sample_is_a_flag_not_a_truth_value(bad):
    """do_sample="no" is true to Python: taken as it is, it would sample silently."""
    with pytest.raises(ValueError, match=r"^do_sample must be True or False, got "):
        SamplingSettings(do_sample=bad)
    assert SamplingSettings(do_sample=np.bool_(True)).do_sample
