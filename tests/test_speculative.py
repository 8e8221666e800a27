"""Speculative decoding keeps the target's output: token for token when greedy, in
distribution when sampling (chi-square against the target's exact distribution), and a wrong
acceptance rule is caught by the same test."""
import re
from collections import Counter
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

import minitransformer as mt
from minitransformer import speculative
from minitransformer.checkpoints.synth import default_model
from minitransformer.lookup import PromptLookup, lookup_past_insertion, prompt_lookup, replay
from minitransformer.sampling import SamplingSettings, apply_repetition_penalty, probabilities
from minitransformer.speculative import first_layers, leviathan_step, speculative_generate
from quant.qmodel import quantize_model


# ---------------------------------------------------------------------------- drafts
def contrarian(model):
    """The worst draft: the target's own hidden states read through the negated head, so the
    draft proposes the target's argmin, which greedy decoding never accepts."""
    w = model.weights
    head = w["model.embed_tokens.weight" if model.config.tie_word_embeddings else "lm_head.weight"]
    return replace(model, config=replace(model.config, tie_word_embeddings=False),
                   weights={**w, "lm_head.weight": -head})


def drafts_of(model):
    return {"itself": model, "contrarian": contrarian(model), "nf4": quantize_model(model, "nf4"),
            "first layer": first_layers(model, 1)}


# ---------------------------------------------------------------------------- greedy
@pytest.mark.parametrize("draft_name", ["itself", "contrarian", "nf4", "first layer"])
def test_greedy_equals_plain_greedy_on_tiny_models(tiny_model, draft_name):
    draft = drafts_of(tiny_model)[draft_name]
    rng = np.random.default_rng(0)
    for length in (1, 5, 12):
        ids = rng.integers(0, tiny_model.config.vocab_size, length).tolist()
        plain = mt.generate(tiny_model, ids, 25, eos_token_id=[])
        for gamma in (1, 2, 3, 5, 8):
            r = speculative_generate(tiny_model, draft, ids, 25, gamma=gamma, eos_token_id=[])
            assert r.tokens == plain, (length, gamma)
            # every round yields its accepted proposals plus one token of the target's own
            assert len(r.tokens) == r.accepted + r.target_passes
            assert r.draft_passes == r.proposed
            if draft_name == "itself":
                assert r.accepted == r.proposed  # a perfect draft is never rejected
            if draft_name == "contrarian":
                assert r.accepted == 0 and r.target_passes == 25


def test_a_run_ended_by_eos_reports_the_rounds_it_made(checkpoint_dir):
    """A run whose eos id is the last token a run without one makes (found nowhere before
    it) makes the same rounds and ends on the same token, but returns from inside the
    round: its tokens and every count (target and draft passes, proposals, kept, rejected
    rounds) are the run without eos's. (On a model whose greedy tokens vary: several tiny
    ones repeat one token.)"""
    tiny_model = mt.load(checkpoint_dir("qwen2-close-calls"))
    draft, rng, checked = first_layers(tiny_model, 1), np.random.default_rng(1), []
    for length in (1, 3, 5, 8, 12, 16):
        ids = rng.integers(0, tiny_model.config.vocab_size, length).tolist()
        for gamma in (2, 3):
            runs = (speculative_generate(tiny_model, draft, ids, n, gamma=gamma, eos_token_id=[])
                    for n in range(25, 1, -1))          # the longest whose last token is new
            full = next((r for r in runs if r.tokens[-1] not in r.tokens[:-1]), None)
            if full is None:
                continue
            ended = speculative_generate(tiny_model, draft, ids, len(full.tokens), gamma=gamma,
                                         eos_token_id=full.tokens[-1])
            assert ended == full, (length, gamma)
            checked.append((full.target_passes, full.proposed, full.accepted, full.rejected))
    # counts that differ from each other, so that one reported in another's place shows
    assert any(len(set(c)) == 4 for c in checked), checked


