"""Where a step's drafts come from, and how long they are (speculate.py verifies them).

    propose   every decoding sequence asks for up to n_b proposals, all in ONE call
              (``Proposer.propose``): a prompt lookup over its prompt and output (vLLM's
              ``ngram``, resuming a copy past a token the model put in:
              lookup.py's ``lookup_past_insertion``), or a draft model (``DraftModel``)
    length    ``draft_length``: how many a sequence asks for this step, from its acceptance
              so far and the batch (docs/serving.md, "The draft length")

A draft model drafts for the whole batch at once. Its keys and values live in a paged pool of
its own (paged.py: the draft's layers and heads, the target's block size and count), where a
sequence takes blocks at its first draft and gives them back when it is trimmed, forgotten,
cancelled or over. The draft's cache lags the sequence: it holds what the draft has seen, so
each sequence feeds what it has not (its prompt at its first draft, then the one or two
tokens kept last round, or all it made while it drafted nothing). Proposing n tokens for B
sequences is n forward passes of the draft, whatever B:

    position 0     ONE ragged pass (paged.RaggedView): each sequence feeds its unseen tokens,
                   the sequences feeding as many one group -> every row's first proposal
    position j     ONE decode pass over the sequences asking for more than j, each feeding
                   its proposal j - 1 -> their proposal j

A draft's bits are the batch's: its products are shaped by the rows beside it, so a proposal
may differ from the one the sequence would get drafting alone (at a near tie). That is safe:
a proposal is only a proposal, the target verifies it and the tokens stay exact. In
batch-invariant mode each row is computed by the very call a batch of one makes, as the
engine's decode is, so a sequence's proposals are those it gets alone (tested).

The draft length (``draft_length``): with ``weight_rows`` unset, every draft is
``num_speculative_tokens`` long (vLLM's behaviour; ``disable_by_batch_size``, vLLM's too, turns
drafting off while more sequences than that are decoding). With ``weight_rows`` = W set, the
length is the chapter's formula's best (sim.speculative): a step over R rows is taken to cost
W + R (reading the weights is worth W rows of arithmetic), so drafting n tokens per sequence in
a batch of B costs v(n) = (W + B (n + 1)) / (W + B) plain steps, and yields
(1 - alpha^(n+1)) / (1 - alpha) tokens for the sequence's acceptance alpha, measured so far
(accepted + 1) / (judged + 2): n is the length with the best ratio, 0 included (no draft). So
drafts shorten as the batch grows and as a sequence's proposals are rejected.
With ``min_acceptance`` = m set (either way), a sequence whose alpha is below m drafts nothing
this step: one row, a plain decode's cost, where its drafts have mostly been rejected (free
generation: a lookup that finds some match almost every step, and little of it right).
And, m set, a lookup, whose proposals are judged for free (below), drafts only once one has
been: a sequence's first decode step only judges (its alpha 1/2 before any evidence would
pass m = 1/2), so text that does not repeat never pays for a rejected first draft, n + 1
rows where a plain step feeds 1 (a pass over n + 1 rows costs v(n) one-row passes, well
above 1 on a CPU: experiment 22 measures it).
A sequence's books count, of every verified draft, its accepted tokens and the one rejected;
and, at a step where it drafts nothing (the rule, the batch, the budget), its lookup's first
proposal against the token the step made, free to know (a sampled token equals it with the
probability of accepting it): so alpha keeps moving while the sequence does not draft, and it
drafts again once its text starts repeating. A draft model's proposal costs a pass: its books
move only with its drafts.
"""
import math
from dataclasses import dataclass

import numpy as np

from minitransformer.lookup import PromptLookup
from minitransformer.sampling import (
    SamplingSettings,
    apply_repetition_penalty,
    draw,
    next_token,
    probabilities,
)
from minitransformer.serve.config import SpeculativeConfig
from minitransformer.serve.paged import PagedCache
from minitransformer.serve.runner import Feed, Runner
from minitransformer.shape import parameter_count
from minitransformer.speculative import LookupDraft, check_vocabulary
from sim.speculative import batch_verify_cost, speedup


@dataclass(frozen=True)
class Ask:
    """One sequence's request for proposals this step."""
    seq_id: object
    tokens: list            # prompt + output so far
    n: int                  # the most proposals wanted (0: none)
    settings: SamplingSettings  # greedy proposals, or draws with their q
    rng: np.random.Generator    # its own


