"""Distillation's figures are what they say: closeness's KL, top-1 agreement and alpha against a
direct computation on hand-made distributions; the students' held-out figures computed on token
positions disjoint from those it trained on; and the verdict line as the figures decide it."""
import numpy as np
import pytest

import minitransformer as mt
from minitransformer.checkpoints.synth import make_checkpoint, qwen2_config
from minitransformer.drafts import training as tr

# Two positions over a vocabulary of 3, the teacher's p and the student's q written out:
P = np.array([[0.7, 0.2, 0.1], [0.1, 0.6, 0.3]])
Q = np.array([[0.2, 0.5, 0.3], [0.2, 0.5, 0.3]])
# position 0: the argmaxes (0 and 1) differ; position 1: both are 1. By hand:
TOP1 = (0 + 1) / 2
ALPHA = ((0.2 + 0.2 + 0.1) + (0.1 + 0.5 + 0.3)) / 2              # sum min(p, q): 0.5 and 0.9
KL = ((0.7 * np.log(0.7 / 0.2) + 0.2 * np.log(0.2 / 0.5) + 0.1 * np.log(0.1 / 0.3))
      + (0.1 * np.log(0.1 / 0.2) + 0.6 * np.log(0.6 / 0.5) + 0.3 * np.log(0.3 / 0.3))) / 2


@pytest.mark.parametrize("chunk", [128, 1])
def test_closeness_by_hand(monkeypatch, chunk):
    """The student's logits fixed to log Q + a constant per row (softmax ignores it), the
    teacher's to log P + 5: every figure as worked out by hand above, in one chunk or two."""
    h = np.array([[0.0], [1.0]], np.float32)                         # (2, 1): the row's index

    def student(params, frozen, h_rows):
        rows = h_rows[:, 0].astype(int)
        return (np.log(Q[rows]) + np.array([1.0, -2.0])[rows, None]).astype(np.float32), None
    monkeypatch.setattr(tr, "logits", student)
    figures = tr.closeness({}, None, h, (np.log(P) + 5).astype(np.float32), chunk=chunk)
    assert figures["top1"] == TOP1
    assert figures["alpha"] == pytest.approx(ALPHA, abs=1e-6)
    assert figures["kl"] == pytest.approx(KL, abs=1e-6)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp("close") / "m",
                           qwen2_config(num_hidden_layers=2), seed=4)
    return mt.load(path)


def test_closeness_of_a_student_with_itself_and_with_another(small):
    """On a tiny model's real draft: a teacher whose logits are the student's gives KL 0,
    top-1 1, alpha 1; one whose argmax is moved at every other position gives top-1 1/2, and
    alpha and KL as computed directly from the two distributions (and far from 1 and 0)."""
    h, _ = tr.draft_inputs(small, 1, np.arange(1, 21) % 96)
    frozen, params = tr.Frozen.of(small), tr.start_params(small, 0)
    s, _ = tr.logits(params, frozen, h)                              # (20, V) float32
    same = tr.closeness(params, frozen, h, s)
    assert same["top1"] == 1 and same["kl"] == pytest.approx(0, abs=1e-9)
    assert same["alpha"] == pytest.approx(1, abs=1e-9)
    z = s.copy()
    rows = np.arange(0, len(z), 2)
    z[rows, (s[rows].argmax(axis=-1) + 1) % z.shape[1]] = s[rows].max(axis=-1) + 4.0
    figures = tr.closeness(params, frozen, h, z, chunk=7)
    p, q = (np.exp(x - x.max(axis=-1, keepdims=True)).astype(np.float64) for x in (z, s))
    p, q = p / p.sum(axis=-1, keepdims=True), q / q.sum(axis=-1, keepdims=True)
    assert figures["top1"] == 0.5
    assert figures["alpha"] == pytest.approx(np.minimum(p, q).sum(axis=-1).mean(), rel=1e-6)
    assert figures["kl"] == pytest.approx((p * np.log(p / q)).sum(axis=-1).mean(), rel=1e-5)
    assert figures["alpha"] < 0.95 and figures["kl"] > 0.05


# ---- the students: held out means never trained on ---------------------------------------------
WORDS = ("lamp keeper climbed steps dusk harbour ship rope tide gull stone wall bell night "
         "morning salt wind boat sail cliff").split()


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    from minitransformer.checkpoints.synth import train_tokenizer
    path = make_checkpoint(tmp_path_factory.mktemp("target") / "model", qwen2_config(
        vocab_size=320, num_hidden_layers=3, max_position_embeddings=512), seed=5,
        tokenizer=train_tokenizer(vocab_size=300))
    return mt.load(path)