def test_prompt_lookup_greedy_equals_plain_greedy_and_drafts_from_repeats(tiny_model):
    rng = np.random.default_rng(1)
    passage = rng.integers(0, tiny_model.config.vocab_size, 12).tolist()
    for ids in (passage + passage[:3], passage, [7]):   # a passage being repeated, then not
        plain = mt.generate(tiny_model, ids, 30, eos_token_id=[])
        for gamma in (1, 3, 6):
            for draft in (PromptLookup(), PromptLookup(max_ngram=1)):
                r = speculative_generate(tiny_model, draft, ids, 30, gamma=gamma,
                                         eos_token_id=[])
                assert r.tokens == plain, (ids, gamma, draft)
                assert len(r.tokens) == r.accepted + r.target_passes
                assert r.draft_passes == 0 and r.proposed <= gamma * r.target_passes
                assert r.rejected <= r.target_passes and r.accepted <= r.proposed
                # the rounds follow from the tokens: replaying them gives the same counts
                rounds = replay(ids + r.tokens, len(ids), gamma, draft)
                assert (len(rounds), sum(p for p, _ in rounds), sum(k for _, k in rounds),
                        sum(k < p for p, k in rounds)) == \
                    (r.target_passes, r.proposed, r.accepted, r.rejected)
    # a model that copies: greedy continues a repeated passage, so the lookup is kept
    looped = speculative_generate(tiny_model, PromptLookup(), plain + plain, 20, gamma=4,
                                  eos_token_id=[])
    assert looped.accepted > 0


def test_a_lookup_past_an_insertion_resumes_the_copy_and_is_otherwise_prompt_lookups():
    """A text copying a passage puts in a token of its own (a comma the passage lacks, seen
    elsewhere in it): the last 1-gram matches a wrong place, the longer n-gram before it the
    right one, and the copy resumes where it was; copying with nothing put in, or a token
    that continues the copy, the proposals are prompt_lookup's."""
    rng = np.random.default_rng(0)
    for _ in range(200):
        passage = rng.permutation(np.arange(100, 140))[:30].tolist()    # no token repeats
        cut = int(rng.integers(3, 27))                  # copied so far: passage[:cut]
        comma = passage[int(rng.choice([i for i in range(30) if i != cut]))]
        copying = passage + passage[:cut]
        put_in = copying + [comma]
        n, k = int(rng.integers(1, 6)), int(rng.integers(2, 5))
        resumed = copying[cut:cut + n]                  # what followed passage[:cut]
        assert prompt_lookup(put_in, n, k) != resumed   # the comma's place: a wrong one
        assert lookup_past_insertion(put_in, n, k) == resumed
        for tokens in (copying, copying + [passage[cut]], put_in + passage[cut:cut + 2]):
            assert lookup_past_insertion(tokens, n, k) == prompt_lookup(tokens, n, k)
    assert PromptLookup(past_insertion=True).propose(put_in, 2) == passage[cut:cut + 2]
    assert lookup_past_insertion([3], 2) == prompt_lookup([3], 2) == []


def longest_earlier_match(tokens, max_ngram, min_ngram):
    """The lookup's match by brute force: the largest k in [min_ngram, max_ngram] such that
    the last k tokens occur earlier, ending before the last token -> (k, where what followed
    the latest such occurrence starts), or (0, None)."""
    L = len(tokens)
    for k in range(max_ngram, min_ngram - 1, -1):
        ends = [s + k for s in range(L - k) if tokens[s:s + k] == tokens[L - k:]]
        if k < L and ends:
            return k, ends[-1]
    return 0, None


@settings(max_examples=400, derandomize=True, database=None, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=24), st.integers(1, 5), st.integers(1, 4),
       st.integers(0, 3))
def test_both_lookups_are_their_rule_by_brute_force(tokens, n, max_ngram, shorter):
    """On random texts of 4 tokens (matches everywhere, ties common): prompt_lookup proposes
    what followed the latest longest earlier match; lookup_past_insertion takes the match
    ending one token before the last only where it is strictly longer, a tie is no insertion."""
    min_ngram = max(1, max_ngram - shorter)
    k, follow = longest_earlier_match(tokens, max_ngram, min_ngram)
    plain = tokens[follow:follow + n] if k else []
    assert prompt_lookup(tokens, n, max_ngram, min_ngram) == plain
    before, resume = longest_earlier_match(tokens[:-1], max_ngram, min_ngram)
    past = tokens[resume:resume + n] if before > k else plain
    assert lookup_past_insertion(tokens, n, max_ngram, min_ngram) == past


