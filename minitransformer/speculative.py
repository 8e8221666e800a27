"""Speculative decoding: a cheap draft model guesses, the target model checks (experiment 22).

One round, with gamma the draft length:

    draft:   gamma one-token decode steps on its own cache  -> proposals x1..x_gamma
    target:  ONE forward pass over [last token, x1..x_gamma] -> its logits at every proposal
    keep:    the longest prefix of proposals the target accepts, then one token of the
             target's own (the correction at the first rejection, or a bonus if none)
    undo:    trim the rejected proposals out of both caches (KVCache.trim)

so every round costs one target pass and yields between 1 and gamma + 1 tokens. Where decode
is bound by reading the weights (a GPU), the pass over gamma + 1 positions costs about as much
as a one-token step: the same bytes, matrix-matrix instead of matrix-vector work. That is where
the speedup comes from (experiment 22 measures what it costs on NumPy).

It is exact, the chapter's second exact optimisation:
  - greedy: a proposal is kept only if it is the target's own argmax (after the same
    repetition penalty), so the tokens are those of plain greedy ``generate``, one by one;
  - sampling: Leviathan et al. (2023)'s modified rejection rule (``leviathan_step``) makes
    every kept token a draw from the target's own distribution, the one ``generate`` samples
    from (temperature, top-k, top-p, repetition penalty: the same ``sampling`` functions).
    The distribution is the same; the draws are not (the random numbers are used differently).
Exact up to float rounding: the target scores a token inside a pass over gamma + 1 positions,
plain decode in a pass over one, and the two logits differ in the last bits (about 1e-6 of
their size), so greedy could part only at a near-tie of two logits (the tests compare tens of
thousands of tokens).

The draft is a model (a quantized copy, the target's first layers, a smaller model) or a
PromptLookup (lookup.py): proposals copied from earlier in the text, which cost nothing and
come with no distribution (as a draft, a point mass on the proposal). Either is wrapped once,
in ModelDraft or LookupDraft, which answer the same two calls: propose (n tokens and the
distributions they came from) and rollback (forget the rejected ones).

Between rounds each cache lags one token behind the sequence: the round's last token (the
target's own, which no model has seen) goes into the next round's first pass. So after the
trim a cache holds only kept tokens, and a rollback is a trim, never a recomputation.
Leaves out: batches (one sequence; the serving engine verifies a batch's drafts in one pass,
with this module's rule: serve/speculate.py), tree-shaped drafts, a draft length that adapts
to alpha.
"""
from dataclasses import dataclass, replace

import numpy as np

from minitransformer.backend import to_numpy
from minitransformer.checks import is_integer
from minitransformer.generate import check_prompt, eos_ids, seeded_rng
from minitransformer.kvcache import KVCache
from minitransformer.lookup import PromptLookup
from minitransformer.model import forward, head
from minitransformer.sampling import (
    GREEDY,
    SamplingSettings,
    apply_repetition_penalty,
    check_sampling,
    draw,
    next_token,
    probabilities,
)


@dataclass(frozen=True)
class SpeculativeResult:
    tokens: list         # the new token ids (prompt not included), as generate returns them
    target_passes: int   # target forward calls = rounds (the first one also reads the prompt)
    draft_passes: int    # draft forward calls (one per proposal)
    proposed: int        # proposals put to the target
    accepted: int        # proposals it kept
    rejected: int = 0    # rounds that ended at a rejected proposal (the rest kept them all)

    @property
    def acceptance_rate(self) -> float:
        """Kept / proposed. Lower than the per-token alpha: proposals after a rejection are
        counted as proposed but never get the chance to be accepted."""
        return self.accepted / self.proposed if self.proposed else float("nan")

    @property
    def alpha(self) -> float:
        """Per-proposal acceptance estimated from the run: kept / (kept + rejections), the
        alpha of the chapter's formula if each proposal is accepted with the same chance."""
        judged = self.accepted + self.rejected
        return self.accepted / judged if judged else float("nan")

    @property
    def tokens_per_pass(self) -> float:
        return len(self.tokens) / self.target_passes if self.target_passes else float("nan")


def first_layers(model, n: int):
    """A draft made of the target's first n layers, then its own final norm and head.

    An early-exit ("self-speculative") draft: nothing to train or load, costs about n / L of a
    target step, and shares the tokenizer by construction. The weights are shared, not copied.
    """
    L = model.config.num_hidden_layers
    if not is_integer(n) or not 1 <= n <= L:
        raise ValueError(f"a draft of the first n layers needs 1 <= n <= {L}, got {n!r}")
    return replace(model, config=replace(model.config, num_hidden_layers=int(n)))


