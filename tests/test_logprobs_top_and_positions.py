"""Log-probabilities checked against a direct computation: the top k are the k largest by a
full sort (most likely first, ties to the lower id) for every k, a vocabulary's worth of
tokens included; each row of logits is normalised on its own; a prompt's position t scores
token t + 1 for every position, not only the first."""
import numpy as np
import pytest

from minitransformer.logprobs import log_softmax, prompt_logprobs, token_logprob


def direct(z):
    """log softmax in float64 by the textbook formula, one row."""
    z = np.asarray(z, np.float64)
    return z - z.max() - np.log(np.exp(z - z.max()).sum())


def ranked(z, k):
    """The k most likely ids by a full sort: log-probability down, then id up."""
    return sorted(range(len(z)), key=lambda i: (-z[i], i))[:k]


@pytest.mark.parametrize("k", [1, 2, 5, 20])
def test_the_top_k_are_the_k_largest_of_a_vocabulary(k):
    logits = np.random.default_rng(k).normal(size=1000).astype(np.float32)
    got = token_logprob(logits, token=3, k=k)
    assert [i for i, _ in got.top] == ranked(direct(logits), k)
    np.testing.assert_allclose([p for _, p in got.top], direct(logits)[ranked(direct(logits), k)],
                               rtol=0, atol=1e-12)


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_the_top_k_of_a_small_vocabulary_up_to_all_of_it(k):
    """V = 3, the largest logit last: k = 1 is it, k = V - 1 and k = V are sorted, and a k
    beyond V gives all V."""
    logits = np.array([0.5, -1.0, 2.0], np.float32)
    got = token_logprob(logits, token=0, k=k)
    assert [i for i, _ in got.top] == [2, 0, 1][:k]


def test_no_alternatives_unless_asked():
    z = np.array([0.5, -1.0, 2.0], np.float32)
    assert token_logprob(z, token=1).top == ()
    assert all(p.top == () for p in prompt_logprobs(np.stack([z, z, z]), [0, 1, 2])[1:])


def test_each_row_is_normalised_on_its_own():
    """Two rows 1000 apart: each row's log-probabilities are its own (a shared maximum would
    leave the lower row's exp at 0 and its log at -inf)."""
    rows = np.array([[0.0, 1.0, 2.0], [1000.0, 1001.0, 1002.0]], np.float32)
    out = log_softmax(rows)
    assert out.dtype == np.float64
    np.testing.assert_allclose(out[0], direct(rows[0]), rtol=0, atol=1e-12)
    np.testing.assert_allclose(out[1], direct(rows[1]), rtol=0, atol=1e-12)


def test_log_softmax_is_float64_on_float32_logits():
    """Computed in float64 as documented: the float32 formula's error (about 1e-7) would show."""
    z = np.random.default_rng(0).normal(size=50).astype(np.float32) * 10
    out = log_softmax(z)
    assert out.dtype == np.float64
    np.testing.assert_allclose(out, direct(z), rtol=0, atol=1e-12)


def test_every_prompt_position_scores_the_next_token_with_its_top_k():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(5, 30)).astype(np.float32)
    ids = [4, 9, 0, 17, 29]
    got = prompt_logprobs(logits, ids, k=2)
    assert len(got) == 5 and got[0] is None
    for t in range(4):
        assert got[t + 1].token == ids[t + 1]
        assert got[t + 1].logprob == pytest.approx(direct(logits[t])[ids[t + 1]], abs=1e-12)
        assert [i for i, _ in got[t + 1].top] == ranked(direct(logits[t]), 2)