@pytest.fixture(scope="module")
def story_drafts(stories):
    """Drafts of stories260K that agree with it from always (INT8) to rarely (3 layers)."""
    return [quantize_model(stories, scheme) for scheme in ("int8-row", "int4-row", "nf4",
                                                           "int4-tensor")] + \
        [first_layers(stories, 4), first_layers(stories, 3)]


@pytest.mark.parametrize("prompt", ["Once upon a time", "Lily saw a dog", "The sun was hot"])
def test_greedy_equals_plain_greedy_on_a_real_model(stories, story_drafts, prompt):
    ids = stories.tokenizer.encode(prompt)
    plain = mt.generate(stories, ids, 60, eos_token_id=[])
    partial = 0
    for i, draft in enumerate(story_drafts):
        for gamma in (1, 3, 4, 7):
            r = speculative_generate(stories, draft, ids, 60, gamma=gamma, eos_token_id=[])
            assert r.tokens == plain, (i, gamma)
            partial += 0 < r.accepted < r.proposed
    assert partial > 10  # most runs had rounds with rejections to roll back


def test_greedy_with_repetition_penalty_and_eos(stories):
    ids = stories.tokenizer.encode("Once upon a time")
    draft = quantize_model(stories, "int4-row")
    penalty = SamplingSettings(repetition_penalty=1.3)
    plain = mt.generate(stories, ids, 50, sampling=penalty, eos_token_id=[])
    r = speculative_generate(stories, draft, ids, 50, gamma=4, sampling=penalty,
                             eos_token_id=[])
    assert r.tokens == plain
    eos = plain[20]  # stop at this token's first appearance, as generate does
    assert speculative_generate(stories, draft, ids, 50, gamma=4, sampling=penalty,
                                eos_token_id=eos).tokens == \
        mt.generate(stories, ids, 50, sampling=penalty, eos_token_id=eos)


def test_greedy_on_the_default_model():
    model = mt.load(default_model())
    ids = model.tokenizer.encode("Once upon a time")
    plain = mt.generate(model, ids, 20, eos_token_id=[])
    r = speculative_generate(model, first_layers(model, 7), ids, 20, gamma=4, eos_token_id=[])
    assert r.tokens == plain and 0 < r.accepted < r.proposed


# ---------------------------------------------------------------------------- bad input
def test_bad_input_is_refused_clearly(checkpoint_dir):
    model = mt.load(checkpoint_dir("qwen2-gqa-tied-bf16"))
    with pytest.raises(ValueError, match="gamma"):
        speculative_generate(model, model, [1, 2], 5, gamma=0)
    with pytest.raises(ValueError, match="gamma"):
        speculative_generate(model, model, [1, 2], 5, gamma=True)
    other = replace(model, config=replace(model.config, vocab_size=model.config.vocab_size + 1))
    with pytest.raises(ValueError, match="vocabulary"):
        speculative_generate(model, other, [1, 2], 5)
    with pytest.raises(ValueError, match="token ids"):
        speculative_generate(model, model, [1, 10_000], 5)
    with pytest.raises(ValueError, match="temperature"):
        speculative_generate(model, model, [1, 2], 5, sampling={"temperature": 0.5})
    r = speculative_generate(model, model, [1, 2], 0)
    assert r.tokens == [] and r.target_passes == 0
    for n in (0, model.config.num_hidden_layers + 1, 1.5):
        with pytest.raises(ValueError, match="first n layers"):
            first_layers(model, n)


# ---------------------------------------------------------------------------- sampling
def test_the_rule_alone_turns_draws_from_q_into_draws_from_p():
    """Leviathan et al.'s step in isolation, 30,000 times: the output frequencies are p."""
    rng = np.random.default_rng(0)
    p = np.array([0.5, 0.3, 0.2, 0.0, 0.0], np.float32)
    q = np.array([0.1, 0.1, 0.3, 0.4, 0.1], np.float32)  # mass where p has none, and vice versa
    n = 30_000
    out = [leviathan_step(p, q, int(rng.choice(5, p=q)), rng)[1] for _ in range(n)]
    counts = np.bincount(out, minlength=5)
    assert counts[3] == counts[4] == 0
    expected = p[:3].astype(np.float64) / p[:3].sum() * n
    assert chisquare(counts[:3], expected).pvalue > 1e-3