def leviathan_step(p, q, x: int, rng) -> tuple[bool, int]:
    """Accept draft token x (drawn from q) or replace it; the result is distributed as p.

    p, q (V,): target and draft distributions at this position. Accept with probability
    min(1, p[x] / q[x]); on rejection draw from max(0, p - q), normalised. Why it is exact:
    P(emit t) = q[t] min(1, p[t]/q[t]) + P(reject) * max(0, p[t] - q[t]) / P(reject)
              = min(q[t], p[t]) + max(0, p[t] - q[t]) = p[t].
    """
    if rng.random() * q[x] < p[x]:  # u < p/q without dividing; q[x] > 0 since x came from q
        return True, x
    residual = np.maximum(p - q, np.float32(0))
    if not residual.sum() > 0:  # p == q up to rounding: rejection had probability ~0
        residual = p
    return False, draw(residual, rng)  # draw normalises by the total itself


def check_vocabulary(draft, target) -> None:
    """A draft model must share the target's vocabulary (its token ids are the target's): a
    ValueError naming both sizes, for generate's speculation and the engine's draft model.

    >>> from minitransformer.config import ModelConfig
    >>> from minitransformer.checkpoints.synth import qwen2_config
    >>> check_vocabulary(ModelConfig.from_dict(qwen2_config(vocab_size=64)),
    ...                  ModelConfig.from_dict(qwen2_config()))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: draft and target must share a vocabulary: the draft has 64 tokens, the target...
    """
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"draft and target must share a vocabulary: the draft has "
                         f"{draft.vocab_size} tokens, the target {target.vocab_size}")


class ModelDraft:
    """A draft model and its own cache: proposals by decode steps, undone by a trim."""

    def __init__(self, model, target, ids, max_new_tokens: int, gamma: int = 1):
        check_vocabulary(model.config, target.config)
        check_prompt(model, ids, max_new_tokens)
        self.model = model
        # It lags one token behind the sequence, as the target's: P + max_new_tokens suffice.
        # A sliding-window layer keeps gamma + 1 slots past its window: a round's drafts (and
        # the token before them) may be rolled back.
        self.kv = KVCache.allocate(model.config, batch=1, max_len=len(ids) + max_new_tokens,
                                   spare=gamma + 1)
        self.passes = 0  # forward calls, one per proposal

    def propose(self, tokens: list, n: int, settings, rng) -> tuple[list, list]:
        """n draft tokens, one decode step each, and the distributions q (V,) they came from.

        The first step also feeds whatever the draft's cache has not seen yet (the prompt at
        the start, then the one or two tokens kept last round). In greedy mode q is None.
        """
        drafts: list[int] = []
        dists: list = []         # q of each draft (None in greedy mode)
        fresh = tokens[int(self.kv.lengths[0]):]
        for _ in range(n):
            hidden = forward(self.model, np.array([fresh]), self.kv)         # (1, len(fresh), D)
            logits = to_numpy(head(self.model, hidden[:, -1:]))[0, -1]       # (V,)
            if settings.greedy:
                x, q = next_token(logits, tokens + drafts, settings, rng), None
            else:
                z = apply_repetition_penalty(logits, tokens + drafts, settings.repetition_penalty)
                q = probabilities(z, settings)                               # (V,)
                x = draw(q, rng)
            drafts.append(x)
            dists.append(q)
            fresh = [x]
        self.passes += n
        return drafts, dists

    def rollback(self, valid: int) -> None:
        rollback(self.kv, valid)


class LookupDraft:
    """A PromptLookup as a draft: proposals copied from the text, no cache, no forward pass.

    Its proposals come with no distribution; as a draft, each is a point mass on itself.
    """
    passes = 0

    def __init__(self, lookup: PromptLookup, vocab_size: int):
        self.lookup, self.vocab_size = lookup, vocab_size

    def propose(self, tokens: list, n: int, settings, rng) -> tuple[list, list]:
        """Up to n proposals (fewer, or none, where the text has no match), and their q."""
        drafts = self.lookup.propose(tokens, n)
        return drafts, [None if settings.greedy else point_mass(x, self.vocab_size)
                        for x in drafts]

    def rollback(self, valid: int) -> None:
        pass  # nothing to undo: it keeps no cache


