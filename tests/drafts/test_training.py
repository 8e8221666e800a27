"""Training a draft: every backward against finite differences, Adam, and the draft as a Model;
and the settings' bounds at the boundary (a draft of every layer, exactly one batch of
positions, an infinite learning rate), what a seed fixes, the dtypes the training and the
draft keep, closeness's float64 arithmetic, and the whole refusal of a model with its own
lm_head."""
from dataclasses import replace

import numpy as np
import pytest

import minitransformer as mt
from minitransformer.backend import to_device, to_numpy
from minitransformer.checkpoints.synth import make_checkpoint, qwen2_config
from minitransformer.drafts import training as tr
from minitransformer.drafts.distill import distillation_loss, hard_label_grad, hard_label_loss
from minitransformer.logprobs import log_softmax
from minitransformer.model import forward
from minitransformer.speculative import first_layers, speculative_generate


def numeric_grad(f, x, h=1e-6):
    """Central differences of the scalar f() with respect to every entry of x (changed in place
    and restored)."""
    g = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        keep = x[i]
        x[i] = keep + h
        up = f()
        x[i] = keep - h
        down = f()
        x[i] = keep
        g[i] = (up - down) / (2 * h)
    return g


def close(analytic, numeric):
    np.testing.assert_allclose(analytic, numeric, rtol=1e-6, atol=1e-8)


@pytest.fixture
def rng():
    return np.random.default_rng(0)


def test_linear_backward(rng):
    x, w, c = rng.normal(size=(2, 3, 4)), rng.normal(size=(5, 4)), rng.normal(size=(2, 3, 5))
    dx, dw = tr.linear_backward(x, w, c)
    close(dx, numeric_grad(lambda: (tr.linear_forward(x, w) * c).sum(), x))
    close(dw, numeric_grad(lambda: (tr.linear_forward(x, w) * c).sum(), w))


def test_rms_norm_backward_and_forward_is_the_models(rng):
    x, g, c = rng.normal(size=(3, 6)), rng.normal(size=6), rng.normal(size=(3, 6))
    eps = 1e-5
    y, r = tr.rms_norm_forward(x, g, eps)
    model_y = to_numpy(mt.model.rms_norm(to_device(x), to_device(g), eps))
    np.testing.assert_allclose(y, model_y, rtol=1e-14)
    dx, dg = tr.rms_norm_backward(x, g, r, c)
    close(dx, numeric_grad(lambda: (tr.rms_norm_forward(x, g, eps)[0] * c).sum(), x))
    close(dg, numeric_grad(lambda: (tr.rms_norm_forward(x, g, eps)[0] * c).sum(), g))


def test_silu_backward_and_forward_is_the_models(rng):
    x, c = rng.normal(0, 4, size=(4, 7)), rng.normal(size=(4, 7))
    np.testing.assert_allclose(tr.silu_forward(x), to_numpy(mt.model.silu(to_device(x))),
                               rtol=1e-14)
    close(tr.silu_backward(x, c), numeric_grad(lambda: (tr.silu_forward(x) * c).sum(), x))
    # far out on both sides: no overflow, slopes 0 and 1
    np.testing.assert_allclose(tr.silu_backward(np.array([-200.0, 200.0]), 1.0), [0.0, 1.0])


def small_piece(rng, D=6, F=5):
    return {"norm": rng.normal(1, 0.1, D), "gate": rng.normal(0, 0.5, (F, D)),
            "up": rng.normal(0, 0.5, (F, D)), "down": rng.normal(0, 0.5, (D, F))}


def test_piece_backward(rng):
    params, h, c = small_piece(rng), rng.normal(size=(3, 6)), rng.normal(size=(3, 6))
    o, saved = tr.piece(params, h, 1e-5)
    dh, grads = tr.piece_backward(params, saved, c)

    def loss():
        return (tr.piece(params, h, 1e-5)[0] * c).sum()

    close(dh, numeric_grad(loss, h))
    assert set(grads) == set(params) == set(tr.PIECE)
    for name in params:
        assert grads[name].shape == params[name].shape
        close(grads[name], numeric_grad(loss, params[name]))


def test_head_backward(rng):
    E, f, c = rng.normal(size=(9, 4)), rng.normal(size=(3, 4)), rng.normal(size=(3, 9))
    close(tr.head_backward(E, c), numeric_grad(lambda: (tr.linear_forward(f, E) * c).sum(), f))


def test_hard_label_loss_and_grad(rng):
    s, z = rng.normal(size=(3, 8)), rng.normal(size=(3, 8))
    labels = z.argmax(axis=-1)
    expected = -log_softmax(s)[np.arange(3), labels].mean()
    assert hard_label_loss(s, z) == pytest.approx(expected, rel=1e-14)
    close(hard_label_grad(s, z), numeric_grad(lambda: hard_label_loss(s, z), s))
    with pytest.raises(ValueError, match="differ in shape"):
        hard_label_loss(s, z[:2])