def exact_joint(model, prompt, k, settings):
    """{(t1, ..., tk): probability} under the target's own sampling, by enumerating prefixes
    (full forward passes without a cache: independent of the decoder under test)."""
    joint = {(): 1.0}
    for _ in range(k):
        longer = {}
        for prefix, pr in joint.items():
            seq = prompt + list(prefix)
            z = apply_repetition_penalty(mt.logits(model, seq)[-1], seq,
                                         settings.repetition_penalty)
            p = probabilities(z, settings).astype(np.float64)
            for t in np.flatnonzero(p):
                longer[prefix + (int(t),)] = pr * p[t]
        joint = longer
    return joint


def goodness_of_fit(samples, joint) -> float:
    """Chi-square p-value of the samples against the exact joint; 0 if any sample is one the
    target can never produce. Cells expecting fewer than 5 samples are pooled."""
    counts, n = Counter(samples), len(samples)
    if any(s not in joint for s in counts):
        return 0.0
    cells = sorted(joint, key=joint.get)
    expected = np.array([joint[c] for c in cells]) * n
    observed = np.array([counts[c] for c in cells], dtype=float)
    small = np.cumsum(expected) < 5  # pool the rarest cells until they expect 5
    pooled = int(small.sum()) + 1
    expected = np.concatenate([[expected[:pooled].sum()], expected[pooled:]])
    observed = np.concatenate([[observed[:pooled].sum()], observed[pooled:]])
    return float(chisquare(observed, expected * n / expected.sum()).pvalue)


def sample_runs(target, draft, n_runs, k, gamma, sampling, prompt=(1, 2, 3)):
    prompt = list(prompt)
    return [tuple(speculative_generate(target, draft, prompt, k, gamma=gamma, sampling=sampling,
                                       seed=seed, eos_token_id=[]).tokens)
            for seed in range(n_runs)]


N_RUNS = 1500  # seeded runs per test: a few seconds, and a wrong rule misses by miles
SAMPLING_CASES = {  # name -> (tokens compared, gamma, sampling settings)
    "bonus path": (2, 1, SamplingSettings(do_sample=True, temperature=0.1)),
    "all knobs": (3, 3, SamplingSettings(do_sample=True, temperature=0.1, top_k=4, top_p=0.95,
                                         repetition_penalty=1.5)),
}


@pytest.mark.parametrize("case", sorted(SAMPLING_CASES))
def test_sampling_keeps_the_targets_distribution(pair, case):
    k, gamma, settings = SAMPLING_CASES[case]
    target, draft = pair
    joint = exact_joint(target, [1, 2, 3], k, settings)
    samples = sample_runs(target, draft, N_RUNS, k, gamma, settings)
    # Fixed seeds: this p-value is one deterministic number, not a coin flip per run.
    assert goodness_of_fit(samples, joint) > 1e-3
    # ...and the draft really is different: its own distribution fails the same test.
    draft_samples = [tuple(mt.generate(draft, [1, 2, 3], k, sampling=settings, seed=s,
                                       eos_token_id=[])) for s in range(N_RUNS)]
    assert goodness_of_fit(draft_samples, joint) < 1e-6


def test_sampling_with_prompt_lookup_keeps_the_targets_distribution(pair):
    """A point-mass draft: kept with probability p[x], else a draw from p without x."""
    k, gamma, settings = SAMPLING_CASES["all knobs"]
    target, _ = pair
    prompt = [1, 2, 3, 1, 2, 1]  # repeats: the lookup always has something to propose
    joint = exact_joint(target, prompt, k, settings)
    samples = sample_runs(target, PromptLookup(), N_RUNS, k, gamma, settings, prompt)
    assert goodness_of_fit(samples, joint) > 1e-3


