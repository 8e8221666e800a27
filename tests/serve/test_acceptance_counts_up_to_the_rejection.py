"""A sequence's acceptance books (speculate.py: alpha = (accepted + 1) / (judged + 2)) grow, for
a k-token draft rejected at position i, by i accepted of i + 1 judged: the proposals after the
rejected one were never judged. Counting them (i of k) keeps the tokens exact but lowers alpha,
so the sequence drafts shorter, or not at all, for no reason: speed lost, silently."""
from types import SimpleNamespace

import numpy as np
import pytest

import minitransformer as mt
from minitransformer.checkpoints.synth import qwen2_config, random_model
from minitransformer.model import forward
from minitransformer.serve.config import SpeculativeConfig
from minitransformer.serve.paged import PagedCache
from minitransformer.serve.speculate import Speculator
from test_speculate import keep, rows_of, step

K = 4
PROMPT = [5, 9, 2, 7, 3, 8]


@pytest.fixture(scope="module")
def model():
    return random_model(qwen2_config())


class Scripted:
    """A lookup that proposes the draft it is given (as LookupDraft.propose answers), and
    nothing when asked for the free judgement of a step that drafts nothing."""

    def __init__(self, draft):
        self.draft = draft
        self.lookup = SimpleNamespace(propose=lambda tokens, n: [])

    def propose(self, tokens, n, settings, rng):
        return self.draft[:n], [None] * len(self.draft[:n])


def speculating(model, draft, **config):
    """A pool holding PROMPT (all but its last token computed) and a speculator whose lookup
    proposes `draft`, verified row by row (batch-invariant: plain greedy's tokens)."""
    cache = PagedCache.allocate(model.config, 16, 4)
    cache.books.add("a", PROMPT)
    forward(model, np.array([PROMPT[:-1]]), cache.view(["a"]))
    spec = Speculator(SpeculativeConfig(num_speculative_tokens=K, **config), model)
    spec.proposer.lookup = Scripted(draft)
    return cache, spec


def greedy(model, n):
    return mt.generate(model, PROMPT, n, eos_token_id=[])


@pytest.mark.parametrize("i", range(K + 1))
def test_a_draft_rejected_at_position_i_is_judged_i_plus_one(model, i):
    """The draft is greedy's next K tokens with the one at position i changed (i = K: all
    right): i are accepted, and the books say i of i + 1 (of K when none was rejected)."""
    right = greedy(model, K + 1)
    draft = right[:K]
    if i < K:
        draft[i] = (draft[i] + 1) % model.config.vocab_size
    cache, spec = speculating(model, draft)
    (kept, _), = step(spec, cache, rows_of({"a": list(PROMPT)}, {"a": len(PROMPT)}))
    assert kept == right[:i + 1]                        # i accepted, then the target's own
    assert spec.counters.accepted_tokens == i and spec.counters.draft_tokens == K
    assert spec.judged["a"] == [i, min(i + 1, K)]


def test_a_rejection_early_in_a_long_draft_leaves_alpha_high_enough_to_draft_again(model):
    """min_acceptance 0.45, books of 1 right of 1 judged (a lookup drafts only once judged),
    then a 4-token draft rejected at position 1: 2 of 3 judged is alpha (2 + 1) / (3 + 2) =
    0.6, so the next step drafts again; 2 of 5 would be 3 / 7 = 0.43, and it would feed its
    last token alone."""
    right = greedy(model, K + 1)
    cache, spec = speculating(model, [right[0], (right[1] + 1) % model.config.vocab_size,
                                      *right[2:K]], min_acceptance=0.45)
    spec.judged["a"] = [1, 1]
    tokens = list(PROMPT)
    for _ in range(2):
        (kept, _), = step(spec, cache, rows_of({"a": tokens}, {"a": len(PROMPT)}))
        tokens += kept
        keep(cache, "a", len(tokens) - 1)
    assert spec.counters.drafts == 2 and spec.fed == [1 + K]