@pytest.mark.parametrize("labels", [tr.Labels("soft", 1.0), tr.Labels("soft", 2.0),
                                    tr.Labels("hard")])
def test_the_whole_backward_pass(rng, labels):
    """loss_and_grads: the piece, the frozen final norm and head, the loss: against finite
    differences of the loss itself, in float64."""
    D, V = 6, 11
    params, h = small_piece(rng, D), rng.normal(size=(4, D))
    frozen = tr.Frozen(rng.normal(size=(V, D)), rng.normal(1, 0.1, D), 1e-5)
    z = rng.normal(0, 2, size=(4, V))
    _, grads = tr.loss_and_grads(params, frozen, h, z, labels)

    def loss():
        return labels.loss_and_grad(tr.logits(params, frozen, h)[0], z)[0]
    for name in params:
        close(grads[name], numeric_grad(loss, params[name]))


def test_adam_by_hand():
    """First step: m_hat = g, v_hat = g^2, so every parameter moves by lr * sign(g) (almost)."""
    params, grads = {"w": np.array([1.0, 2.0, -3.0])}, {"w": np.array([0.5, -4.0, 1e-3])}
    adam = tr.Adam(lr=0.1)
    adam.step(params, grads)
    np.testing.assert_allclose(params["w"], [0.9, 2.1, -3.1], rtol=1e-4)
    # second step, by the formulas
    g2 = np.array([1.0, 1.0, 1.0])
    m = 0.9 * 0.1 * grads["w"] + 0.1 * g2
    v = 0.999 * 0.001 * grads["w"] ** 2 + 0.001 * g2 ** 2
    expected = params["w"] - 0.1 * (m / (1 - 0.81)) / (np.sqrt(v / (1 - 0.999 ** 2)) + 1e-8)
    adam.step(params, {"w": g2})
    np.testing.assert_allclose(params["w"], expected, rtol=1e-12)
    with pytest.raises(ValueError, match="learning rate"):
        tr.Adam(lr=0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    make_checkpoint(path, qwen2_config(vocab_size=64, hidden_size=32, intermediate_size=48,
                                       num_hidden_layers=3), seed=3)
    return mt.load(path)


def test_untrained_draft_is_the_cut_and_the_training_forward_is_the_models(tiny):
    ids = np.arange(1, 13) % 64
    start = tr.start_params(tiny, 1)                                  # layer 1 of a 2-layer cut
    draft = tr.draft_model(tiny, 2, start)
    cut = first_layers(tiny, 2)
    np.testing.assert_array_equal(mt.logits(draft, ids), mt.logits(cut, ids))
    # shared, not copied: the target's layers before the trained block, its embedding
    assert draft.layers[0] is tiny.layers[0]
    assert draft.weights["model.embed_tokens.weight"] is tiny.weights["model.embed_tokens.weight"]
    assert draft.layers[1].gate_up is not tiny.layers[1].gate_up
    h, final = tr.draft_inputs(tiny, 2, ids)
    np.testing.assert_allclose(final, to_numpy(forward(tiny, ids[None])[0]), rtol=1e-6, atol=1e-6)
    frozen = tr.Frozen.of(tiny)
    s, _ = tr.logits(start, frozen, h)
    np.testing.assert_allclose(s, mt.logits(cut, ids), rtol=1e-5, atol=1e-5)
    # changed parameters reach the model, and the target is left as it was
    params = {k: w + 0.1 for k, w in start.items()}
    before = mt.logits(tiny, ids)
    s, _ = tr.logits(params, frozen, h)
    np.testing.assert_allclose(s, mt.logits(tr.draft_model(tiny, 2, params), ids),
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(mt.logits(tiny, ids), before)
    np.testing.assert_array_equal(mt.logits(tr.draft_model(tiny, 2, start), ids),
                                  mt.logits(cut, ids))


def test_training_brings_the_student_closer_and_the_draft_is_exact(tiny):
    rng = np.random.default_rng(1)
    train_ids, held_ids = rng.integers(0, 64, 96), rng.integers(0, 64, 48)
    k, frozen = 1, tr.Frozen.of(tiny)
    h, teacher = tr.draft_inputs(tiny, k, train_ids)
    h_held, teacher_held = tr.draft_inputs(tiny, k, held_ids)
    start = tr.start_params(tiny, 2)                     # the last layer's block, at layer 0
    students = {"soft": tr.Labels("soft", 1.0), "hard": tr.Labels("hard")}
    seen = []
    trained = tr.train(students, start, frozen, h, teacher, tr.Schedule(40, batch=16, lr=3e-3),
                       on_step=lambda step, params, losses: seen.append((step, losses)))
    assert [s for s, _ in seen] == list(range(1, 41)) and set(seen[0][1]) == set(students)
    z_held = tr.teacher_logits(frozen, teacher_held)
    before = tr.closeness(start, frozen, h_held, z_held)
    after = tr.closeness(trained["soft"], frozen, h_held, z_held)
    assert after["kl"] < 0.8 * before["kl"]
    assert 0 <= after["top1"] <= 1 and 0 < after["alpha"] <= 1
    # the start is untouched; the students differ only by their labels
    np.testing.assert_array_equal(start["gate"], tr.start_params(tiny, 2)["gate"])
    assert not np.array_equal(trained["soft"]["gate"], trained["hard"]["gate"])
    # the KL of closeness is distill.py's at T = 1
    s, _ = tr.logits(start, frozen, h_held)
    z = z_held
    assert before["kl"] == pytest.approx(distillation_loss(s, z, 1.0), rel=1e-9)
    # the trained draft is an ordinary Model: speculative decoding keeps greedy's tokens
    draft = tr.draft_model(tiny, k, trained["soft"])
    prompt = [3, 5, 7, 11]
    plain = mt.generate(tiny, prompt, 24, eos_token_id=[])
    assert speculative_generate(tiny, draft, prompt, 24, gamma=3,
                                eos_token_id=[]).tokens == plain


def test_bad_settings_are_refused(tiny):
    with pytest.raises(ValueError, match=r"layer must be in 0\.\.2, got 3"):
        tr.start_params(tiny, 3)
    with pytest.raises(ValueError, match="1 <= k <= 3"):
        tr.draft_model(tiny, 0, tr.start_params(tiny, 0))
    with pytest.raises(ValueError, match="soft' or 'hard"):
        tr.Labels("medium")
    with pytest.raises(ValueError, match="temperature"):
        tr.Labels("soft", 0.0)
    h = np.zeros((4, 32), np.float32)
    with pytest.raises(ValueError, match="batch"):
        tr.train({}, tr.start_params(tiny, 1), tr.Frozen.of(tiny), h, h,
                 tr.Schedule(steps=1, batch=8, lr=1e-3))
    with pytest.raises(ValueError, match="steps"):
        tr.Schedule(steps=0, batch=2, lr=1e-3)


def test_the_scripts_train_cache_and_use_the_drafts(tmp_path, monkeypatch, run_script):
    """train_draft.py trains and caches; experiment 23 reuses the cache and prints the tables;
    experiment 22 puts the trained drafts beside the untrained cut, tokens identical."""
    from minitransformer.checkpoints.synth import train_tokenizer
    model = make_checkpoint(tmp_path / "model", qwen2_config(
        vocab_size=320, num_hidden_layers=3, max_position_embeddings=512), seed=5,
        tokenizer=train_tokenizer(vocab_size=300))
    text = tmp_path / "text.txt"
    text.write_text("The keeper climbed the steps and lit the lamp at dusk. " * 60)
    monkeypatch.setenv("MT_WEIGHTS_DIR", str(tmp_path / "weights"))
    settings = ["--model", model, "--layers", 2, "--steps", 4, "--batch", 8,
                "--train-tokens", 128, "--held-tokens", 64, "--text", text]

    _, err = run_script("train_draft.py", *settings)
    assert "trained drafts cached" in err
    assert len(list((tmp_path / "weights" / "drafts").glob("*.npz"))) == 2  # teacher, students
    out, err = run_script("exp23_soft_labels.py", *settings)
    assert "trained drafts from" in err and "trained drafts cached" not in err
    for row in ("untrained cut", "start: the last layer's MLP block", "soft, T = 1",
                "soft, T = 2", "hard", "KL soft, T = 2", "soft (soft, T = "):
        assert row in out
    assert "Held-out KL to the teacher against training steps" in out
    import exp23_soft_labels  # the verdict printed is the one the figures decide
    from minitransformer.drafts import students as st
    students, = (tmp_path / "weights" / "drafts").glob("*-students-*.npz")
    figures = st.load(students, st.Settings()).figures
    verdict = exp23_soft_labels.verdict(figures)
    assert len(verdict) == 2 and all(line in out.splitlines() for line in verdict)
    out, _ = run_script("exp22_speculative.py", *settings, "--schemes", "int8-row",
                        "--no-layers-draft", "--new-tokens", 12, "--repeats", 1,
                        "--max-gamma", 3, "--distilled", "cut,soft2,hard")
    for row in ("first 2 of 3 layers", "first 2, distilled (soft, T = 2)",
                "first 2, distilled (hard)", "identical to plain greedy in every run: yes"):
        assert row in out
    assert "distilled (soft, T = 1)" not in out
    _, err = run_script("exp22_speculative.py", "--distilled", "soft3", status=2)
    assert "unknown distilled draft(s) soft3" in err
    _, err = run_script("train_draft.py", *settings[:-2], "--text", tmp_path / "none.txt",
                        status=2)
    assert "none.txt" in err


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