def verify(logits, drafts: list, dists: list, tokens: list, settings, rng) -> list:
    """The tokens this round keeps: accepted proposals, then one token of the target's own.

    logits (n+1, V): the target's logits after tokens + drafts[:i], for i = 0..n.
    """
    kept: list[int] = []
    for i, z in enumerate(logits):
        if settings.greedy:
            # The very rule plain greedy generate applies: penalty, then argmax.
            own = next_token(z, tokens + kept, settings, rng)
            if i == len(drafts) or own != drafts[i]:
                return kept + [own]
            kept.append(own)
            continue
        z = apply_repetition_penalty(z, tokens + kept, settings.repetition_penalty)
        p = probabilities(z, settings)                                  # (V,)
        if i == len(drafts):  # every proposal accepted: a bonus token, straight from p
            return kept + [draw(p, rng)]
        accepted, token = leviathan_step(p, dists[i], drafts[i], rng)
        if not accepted:
            return kept + [token]
        kept.append(token)
    raise AssertionError("unreachable: the last row of logits always returns")


def rollback(kv: KVCache, valid: int) -> None:
    """Trim the cache back to its first `valid` tokens (the ones still in the sequence)."""
    held = int(kv.lengths[0])
    kv.trim(max(0, held - valid))


def speculative_generate(target, draft, ids, max_new_tokens: int, gamma: int = 4,
                         sampling: SamplingSettings = GREEDY, seed=None,
                         eos_token_id=None) -> SpeculativeResult:
    """Generate like ``generate(target, ...)``, with `draft` proposing `gamma` tokens a round.

    sampling, seed and eos handling as in ``minitransformer.generate.stream``. The draft is a
    Model sharing the target's vocabulary (same tokenizer; anything else about it may
    differ), or a PromptLookup, whose rounds may propose fewer than gamma tokens, or none.
    """
    settings = check_sampling(sampling)
    if not is_integer(gamma) or gamma < 1:
        raise ValueError(f"gamma (tokens drafted per round) must be an integer >= 1, got {gamma!r}")
    ids = check_prompt(target, ids, max_new_tokens)
    drafter = (LookupDraft(draft, target.config.vocab_size) if isinstance(draft, PromptLookup)
               else ModelDraft(draft, target, ids, max_new_tokens, gamma))
    eos = eos_ids(target, eos_token_id)
    rng = seeded_rng(seed)
    tokens = ids.tolist()
    P = len(tokens)
    # Each cache lags one token behind the sequence: P + max_new_tokens slots always suffice.
    target_kv = KVCache.allocate(target.config, batch=1, max_len=P + max_new_tokens,
                                 spare=gamma + 1)           # drafts rolled back: kvcache.py
    passes = proposed = accepted = rejected = 0
    while len(tokens) - P < max_new_tokens:
        # Never draft past the end: a round yields up to n + 1 tokens.
        n = min(gamma, max_new_tokens - (len(tokens) - P) - 1)
        drafts, dists = drafter.propose(tokens, n, settings, rng)
        n = len(drafts)  # a lookup may find fewer, or none
        fresh = tokens[int(target_kv.lengths[0]):] + drafts            # last token(s) + drafts
        hidden = forward(target, np.array([fresh]), target_kv)         # (1, len(fresh), D)
        logits = to_numpy(head(target, hidden[:, -(n + 1):]))[0]       # (n+1, V)
        passes += 1
        kept = verify(logits, drafts, dists, tokens, settings, rng)
        proposed += n
        accepted += len(kept) - 1
        rejected += len(kept) - 1 < n
        # Both caches now hold tokens + some drafts; keep only the accepted ones.
        rollback(target_kv, len(tokens) + len(kept) - 1)
        drafter.rollback(len(tokens) + len(kept) - 1)
        for token in kept:
            tokens.append(token)
            if token in eos:
                return SpeculativeResult(tokens[P:], passes, drafter.passes, proposed, accepted,
                                         rejected)
    return SpeculativeResult(tokens[P:], passes, drafter.passes, proposed, accepted, rejected)


def point_mass(token: int, vocab_size: int) -> np.ndarray:
    """A deterministic draft's distribution q (V,): all of its mass on the token it proposed.

    With it the Leviathan rule keeps the proposal with probability p[token] and otherwise draws
    from p without it: exactly p again.
    """
    q = np.zeros(vocab_size, np.float32)
    q[token] = 1.0
    return q
