"""Distillation: soft labels under temperature, and the T^2-scaled KL loss and its gradient."""
from itertools import pairwise

import numpy as np
import pytest
from scipy.stats import entropy

from minitransformer.drafts.distill import (
    distillation_grad,
    distillation_loss,
    rank_ratio,
    soft_labels,
    top_tokens,
)

# The chapter's soft label for "She poured the milk into the" (its top 5; the rest of the mass
# is spread here over other tokens, each below the fifth).
CHAPTER_TOP5 = [0.1355, 0.1051, 0.0605, 0.0380, 0.0360]


def chapter_logits():
    rest = (1 - sum(CHAPTER_TOP5)) / 40
    return np.log(np.array(CHAPTER_TOP5 + [rest] * 40))


def test_chapter_ratio_and_its_square_root():
    z = chapter_logits()
    p1, p2 = soft_labels(z, 1.0), soft_labels(z, 2.0)
    np.testing.assert_allclose(p1[:5], CHAPTER_TOP5, rtol=1e-12)
    assert f"{rank_ratio(p1):.2f}" == "2.24"
    assert f"{rank_ratio(p2):.2f}" == "1.50"
    # T = 2 halves every logit gap, so every ratio becomes its square root; the order is kept
    assert rank_ratio(p2) == pytest.approx(np.sqrt(rank_ratio(p1)), rel=1e-12)
    assert top_tokens(p2, 5)[0].tolist() == top_tokens(p1, 5)[0].tolist() == [0, 1, 2, 3, 4]


def test_ratio_by_hand():
    z = np.log([4.0, 2.0, 1.0])  # p = 4/7, 2/7, 1/7
    assert rank_ratio(soft_labels(z, 1)) == pytest.approx(4.0, rel=1e-14)
    assert rank_ratio(soft_labels(z, 2)) == pytest.approx(2.0, rel=1e-14)
    assert rank_ratio(soft_labels(z, 0.5)) == pytest.approx(16.0, rel=1e-14)


def test_temperature_flattens_and_soft_labels_are_distributions():
    z = np.random.default_rng(0).normal(0, 3, (4, 50))
    ents = [entropy(soft_labels(z, T), axis=-1) for T in (0.5, 1, 2, 4, 100)]
    assert all((a < b).all() for a, b in pairwise(ents))
    assert ents[-1] == pytest.approx(np.log(50), rel=1e-2)  # very high T: nearly uniform
    np.testing.assert_allclose(soft_labels(z, 3).sum(axis=-1), 1.0, rtol=1e-14)
    # huge logits do not overflow
    assert np.isfinite(soft_labels(np.array([1e30, 0.0, -1e30]), 1)).all()


def test_top_tokens_order_and_ties():
    ids, probs = top_tokens(np.array([0.1, 0.3, 0.3, 0.2, 0.1]), 4)
    assert ids.tolist() == [1, 2, 3, 0] and probs.tolist() == [0.3, 0.3, 0.2, 0.1]


def random_pair(seed, shape=(3, 11)):
    rng = np.random.default_rng(seed)
    return rng.normal(0, 2, shape), rng.normal(0, 2, shape)


@pytest.mark.parametrize("T", [0.5, 1.0, 2.0, 5.0])
@pytest.mark.parametrize("shape", [(7,), (3, 11), (2, 2, 5)])
def test_gradient_matches_finite_differences(T, shape):
    s, z = random_pair(int(T * 10) + len(shape), shape)
    grad = distillation_grad(s, z, T)
    assert grad.shape == s.shape
    h = 1e-6
    numeric = np.zeros(s.size)
    for i in range(s.size):
        step = np.zeros(s.size)
        step[i] = h
        step = step.reshape(s.shape)
        up, down = distillation_loss(s + step, z, T), distillation_loss(s - step, z, T)
        numeric[i] = (up - down) / (2 * h)
    np.testing.assert_allclose(grad.reshape(-1), numeric, rtol=1e-5, atol=1e-9)