def accept_always(p, q, x, rng):
    return True, x


def resample_from_p(p, q, x, rng):
    """Right acceptance test, wrong fallback: p instead of the residual max(0, p - q)."""
    if rng.random() * q[x] < p[x]:
        return True, x
    return False, speculative.draw(p, rng)


@pytest.mark.parametrize("wrong_rule", [accept_always, resample_from_p])
def test_a_wrong_rule_fails_the_same_test(pair, monkeypatch, wrong_rule):
    k, gamma, settings = SAMPLING_CASES["bonus path"]
    target, draft = pair
    joint = exact_joint(target, [1, 2, 3], k, settings)
    monkeypatch.setattr(speculative, "leviathan_step", wrong_rule)
    samples = sample_runs(target, draft, N_RUNS, k, gamma, settings)
    assert goodness_of_fit(samples, joint) < 1e-6


def run_exp22(run_script, model_path, *args):
    return run_script("exp22_speculative", "--model", model_path, "--new-tokens", 16,
                      "--repeats", 1, "--max-gamma", 3, *args)[0]


def test_exp22_script_runs_and_finds_every_output_identical(stories, run_script):
    out = run_exp22(run_script, stories.path, "--schemes", "int4-row")
    for text in ("prompt lookup", "INT4 per-row", "first 2 of 5 layers", "v(n)",
                 "tokens identical to plain greedy in every run: yes"):
        assert text in out


def test_exp22_script_on_the_default_model(run_script):
    out = run_exp22(run_script, "default", "--schemes", "int8-row", "--no-layers-draft",
                    "--distilled", "none")
    assert "prompt lookup" in out and "INT8 per-row" in out and "first" not in out
    assert "tokens identical to plain greedy in every run: yes" in out


def test_a_draft_of_the_first_n_layers_has_n_and_all_of_them_is_the_target(tiny_model):
    """first_layers(model, n): a model of n layers sharing the target's weights; n = L is the
    target itself, whose every sampled proposal the rule accepts (p / q = 1)."""
    L = tiny_model.config.num_hidden_layers
    ids = [1, 2, 3, 4]
    one = first_layers(tiny_model, 1)
    assert one.config.num_hidden_layers == 1 and one.weights is tiny_model.weights
    assert not np.array_equal(mt.logits(one, ids), mt.logits(tiny_model, ids))
    whole = first_layers(tiny_model, L)
    np.testing.assert_array_equal(mt.logits(whole, ids), mt.logits(tiny_model, ids))
    r = speculative_generate(tiny_model, whole, ids, 20, gamma=4, seed=0, eos_token_id=[],
                             sampling=SamplingSettings(do_sample=True, temperature=1.0))
    assert r.proposed > 0 and r.accepted == r.proposed and r.rejected == 0


def test_the_rule_accepts_a_draw_from_p_itself():
    """q == p: min(1, p[x] / q[x]) = 1, every proposal is kept, as itself."""
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.ones(6)).astype(np.float32)
    for _ in range(200):
        x = int(rng.choice(6, p=p / p.sum()))
        assert leviathan_step(p, p, x, rng) == (True, x)


def test_a_lookup_proposal_is_a_point_mass():
    q = speculative.point_mass(3, 5)
    assert q.dtype == np.float32 and q.tolist() == [0, 0, 0, 1, 0]


def test_greedy_with_a_penalty_draft_and_target_apply_it_alike(tiny_model):
    """Greedy with a repetition penalty, the draft the whole target: the tokens are plain
    greedy's, and every proposal is accepted (both sides penalise the same tokens)."""
    whole = first_layers(tiny_model, tiny_model.config.num_hidden_layers)
    penalty = SamplingSettings(repetition_penalty=1.3)
    ids = [1, 2, 3, 1, 2]
    plain = mt.generate(tiny_model, ids, 20, sampling=penalty, eos_token_id=[])
    r = speculative_generate(tiny_model, whole, ids, 20, gamma=4, sampling=penalty,
                             eos_token_id=[])
    assert r.tokens == plain and r.accepted == r.proposed > 0