def test_held_out_figures_are_computed_on_positions_never_trained_on(target, tmp_path,
                                                                     monkeypatch):
    """Every row the students train on, and every row their figures are computed on (KL,
    top-1, alpha; the greedy prompts), is traced back to its token position in the text: the
    two sets are disjoint, inside train_range and held_range, which are disjoint too. A text of
    words drawn at random, so that no two positions share their inputs by repetition."""
    from minitransformer.drafts import students as st
    rng = np.random.default_rng(0)
    text = tmp_path / "text.txt"
    text.write_text(" ".join(rng.choice(WORDS, 400)) + ".")
    monkeypatch.setenv("MT_WEIGHTS_DIR", str(tmp_path / "weights"))
    tokens = list(target.tokenizer.encode(text.read_text()))
    position_of = {}                     # the bytes of a row of h -> the token positions it is

    def draft_inputs(model, k, ids):
        h, final = real_draft_inputs(model, k, ids)
        start = find(tokens, list(ids))
        for j, row in enumerate(h):
            position_of.setdefault(row.tobytes(), set()).add(start + j)
        return h, final

    def positions(h):
        return set().union(*(position_of[row.tobytes()] for row in h))
    trained_on, scored_on, prompts = set(), set(), []

    def train(students, start, frozen, inputs, *args, **kwargs):
        trained_on.update(positions(inputs))
        return real_train(students, start, frozen, inputs, *args, **kwargs)

    def closeness(params, frozen, h, z, *args, **kwargs):
        scored_on.update(positions(h))
        return real_closeness(params, frozen, h, z, *args, **kwargs)

    def reference_tokens(model, prefix, n):
        at = find(tokens, list(prefix))
        prompts.append(range(at, at + len(prefix)))
        return real_reference(model, prefix, n)
    real_draft_inputs, real_train, real_closeness = tr.draft_inputs, tr.train, tr.closeness
    real_reference = st.reference_tokens
    monkeypatch.setattr(tr, "draft_inputs", draft_inputs)
    monkeypatch.setattr(tr, "train", train)
    monkeypatch.setattr(tr, "closeness", closeness)
    monkeypatch.setattr(st, "reference_tokens", reference_tokens)
    settings = st.Settings(layers=2, steps=4, batch=8, train_tokens=128, held_tokens=64,
                           eval_every=2, text=str(text))
    d = st.distil(target, settings)
    train_range, held_range = range(*d.train_range), range(*d.held_range)
    assert len(tokens) >= held_range.stop and not set(train_range) & set(held_range)
    assert trained_on and trained_on <= set(train_range)
    assert scored_on and scored_on <= set(held_range)
    assert len(prompts) == settings.prompts
    assert all(set(p) <= set(held_range) for p in prompts)
    assert not trained_on & (scored_on | set().union(*map(set, prompts)))


def find(tokens, ids) -> int:
    """Where ids first occur in tokens (they must)."""
    n = len(ids)
    return next(a for a in range(len(tokens) - n + 1) if tokens[a:a + n] == ids)


@pytest.mark.parametrize("n_tokens, settings", [
    (8000, dict()), (5000, dict(text="a.txt")), (320, dict(text="a.txt", train_tokens=128,
                                                             held_tokens=64))])
def test_the_training_and_held_out_ranges_are_disjoint(n_tokens, settings):
    from minitransformer.drafts import students as st
    s = st.Settings(**settings)
    train, held = st.text_ranges(n_tokens, s)
    assert train[1] - train[0] == s.train_tokens and held[1] == n_tokens
    assert held[1] - held[0] == s.held_tokens + s.prompts * st.PROMPT
    assert train[1] <= held[0]
    assert train[0] == (0 if s.text else st.SCORED_BY_EXP21)
    with pytest.raises(ValueError, match="too few"):
        st.text_ranges(held[1] - held[0] + s.train_tokens + train[0] - 1, s)


# ---- the verdict, as the figures decide it ---------------------------------------------------
def figures(soft1, soft2, hard):
    """Student -> kl, alpha, top1, greedy, from three (kl, alpha, top1, greedy) tuples."""
    return {name: dict(zip(("kl", "alpha", "top1", "greedy"), f, strict=True))
            for name, f in (("soft, T = 1", soft1), ("soft, T = 2", soft2), ("hard", hard))}


def test_the_verdict_when_soft_labels_win_everywhere():
    from exp23_soft_labels import verdict
    lines = verdict(figures((0.3, 0.8, 0.6, 0.5), (0.2, 0.85, 0.7, 0.6),
                                        (0.4, 0.7, 0.5, 0.4)))
    assert lines == [
        "soft (soft, T = 2) against hard: held-out KL 0.2000 against 0.4000 (soft better); "
        "alpha sampling 0.8500 against 0.7000 (soft better); top-1 0.7000 against 0.5000 "
        "(soft better); alpha greedy 0.6000 against 0.4000 (soft better)",
        "soft labels beat hard labels on every measure here"]


def test_the_verdict_when_hard_labels_win_somewhere():
    """The soft student with the lower KL (T = 1 here) against hard, which wins on top-1
    and greedy; a tie is neither side's win."""
    from exp23_soft_labels import verdict
    lines = verdict(figures((0.2, 0.8, 0.5, 0.4), (0.3, 0.9, 0.9, 0.9),
                                        (0.4, 0.8, 0.6, 0.5)))
    assert lines[0] == (
        "soft (soft, T = 1) against hard: held-out KL 0.2000 against 0.4000 (soft better); "
        "alpha sampling 0.8000 against 0.8000 (equal); top-1 0.5000 against 0.6000 "
        "(hard better); alpha greedy 0.4000 against 0.5000 (hard better)")
    assert lines[1].startswith("soft labels do NOT beat hard labels here on alpha sampling, "
                               "top-1, alpha greedy. Why that may be: ")
    assert len(lines) == 2


def test_closeness_refuses_a_teacher_made_for_other_chunks(small):
    """teacher_distributions made once (as distil makes it for every student and every
    evaluation) gives closeness's very numbers; made for other chunks it is refused by name."""
    h, _ = tr.draft_inputs(small, 1, np.arange(1, 21) % 96)
    frozen, params = tr.Frozen.of(small), tr.start_params(small, 0)
    z = tr.logits(tr.start_params(small, 1), frozen, h)[0]               # another block's
    teacher = tr.teacher_distributions(z, chunk=7)
    assert tr.closeness(params, frozen, h, z, chunk=7, teacher=teacher) == tr.closeness(
        params, frozen, h, z, chunk=7)
    with pytest.raises(ValueError, match="chunks of 7 positions, closeness reads 5"):
        tr.closeness(params, frozen, h, z, chunk=5, teacher=teacher)