class Proposer:
    """Where one engine's drafts come from: a prompt lookup for all, or a draft model over a
    paged pool of its own. A draft model proposes only within its own positions (``room``),
    however long the target's are."""
    lookup: LookupDraft | None          # the one, or
    draft: "DraftModel | None"          # the other

    def __init__(self, config: SpeculativeConfig, target, draft_model=None,
                 num_blocks: int = 64, block_size: int = 16, batch_invariant: bool = False):
        """num_blocks, block_size: the draft model's pool (the target's); batch_invariant:
        each draft row computed as a batch of one. The config's draft length was checked
        against the target by the engine (config.check_against), before the pool was made."""
        if config.method == "ngram":
            self.lookup = LookupDraft(PromptLookup(config.prompt_lookup_max,
                                                   config.prompt_lookup_min,
                                                   past_insertion=True),
                                      target.config.vocab_size)
            self.draft, self.cost = None, 0.0
            return
        if draft_model is None:
            raise ValueError("method 'draft_model' needs the draft model loaded")
        check_vocabulary(draft_model.config, target.config)
        self.lookup = None
        self.draft = DraftModel(draft_model, num_blocks, block_size, batch_invariant)
        # c of the formula: a decode step reads every weight, so a draft token costs the
        # draft's parameters over the target's
        self.cost = parameter_count(draft_model.config) / parameter_count(target.config)

    def propose(self, asks: list[Ask]) -> list:
        """Every ask's proposals at once -> per ask (tokens, their q), q None when greedy; at
        most ask.n tokens (a lookup may find fewer, a draft model's full pool gives fewer)."""
        if self.lookup is not None:
            return [self.lookup.propose(a.tokens, a.n, a.settings, a.rng) if a.n > 0
                    else ([], []) for a in asks]
        assert self.draft is not None   # no lookup: a draft model
        for a in asks:                  # past the draft's positions: it drafts no more
            if self.room(a.tokens) < 1:
                self.forget(a.seq_id)
        return self.draft.propose([a if a.n <= self.room(a.tokens) else
                                   Ask(a.seq_id, a.tokens, self.room(a.tokens), a.settings,
                                       a.rng) for a in asks])

    def room(self, tokens: list):
        """The most proposals the draft can make for a sequence of these tokens: a draft
        model feeds the tokens and all but its last proposal, within its positions (a prompt
        lookup: no limit, math.inf).

        >>> from minitransformer.checkpoints.synth import qwen2_config, random_model
        >>> config = SpeculativeConfig(3, "draft_model", "-")
        >>> short = Proposer(config, random_model(qwen2_config(max_position_embeddings=64)),
        ...                  random_model(qwen2_config(max_position_embeddings=8)))
        >>> [short.room([1] * length) for length in (2, 7, 8, 9)]
        [7, 2, 1, 0]
        """
        if self.lookup is not None:
            return math.inf
        assert self.draft is not None   # no lookup: a draft model
        return max(0, self.draft.model.config.max_position_embeddings - len(tokens) + 1)

    def shadow(self, tokens: list):
        """The first token a lookup would propose now, None if it finds none or this is a draft
        model (whose proposal costs a pass): judged against the token made, for the books."""
        if self.lookup is None:
            return None
        first = self.lookup.lookup.propose(tokens, 1)
        return first[0] if first else None

    def rollback(self, seq_id, valid: int) -> None:
        """The sequence keeps its first `valid` tokens: the draft's cache forgets the rest."""
        if self.draft is not None:
            self.draft.rollback(seq_id, valid)

    def forget(self, seq_id) -> None:
        """The sequence drafts no more (over, cancelled, past the draft's positions): what
        the draft held for it goes back."""
        if self.draft is not None:
            self.draft.forget(seq_id)

    def holding(self) -> set:
        """The sequences the draft holds blocks for."""
        return set() if self.draft is None else set(self.draft.pool.books.seqs)