def test_loss_is_zero_exactly_when_the_distributions_agree():
    s, z = random_pair(1)
    for T in (0.5, 1.0, 3.0):
        assert distillation_loss(z, z, T) == 0.0
        assert not distillation_grad(z, z, T).any()
        # a constant shift per position changes no probability: zero up to rounding
        assert distillation_loss(z + np.array([[5.0], [-2.0], [0.5]]), z, T) < 1e-12
        assert distillation_loss(s, z, T) > 1e-3
    # one position differing is enough to make it positive
    near = z.copy()
    near[1, 4] += 0.01
    assert distillation_loss(near, z, 1.0) > 0


def test_the_t_squared_scaling():
    s, z = random_pair(2)
    for T in (0.5, 1.0, 2.0, 8.0):
        # independent KL: scipy's entropy(p, q), averaged over positions
        kl = entropy(soft_labels(z, T), soft_labels(s, T), axis=-1).mean()
        assert distillation_loss(s, z, T) == pytest.approx(T * T * kl, rel=1e-10)
    # why: at high T the scaled gradient tends to ((s - mean s) - (z - mean z)) / (V N),
    # independent of T; unscaled it would shrink like 1 / T^2
    V, N = s.shape[-1], s.shape[0]
    limit = ((s - s.mean(-1, keepdims=True)) - (z - z.mean(-1, keepdims=True))) / (V * N)
    for T in (1e3, 1e4):
        np.testing.assert_allclose(distillation_grad(s, z, T), limit, rtol=1e-2, atol=1e-6)


def test_bad_input_is_refused_clearly():
    s, z = random_pair(3)
    for T in (0, -1.0, float("inf"), float("nan"), True, "2"):
        with pytest.raises(ValueError, match="temperature"):
            distillation_loss(s, z, T)
    with pytest.raises(ValueError, match="shape"):
        distillation_loss(s, z[:2], 1.0)
    bad = z.copy()
    bad[0, 0] = np.nan
    with pytest.raises(ValueError, match="teacher logits contain inf or nan"):
        distillation_grad(s, bad, 1.0)
    with pytest.raises(ValueError, match="floats"):
        soft_labels(np.array([1, 2, 3]), 1.0)
    with pytest.raises(ValueError, match="vocabulary"):
        soft_labels(np.float64(1.0), 1.0)
    with pytest.raises(ValueError, match="k must be"):
        top_tokens(np.array([0.5, 0.5]), 3)


def test_exp23_script_prints_the_square_root(stories, run_script):
    import re
    out, _ = run_script("exp23_soft_labels", "--model", stories.path)
    m = re.search(r"top / third: (\S+) at T = 1, (\S+) at T = 2 \(square root of \S+ = (\S+)\)",
                  out)
    assert m and m.group(2) == m.group(3) and float(m.group(1)) > float(m.group(2)) > 1
    assert "T^2 KL (loss)" in out


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_one_pass_gives_the_loss_and_gradient_of_the_formulas(temperature):
    """distillation_loss_and_grad and hard_label_loss_and_grad (a training step's one pass)
    are, bit for bit, the formulas written out: T^2 KL(p_T || q_T) and T (q_T - p_T) / N; the
    cross-entropy on the argmax and (q - onehot) / N."""
    from minitransformer.drafts.distill import distillation_loss_and_grad, hard_label_loss_and_grad
    from minitransformer.logprobs import log_softmax
    rng = np.random.default_rng(3)
    s, z = rng.standard_normal((2, 6, 50)).astype(np.float32) * 3
    T = temperature
    log_q, log_p = (log_softmax(x.astype(np.float64) / T) for x in (s, z))
    loss, grad = distillation_loss_and_grad(s, z, T)
    assert loss == float(T * T * (np.exp(log_p) * (log_p - log_q)).sum(axis=-1).mean())
    assert np.array_equal(grad, T * (np.exp(log_q) - np.exp(log_p)) / 6)
    log_q, top = log_softmax(s.astype(np.float64)), z.argmax(axis=-1)
    loss, grad = hard_label_loss_and_grad(s, z)
    assert loss == float(-log_q[np.arange(6), top].mean())
    onehot = np.eye(50)[top]
    assert np.array_equal(grad, (np.exp(log_q) - onehot) / 6)
