"""Where a sequence's drafts come from, and how long they are (speculate.py verifies them).

Proposals (``Proposer``): prompt lookup over a sequence's prompt and output (vLLM's ``ngram``
method, lookup.py), or a draft model with its own cache per sequence (speculative.ModelDraft).

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
A sequence's books count, of every verified draft, its accepted tokens and the one rejected;
and, at a step where it drafts nothing (the rule, the batch, the budget), its lookup's first
proposal against the token the step made, free to know (a sampled token equals it with the
probability of accepting it): so alpha keeps moving while the sequence does not draft, and it
drafts again once its text starts repeating. A draft model's proposal costs a pass: its books
move only with its drafts.
"""
import math

import numpy as np

from minitransformer.lookup import PromptLookup
from minitransformer.serve.config import SpeculativeConfig, check_against
from minitransformer.shape import parameter_count
from minitransformer.speculative import LookupDraft, ModelDraft
from sim.speculative import batch_verify_cost, speedup


class Proposer:
    """Where one engine's drafts come from: a prompt lookup for all, or a draft model with a
    cache per sequence (made at its first draft, dropped with ``forget``). A draft model
    proposes only within its own positions (``room``), however long the target's are."""

    def __init__(self, config: SpeculativeConfig, target, draft_model=None):
        self.config, self.target = config, target
        check_against(config, target.config, None if draft_model is None else
                      draft_model.config)
        if config.method == "ngram":
            self.lookup = LookupDraft(PromptLookup(config.prompt_lookup_max,
                                                   config.prompt_lookup_min),
                                      target.config.vocab_size)
            self.cost = 0.0
        else:
            if draft_model is None:
                raise ValueError("method 'draft_model' needs the draft model loaded")
            self.lookup, self.draft_model = None, draft_model
            # c of the formula: a decode step reads every weight, so a draft token costs the
            # draft's parameters over the target's
            self.cost = parameter_count(draft_model.config) / parameter_count(target.config)
        self.drafts = {}    # sequence id -> its ModelDraft (draft_model only)

    def propose(self, seq_id, tokens: list, n: int, max_new_tokens: int, prompt_len: int,
                settings, rng) -> tuple:
        """Up to n proposals for a sequence (tokens: prompt + output), and their q (None when
        greedy). A draft model's cache for this sequence is made at its first call."""
        if n < 1:
            return [], []
        if self.lookup is not None:
            return self.lookup.propose(tokens, n, settings, rng)
        if seq_id not in self.drafts:      # its cache: no longer than the draft's positions
            fits = self.draft_model.config.max_position_embeddings - prompt_len
            self.drafts[seq_id] = ModelDraft(self.draft_model, self.target,
                                             np.array(tokens[:prompt_len]),
                                             min(max_new_tokens, fits))
        return self.drafts[seq_id].propose(tokens, n, settings, rng)

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
        return max(0, self.draft_model.config.max_position_embeddings - len(tokens) + 1)

    def shadow(self, tokens: list):
        """The first token a lookup would propose now, None if it finds none or this is a draft
        model (whose proposal costs a pass): judged against the token made, for the books."""
        if self.lookup is None:
            return None
        first = self.lookup.lookup.propose(tokens, 1)
        return first[0] if first else None

    def rollback(self, seq_id, valid: int) -> None:
        """The sequence keeps its first `valid` tokens: the draft's cache forgets the rest."""
        if seq_id in self.drafts:
            self.drafts[seq_id].rollback(valid)

    def forget(self, seq_id) -> None:
        self.drafts.pop(seq_id, None)


def acceptance(accepted: int, judged: int) -> float:
    """A sequence's alpha so far, (accepted + 1) / (judged + 2): 1/2 before any evidence.

    >>> acceptance(0, 0), acceptance(9, 10)
    (0.5, 0.8333333333333334)
    """
    return (accepted + 1) / (judged + 2)


def draft_length(config: SpeculativeConfig, alpha: float, batch: int, cost: float = 0.0) -> int:
    """Tokens a sequence drafts this step (see the module's docstring for the rule).

    batch: the decoding sequences; cost: c, a draft token's cost in target steps (0: lookup).
    >>> adaptive = SpeculativeConfig(num_speculative_tokens=5, weight_rows=16)
    >>> [draft_length(adaptive, 0.8, b) for b in (1, 4, 16, 64)]      # the batch grows
    [5, 4, 2, 0]
    >>> [draft_length(adaptive, a, 4) for a in (0.9, 0.6, 0.2)]       # acceptance falls
    [5, 2, 0]
    >>> cutoff = SpeculativeConfig(num_speculative_tokens=8, min_acceptance=0.5)
    >>> [draft_length(cutoff, a, 1) for a in (0.9, 0.5, 0.4)]         # below it: no draft
    [8, 8, 0]
    """
    if config.disable_by_batch_size is not None and batch > config.disable_by_batch_size:
        return 0
    if config.min_acceptance is not None and alpha < config.min_acceptance:
        return 0
    top = config.num_speculative_tokens
    if config.weight_rows is None:
        return top
    W = config.weight_rows

    def gain(n):                    # tokens per plain step's time; no draft: exactly 1
        return 1.0 if n == 0 else speedup(alpha, n, cost, batch_verify_cost(n, batch, W))
    return max(range(top + 1), key=gain)