class DraftModel:
    """A draft model over a paged pool of its own: proposals for a batch, a pass a position."""

    def __init__(self, model, num_blocks: int, block_size: int, batch_invariant: bool = False):
        self.model, self.pool = model, PagedCache.allocate(model.config, num_blocks, block_size)
        self.runner = Runner(model, self.pool, batch_invariant)
        self.passes = 0     # forward passes of the draft, one a draft position

    def propose(self, asks: list[Ask]) -> list:
        """Per ask, up to ask.n proposals and their q: ONE pass for every row's first, then
        ONE pass a position over the rows asking for more (the module's docstring)."""
        n = self._fit(asks)                              # per ask, what its blocks allow
        out: list[tuple[list, list]] = [([], []) for _ in asks]  # (proposals, q)
        rows = [b for b, a in enumerate(asks) if n[b] > 0]
        if not rows:
            return out
        logits = self._first([asks[b] for b in rows])                       # (B, V)
        for j in range(max(n)):
            if j:
                rows = [b for b in rows if n[b] > j]
                logits = self._next([asks[b].seq_id for b in rows],
                                    [out[b][0][-1] for b in rows])           # (B', V)
            for b, z in zip(rows, logits, strict=True):
                choose(z, asks[b], *out[b])
        return out

    def _fit(self, asks: list[Ask]) -> list[int]:
        """Per ask, its n cut to what the draft's free blocks hold (in order; 0 where even its
        unseen tokens do not fit): it feeds its unseen tokens and all but its last proposal."""
        books, n = self.pool.books, []
        free = books.num_free
        for a in asks:
            seq = books.seqs.get(a.seq_id)
            held, length = (0, 0) if seq is None else (len(seq.blocks), seq.length)
            fits = 0 if a.n < 1 else max(0, min(a.n, (held + free) * books.block_size
                                                 - len(a.tokens) + 1))
            n.append(fits)
            if fits:
                free -= max(0, books.blocks_for(len(a.tokens) + fits - 1) - held)
        return n

    def _first(self, asks: list[Ask]) -> np.ndarray:
        """Each row feeds what the draft has not seen, in ONE ragged pass (the rows feeding
        as many tokens one group; batch-invariant: each row a pass of its own) -> its last
        position's logits (B, V)."""
        books, fresh, starts = self.pool.books, [], []
        for a in asks:
            if a.seq_id not in books.seqs:
                books.add(a.seq_id, a.tokens[:1], reuse=False)    # its blocks: none held yet
            seen = books.seqs[a.seq_id].length
            fresh.append(a.tokens[seen:])
            starts.append(books.append([a.seq_id], len(fresh[-1]))[0])
        self.passes += 1
        if self.runner.batch_invariant:     # each row the very call a batch of one makes
            return np.stack([self.runner.prompt(a.seq_id, s, f)[0]
                             for a, f, s in zip(asks, fresh, starts, strict=True)])
        logits, _ = self.runner.ragged([Feed(a.seq_id, s, f, picks="last")
                                        for a, f, s in zip(asks, fresh, starts, strict=True)])
        return np.concatenate(logits)                                           # (B, V)

    def _next(self, seq_ids: list, last) -> np.ndarray:
        """The rows feed their last proposals, ONE decode pass -> logits (B', V)."""
        starts = self.pool.books.append(seq_ids, 1)
        self.passes += 1
        return self.runner.decode(seq_ids, starts, [[t] for t in last])

    def rollback(self, seq_id, valid: int) -> None:
        """Keep the draft's cache of a sequence to its first `valid` tokens; a windowed draft's
        blocks that slid out of the window go back then (its next feed starts at those)."""
        seq = self.pool.books.seqs.get(seq_id)
        if seq is not None and seq.length > valid:
            self.pool.books.trim(seq_id, seq.length - valid)
        if seq is not None:
            self.pool.books.slide(seq_id)

    def forget(self, seq_id) -> None:
        if seq_id in self.pool.books.seqs:
            self.pool.books.free_seq(seq_id)


def choose(logits, ask: Ask, drafts: list, dists: list) -> None:
    """The draft's next proposal from its logits (V,): greedy, as plain decoding picks (q
    None), or a draw from its distribution q, which the verification needs."""
    context = ask.tokens + drafts
    if ask.settings.greedy:
        drafts.append(next_token(logits, context, ask.settings, ask.rng))
        dists.append(None)
        return
    z = apply_repetition_penalty(logits, context, ask.settings.repetition_penalty)
    q = probabilities(z, ask.settings)                                          # (V,)
    drafts.append(draw(q, ask.rng))
    dists.append(q)


def acceptance(accepted: int, judged: int) -> float:
    """A sequence's alpha so far, (accepted + 1) / (judged + 2): 1/2 before any evidence.

    >>> acceptance(0, 0), acceptance(9, 10)
    (0.5, 0.8333333333333334)
    """
    return (accepted + 1) / (judged + 2)


def draft_length(config: SpeculativeConfig, alpha: float, batch: int, cost: float = 0.0,
                 judged: int | None = None) -> int:
    """Tokens a sequence drafts this step (see the module's docstring for the rule).

    batch: the decoding sequences; cost: c, a draft token's cost in target steps (0: a
    lookup); judged: the sequence's proposals judged so far (None: not known).
    >>> adaptive = SpeculativeConfig(num_speculative_tokens=5, weight_rows=16)
    >>> [draft_length(adaptive, 0.8, b) for b in (1, 4, 16, 64)]      # the batch grows
    [5, 4, 2, 0]
    >>> [draft_length(adaptive, a, 4) for a in (0.9, 0.6, 0.2)]       # acceptance falls
    [5, 2, 0]
    >>> cutoff = SpeculativeConfig(num_speculative_tokens=8, min_acceptance=0.5)
    >>> [draft_length(cutoff, a, 1) for a in (0.9, 0.5, 0.4)]         # below it: no draft
    [8, 8, 0]
    >>> [draft_length(cutoff, 0.5, 1, judged=j) for j in (0, 1)]      # a lookup: evidence first
    [0, 8]
    """
    if config.disable_by_batch_size is not None and batch > config.disable_by_batch_size:
        return 0
    if config.min_acceptance is not None and (alpha < config.min_acceptance or
                                              cost == 0 and judged == 0):
        return 0
    top = config.num_speculative_tokens
    if config.weight_rows is None:
        return top
    W = config.weight_rows

    def gain(n):                    # tokens per plain step's time; no draft: exactly 1
        return 1.0 if n == 0 else speedup(alpha, n, cost, batch_verify_cost(n, batch, W))
    return max(range(top + 1), key=gain)