class LastDraw:
    """A generator whose every uniform draw is just below 1."""
    def random(self):
        return 1 - 2**-24


def test_a_rejection_where_p_equals_q_draws_from_p():
    """p == q up to rounding (p a hair below q at x): a rejection leaves no residual, and the
    token comes from p itself: never one p gives no probability."""
    q = np.array([0.5, 0.5, 0.0], np.float32)
    p = np.array([0.5 - 2**-20, 0.5, 0.0], np.float32)
    assert leviathan_step(p, q, 0, LastDraw()) == (False, 1)


def test_a_seed_gives_the_same_draws_and_rounds_feed_only_new_tokens(tiny_model, monkeypatch):
    """Sampling with a seed: the same tokens twice. And the target's cache is used: after the
    first pass (the prompt), a round's pass feeds at most the last two tokens + gamma drafts."""
    fed = []
    forward = speculative.forward
    monkeypatch.setattr(speculative, "forward",
                        lambda model, ids, kv: fed.append((model, ids.shape[1])) or
                        forward(model, ids, kv))
    settings = SamplingSettings(do_sample=True, temperature=1.0)
    draft = first_layers(tiny_model, 1)
    runs = [speculative_generate(tiny_model, draft, [1, 2, 3, 4], 20, gamma=3, seed=5,
                                 sampling=settings, eos_token_id=[]).tokens for _ in range(2)]
    assert runs[0] == runs[1]
    target = [n for model, n in fed if model is tiny_model]         # both runs' passes
    half = len(target) // 2
    assert target[:half] == target[half:]
    assert target[0] == 4 + 3 and max(target[1:half]) <= 2 + 3


@pytest.mark.parametrize("persists", [False, True])
def test_exp22_races_every_draft_against_the_same_plain_runs(pair, monkeypatch, persists):
    """One set of rounds: plain greedy, then each draft (one call of time_together); a row
    whose speedup beats its ceiling is measured again and, only if it still does, flagged,
    its row alone."""
    import exp22_speculative as exp22
    from minitransformer.measure.timing import Timing
    target, draft = pair
    ids, plain = [1, 2, 3], mt.generate(target, [1, 2, 3], 6, eos_token_id=[])
    rows = [("first", draft, 0.5, 0.5, 0.5, 1, 1.0, 1.0),
            ("second", draft, 0.5, 0.5, 0.5, 2, 1.0, 1.0)]
    calls = []

    def fake_time_together(fns, warmup, repeat, after):
        calls.append(len(fns))
        for fn, undo in zip(fns, after, strict=True):
            fn()
            if undo is not None:
                undo()
        # plain 1 s; the first draft 4 s (0.25x: sane), the second 0.1 s: 10x, above any
        # ceiling (at most 3 tokens a pass / (2 x 0.5 + 1) = 1.5x), unless the rerun settles it
        second = 0.1 if persists or len(calls) == 1 else 4.0
        return [Timing((1.0, 1.0)), Timing((4.0, 4.0)), Timing((second, second))]
    monkeypatch.setattr(exp22, "time_together", fake_time_together)
    measured = exp22.races(target, ids, plain, rows, repeats=2)
    assert calls == [3, 3]          # plain and both drafts together, measured twice
    assert [m[3] for m in measured] == [True, True]            # the tokens are plain greedy's
    assert measured[0][1] == pytest.approx(0.25) and measured[0][4] is None
    if persists:
        assert measured[1][1] == pytest.approx(10.0) and "above its ceiling" in measured[1][4]
    else:
        assert measured[1][1] == pytest.approx(0.25) and measured[1][4] is None


@pytest.mark.parametrize("fields, named", [
    ({"max_ngram": 2.5}, "max_ngram must be an integer"),
    ({"min_ngram": True}, "min_ngram must be an integer"),
    ({"past_insertion": "yes"}, "past_insertion must be True or False"),
    ({"min_ngram": 0}, "need 1 <= min_ngram <= max_ngram")], ids=str)
def test_a_prompt_lookup_is_refused_naming_its_bad_field(fields, named):
    with pytest.raises(ValueError, match=f"^{re.escape(named)}"):
        PromptLookup(**fields)
