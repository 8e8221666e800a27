"""Training a draft at its edges: the settings' bounds at the boundary (a draft of every layer,
exactly one batch of positions, an infinite learning rate), what a seed fixes, the dtypes the
training and the draft keep, closeness's float64 arithmetic, and the whole refusal of a model
with its own lm_head. Each test kills a mutant of drafts/training.py that
tests/drafts/test_training.py and tests/drafts/test_distill_metrics.py let through (scripts/mutation.py training)."""
from dataclasses import replace

import numpy as np
import pytest

import minitransformer as mt
from minitransformer.backend import to_numpy
from minitransformer.drafts import training as tr
from minitransformer.checkpoints.synth import make_checkpoint, qwen2_config
from test_training import tiny  # noqa: F401 (the fixture: a 3-layer model, vocabulary 64)


def test_a_draft_of_every_layer_is_the_target(tiny):
    """k = L is a draft (the largest k the message allows): the target's own layers, with its
    last MLP block as the trained piece's start, gives the target's logits bit for bit."""
    L = tiny.config.num_hidden_layers
    assert tr.check_layers(tiny, L) == L
    ids = np.arange(1, 11) % 64
    draft = tr.draft_model(tiny, L, tr.start_params(tiny, L - 1))
    np.testing.assert_array_equal(mt.logits(draft, ids), mt.logits(tiny, ids))
    h, final = tr.draft_inputs(tiny, L, ids)
    assert h.shape == final.shape == (len(ids), tiny.config.hidden_size)


def test_exactly_one_batch_of_positions_trains(tiny):
    """N positions and a batch of N: allowed (one batch is enough), and each step sees every
    position once, so the step does not depend on the draw's order."""
    frozen, start = tr.Frozen.of(tiny), tr.start_params(tiny, 0)
    h, teacher = tr.draft_inputs(tiny, 1, np.arange(1, 9) % 64)       # 8 positions
    students = {"soft": tr.Labels("soft", 1.0)}
    one = tr.train(students, start, frozen, h, teacher, tr.Schedule(2, batch=8, lr=1e-3, seed=0))
    other = tr.train(students, start, frozen, h, teacher, tr.Schedule(2, batch=8, lr=1e-3, seed=9))
    assert not np.array_equal(one["soft"]["gate"], start["gate"])
    for name in start:
        np.testing.assert_allclose(one["soft"][name], other["soft"][name], rtol=1e-5, atol=1e-7)


def test_the_seed_fixes_the_order_of_the_batches(tiny):
    """The same seed: the same batches, so the same parameters bit for bit; another seed: other
    batches (of 4 out of 24 positions), so other parameters."""
    frozen, start = tr.Frozen.of(tiny), tr.start_params(tiny, 0)
    h, teacher = tr.draft_inputs(tiny, 1, np.arange(1, 25) % 64)
    students = {"hard": tr.Labels("hard")}

    def trained(seed):
        return tr.train(students, start, frozen, h, teacher,
                        tr.Schedule(3, batch=4, lr=1e-2, seed=seed))["hard"]
    a, b, c = trained(7), trained(7), trained(8)
    assert all(np.array_equal(a[name], b[name]) for name in start)
    assert not all(np.array_equal(a[name], c[name]) for name in start)


def test_the_learning_rate_must_be_finite():
    for lr in (float("inf"), float("nan"), 0.0, -1e-3):
        with pytest.raises(ValueError, match=r"learning rate must be a finite number > 0, got"):
            tr.Adam(lr=lr)


def test_training_runs_in_float32_and_the_draft_keeps_float32_weights(tiny):
    """The gradients are the float32 parameters' dtype (the loss's float64 gradient is cast
    before the head's backward, a (N, V) x (V, D) product), and a draft made from float64
    parameters holds them as float32, as every weight of a model is (loader.py)."""
    frozen, start = tr.Frozen.of(tiny), tr.start_params(tiny, 1)
    h, teacher = tr.draft_inputs(tiny, 2, np.arange(1, 9) % 64)
    z = tr.teacher_logits(frozen, teacher)
    for labels in (tr.Labels("soft", 2.0), tr.Labels("hard")):
        _, grads = tr.loss_and_grads(start, frozen, h, z, labels)
        assert {name: g.dtype for name, g in grads.items()} == dict.fromkeys(start, np.float32)
    wide = {name: w.astype(np.float64) + 0.01 for name, w in start.items()}
    draft = tr.draft_model(tiny, 2, wide)
    for name, short in tr.PIECE.items():
        w = to_numpy(draft.weights[f"model.layers.1.{short}"])
        assert w.dtype == np.float32 and np.array_equal(w, wide[name].astype(np.float32))


def test_closeness_is_computed_in_float64(monkeypatch):
    """A student a thousandth of a logit from its teacher: KL about 1e-7, of the order of
    float32's rounding of a log-probability. closeness matches the direct float64 computation
    from the same float32 logits to 1e-6 relative (in float32 the figure is off by tens of
    percent)."""
    rng = np.random.default_rng(0)
    z = (3 * rng.standard_normal((6, 50))).astype(np.float32)
    s = (z + 1e-3 * rng.standard_normal(z.shape)).astype(np.float32)
    monkeypatch.setattr(tr, "logits", lambda params, frozen, h: (s[h[:, 0].astype(int)], None))
    figures = tr.closeness({}, None, np.arange(6, dtype=np.float32)[:, None], z)

    def log_softmax(x):
        x = x.astype(np.float64)
        x = x - x.max(axis=-1, keepdims=True)
        return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))
    log_p, log_q = log_softmax(z), log_softmax(s)
    p, q = np.exp(log_p), np.exp(log_q)
    kl = (p * (log_p - log_q)).sum(axis=-1).mean()
    assert 1e-8 < kl < 1e-6
    assert figures["kl"] == pytest.approx(kl, rel=1e-6)
    assert figures["alpha"] == pytest.approx(np.minimum(p, q).sum(axis=-1).mean(), rel=1e-12)


def test_a_model_with_its_own_lm_head_is_refused_by_name(tmp_path):
    path = tmp_path / "untied"
    make_checkpoint(path, qwen2_config(tie_word_embeddings=False), seed=1)
    untied = mt.load(path)
    with pytest.raises(ValueError) as refused:
        tr.Frozen.of(untied)
    assert str(refused.value) == ("training a draft needs a tied head (the embedding matrix); "
                                  f"{untied.path} has a separate lm_head")
    with pytest.raises(ValueError) as refused:
        tr.Frozen.of(replace(untied, path=None))
    assert str(refused.value) == ("training a draft needs a tied head (the embedding matrix); "
                                  "this model has a separate lm_head")
