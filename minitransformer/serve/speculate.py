"""Speculative decoding in the server: every sequence drafts, one batched pass verifies all.

The library's ``speculative_generate`` (speculative.py) runs one sequence: draft, verify in one
target pass, keep, trim. An engine step does the same for the whole batch at once:

    propose   each decoding sequence may carry a draft of n_b tokens: prompt lookup over
              its prompt and output (vLLM's ``ngram`` method, lookup.py), or a draft model
              with its own cache per sequence (speculative.ModelDraft); ``draft_length``
              decides n_b (below)
    verify    ONE forward pass of the target over the paged cache, whatever the drafts:
              sequence b feeds its last token and its n_b proposals, n_b + 1 rows; a sequence
              without a draft feeds its last token alone, an ordinary decode row (batch-
              invariant: row by row, as the engine's decode)
    accept    per sequence, the library's rule on its rows of logits (``speculative.verify``:
              greedy keeps the longest agreeing prefix plus one token of the target's own;
              sampling, Leviathan's rejection rule, with the sequence's own generator)
    trim      the positions of rejected proposals leave the cache (``PagedCache.trim``): a
              block that held only rejected positions goes back to the pool

The verification pass (``verify_logits``): by default a ragged batch (paged.RaggedView), each
sequence a segment of its fed tokens, causal within it, all R tokens through every product at
once: the weights are read once for the whole pass, as for a decode; what grows with the rows
is the arithmetic and the attention's reads of the cache, which is why speculation pays at
small batches and not at large ones (experiment 22, ``scripts/bench_spec_serving.py``). Its
products are shaped otherwise than a decode's, so a greedy token may differ from plain
decoding's only at a near tie. In batch-invariant mode each verified position is a row of its
own, one token long, over its sequence's block table at its own position (``verify_view``),
computed row by row in order by the very call a one-token decode of that sequence makes: the
very bits, so greedy tokens are the engine's without speculation (==).

The blocks: the scheduler's plan holds each row's slot for its last token, as for a decode
(a shared or named block about to be written is copied first: a named block is never
written); the proposals get their slots here, in fresh blocks from the free list, and after
the pass each sequence is trimmed back to the tokens it kept, a block that held only rejected
positions going back. Speculation never preempts anyone: a draft longer than the free blocks
allow is cut to what fits. The proposals are tokens of the step: with max_num_batched_tokens
set, the drafts together take at most what the plan left of it (its decodes' last tokens and
its prompt chunks come first), the rows drafting in order.

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

Counters (``SpecCounters``, served under vLLM's names in /metrics): drafts (a sequence's
proposal of at least one token, verified), draft tokens, accepted tokens, and accepted tokens
by position in the draft.
Leaves out: tree drafts, EAGLE/Medusa heads; a draft model batched over the sequences: each
drafts alone, on its own contiguous cache, which stands at its own length and is fed what it
has not seen (the prompt at its first draft, then the one or two tokens kept last round), so
one draft pass for all would be a ragged batch over a paged pool of the draft's own; and the
chunked-prefill step's one pass: a step with prompt chunks runs them in passes of their own
after the verification (the verification's segments would be more groups of that ragged pass,
but this step, drafts, pass, acceptance, would have to split around a pass the engine owns).
"""
import json
import math
from dataclasses import dataclass, field, replace

import numpy as np

from minitransformer.backend import to_numpy
from minitransformer.checks import is_integer, is_real, no_duplicates
from minitransformer.generate import last_logits_alone
from minitransformer.lookup import PromptLookup
from minitransformer.model import forward, head
from minitransformer.serve.paged import PagedView, RaggedView
from minitransformer.shape import parameter_count
from minitransformer.speculative import LookupDraft, ModelDraft, verify
from sim.speculative import batch_verify_cost, speedup

METHODS = ("ngram", "draft_model")
FIELDS = ("method", "model", "num_speculative_tokens", "prompt_lookup_max",
          "prompt_lookup_min", "disable_by_batch_size", "weight_rows", "min_acceptance")


@dataclass(frozen=True)
class SpeculativeConfig:
    """``--speculative-config``, under vLLM's field names (weight_rows and min_acceptance are
    this project's)."""
    num_speculative_tokens: int      # the longest draft
    method: str = "ngram"            # "ngram" (prompt lookup) or "draft_model"
    model: str = None                # the draft model's checkpoint (method draft_model)
    prompt_lookup_max: int = 3       # ngram: the longest n-gram looked up
    prompt_lookup_min: int = 1       # ngram: the shortest
    disable_by_batch_size: int = None  # no drafts while more sequences than this decode
    weight_rows: float = None        # set: draft lengths adapt (see the module's docstring)
    min_acceptance: float = None     # set: no draft while a sequence's acceptance is below it


def parse_speculative_config(value) -> SpeculativeConfig:
    """A JSON text or a dict -> SpeculativeConfig; a ValueError naming the bad field.

    >>> parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 5, '
    ...                          '"prompt_lookup_max": 4}').prompt_lookup_max
    4
    >>> parse_speculative_config({"num_speculative_tokens": None})
    Traceback (most recent call last):
    ...
    ValueError: speculative config: num_speculative_tokens must be an integer >= 1, got None

    A null optional field is the field left out (its default), as vLLM reads it. How long a
    draft may be against the model is checked against its config (``check_against``): the
    model's positions are not known here.
    """
    where = "speculative config"
    if isinstance(value, str):
        try:
            value = json.loads(value, object_pairs_hook=no_duplicates(lambda twice: ValueError(
                f"{where}: field(s) given twice: {', '.join(twice)}")))
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not JSON ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(value).__name__}")
    unknown = sorted(set(value) - set(FIELDS))
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {', '.join(map(repr, unknown))} "
                         f"(known: {', '.join(FIELDS)})")
    fields = {name: v for name, v in value.items()       # null: the default
              if v is not None or name == "num_speculative_tokens"}
    if fields.get("model") is not None and "method" not in fields:
        fields["method"] = "draft_model"        # vLLM infers it from the model
    method = fields.get("method", "ngram")
    if method not in METHODS:
        raise ValueError(f"{where}: method {method!r} is not served here: use "
                         f"{' or '.join(map(repr, METHODS))}")
    if "num_speculative_tokens" not in fields:
        raise ValueError(f"{where}: num_speculative_tokens is required (the longest draft)")
    for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
                 "disable_by_batch_size"):
        if name not in fields:
            continue
        n = fields[name]
        if not is_integer(n) or n < 1:
            raise ValueError(f"{where}: {name} must be an integer >= 1, got {n!r}")
    rows = fields.get("weight_rows")
    if rows is not None and (not is_real(rows) or not 0 < rows < float("inf")):
        raise ValueError(f"{where}: weight_rows must be a finite number > 0, got {rows!r}")
    least = fields.get("min_acceptance")
    if least is not None and (not is_real(least) or not 0 < least <= 1):
        raise ValueError(f"{where}: min_acceptance must be a number in (0, 1], got {least!r}")
    config = SpeculativeConfig(**fields)
    if method == "ngram":
        if config.model is not None:
            raise ValueError(f"{where}: model {config.model!r} is for method 'draft_model', "
                             f"not 'ngram'")
        if config.prompt_lookup_min > config.prompt_lookup_max:
            raise ValueError(f"{where}: prompt_lookup_min ({config.prompt_lookup_min}) is "
                             f"more than prompt_lookup_max ({config.prompt_lookup_max})")
    elif not isinstance(config.model, str) or not config.model:
        raise ValueError(f"{where}: method 'draft_model' needs model, the draft's "
                         f"checkpoint path")
    return config


def check_against(config: SpeculativeConfig, target, draft=None) -> None:
    """The config against the target's ModelConfig (and the draft model's, once loaded),
    before anything is allocated for speculation: no draft longer than the target has
    positions (a sequence could never take it; its books, one counter a position, would be
    that long), and a draft model's vocabulary the target's. ValueErrors naming both sizes.
    A draft model with fewer positions than the target is served: a sequence drafts only
    while it fits the draft's positions (``Proposer.room``), as vLLM does."""
    positions = target.max_position_embeddings
    if config.num_speculative_tokens > positions:
        raise ValueError(f"speculative config: num_speculative_tokens="
                         f"{config.num_speculative_tokens} is more than the model's "
                         f"{positions} positions")
    if draft is not None and draft.vocab_size != target.vocab_size:
        raise ValueError(f"draft and target must share a vocabulary: the draft has "
                         f"{draft.vocab_size} tokens, the target {target.vocab_size}")


# --- proposals -------------------------------------------------------------------------------
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


# --- verification ----------------------------------------------------------------------------
def verify_view(cache, seq_ids, counts) -> PagedView:
    """The verification rows of a step: sequence seq_ids[b] feeds its last counts[b] tokens,
    each a row one token long at its own position, over the sequence's blocks (row order:
    sequence by sequence). They are counted in the books already (``append``); forward
    writes every row's keys and values before any row reads, and each row reads up to its
    own position."""
    ids, starts = [], []
    for seq_id, count in zip(seq_ids, counts):
        length = cache.seqs[seq_id].length
        ids += [seq_id] * count
        starts += range(length - count, length)
    return cache.view(ids, starts)


def verify_logits(model, cache, seq_ids, fed, batch_invariant=False):
    """One forward pass of the target over every sequence's fed tokens (its last token, then
    its proposals), counted in the books already (``append``) -> logits (R, V), R = the fed
    tokens of all, sequence by sequence (trim the rejected ones after). Default: a ragged batch
    (paged.RaggedView), the sequences feeding as many tokens one group, causal within each
    row, the R tokens through every product at once. batch_invariant: row by row
    (``verify_view``), each the very call a batch of one makes, in order."""
    if batch_invariant:
        ids = np.array([[t] for tokens in fed for t in tokens])                # (R, 1)
        return last_logits_alone(model, ids, verify_view(cache, seq_ids, map(len, fed)))
    # sequences feeding as many tokens attend as one group (no draft at all: a plain decode)
    by_count = {}
    for b, tokens in enumerate(fed):
        by_count.setdefault(len(tokens), []).append(b)
    order = [b for rows in by_count.values() for b in rows]          # the pass's row order
    ids = np.array([[t for b in order for t in fed[b]]])                       # (1, R)
    view = RaggedView(cache, [([seq_ids[b] for b in rows],
                               [cache.seqs[seq_ids[b]].length - n for b in rows], n)
                              for n, rows in by_count.items()])
    logits = to_numpy(head(model, forward(model, ids, view)))[0]               # (R, V)
    ends = np.cumsum([0] + [len(fed[b]) for b in order])
    mine = {b: logits[ends[i]:ends[i + 1]] for i, b in enumerate(order)}
    return np.concatenate([mine[b] for b in range(len(fed))])                  # (R, V)


def split_rows(logits, counts) -> list:
    """(R, V) -> one (count, V) array per sequence, in order."""
    return np.split(logits, np.cumsum(counts)[:-1])


@dataclass
class SpecCounters:
    """What speculation did since the engine started (vLLM's spec_decode counters)."""
    drafts: int = 0                 # verified proposals of at least one token
    draft_tokens: int = 0           # tokens proposed and verified
    accepted_tokens: int = 0        # of those, accepted
    per_position: list = field(default_factory=list)   # accepted at draft position 0, 1, ...
    # per_position is as long as the longest draft verified, not num_speculative_tokens: a
    # /metrics line a position, so never more lines than drafts made positions

    def copy(self) -> "SpecCounters":
        """A snapshot for another thread (the server's /metrics)."""
        return replace(self, per_position=list(self.per_position))

    def count(self, proposed: int, accepted: int) -> None:
        """One sequence's verified draft: proposed tokens, of which the first `accepted`."""
        if proposed == 0:
            return
        self.drafts += 1
        self.draft_tokens += proposed
        self.accepted_tokens += accepted
        self.per_position += [0] * (proposed - len(self.per_position))
        for position in range(accepted):
            self.per_position[position] += 1


@dataclass(eq=False)
class Row:
    """A decoding sequence as a step of speculation sees it."""
    seq_id: object
    tokens: list            # prompt + output; the cache holds all but the last
    prompt_len: int
    max_new_tokens: int
    settings: object        # its SamplingSettings
    rng: object             # its own generator
    padding: bool = False   # static batching's finished row: computed, thrown away


class Speculator:
    """Speculation for one engine: proposals, the verification pass, the books."""

    def __init__(self, config: SpeculativeConfig, model, draft_model=None):
        self.config, self.model = config, model
        self.proposer = Proposer(config, model, draft_model)
        self.counters = SpecCounters()
        self.judged = {}    # sequence id -> [accepted, judged] proposals, for its alpha
        self.fed = []       # the last step's tokens fed per row (its last token + drafts)

    def step(self, cache, rows, batch_invariant=False, spare=None) -> list:
        """Draft, make room, verify every row in one pass -> per row (kept tokens, the logits
        (k, V) each was chosen from). Each row's last token is counted in the books already,
        its slot held (the scheduler's plan: ``append``); its proposals get room here, from
        the free list only (a block the plan will still copy from or revive is never taken).
        spare: the tokens of the step's budget (max_num_batched_tokens) the plan left, None
        for no budget: the drafts together take no more, the rows drafting in order.
        The caches hold the verified positions until ``settle``."""
        ids = [row.seq_id for row in rows]
        decoding = sum(not row.padding for row in rows)
        fed, drafts, dists, shadows = [], [], [], []
        for row in rows:
            n = 0 if row.padding else self._length(cache, row, decoding, spare)
            proposal, q = self.proposer.propose(row.seq_id, row.tokens, n, row.max_new_tokens,
                                                row.prompt_len, row.settings, row.rng)
            cache.append([row.seq_id], len(proposal))   # fits: _length counted it
            spare = None if spare is None else spare - len(proposal)
            fed.append([row.tokens[-1]] + proposal)
            drafts.append(proposal)
            dists.append(q)
            shadows.append(None if proposal or row.padding else self.proposer.shadow(row.tokens))
        self.fed = list(map(len, fed))
        logits = verify_logits(self.model, cache, ids, fed, batch_invariant)
        out = []
        for row, z, proposal, q, shadow in zip(rows, split_rows(logits, self.fed), drafts,
                                               dists, shadows):
            if row.padding:
                out.append(([], z[:0]))
                continue
            kept = verify(z, proposal, q, row.tokens, row.settings, row.rng)
            self.counters.count(len(proposal), len(kept) - 1)
            self._judge(row.seq_id, len(proposal), kept, shadow)
            out.append((kept, z[:len(kept)]))
        return out

    def _judge(self, seq_id, proposed: int, kept: list, shadow) -> None:
        """A sequence's books for its acceptance: of a verified draft, its accepted tokens and
        the one rejected (if any); with no draft, the lookup's proposal it would have made
        (shadow: its first token, None if none) against the token the step made, one judged
        token, free to know (a sampled token equals it with the probability of accepting it)."""
        books = self.judged.setdefault(seq_id, [0, 0])
        accepted = len(kept) - 1
        if proposed:
            books[0] += accepted
            books[1] += accepted + (accepted < proposed)
        elif shadow is not None:
            books[0] += shadow == kept[0]
            books[1] += 1

    def settle(self, cache, seq_id, valid: int) -> None:
        """After a step: the sequence keeps its first `valid` tokens in the cache (the rest,
        rejected or past its end, are trimmed: their blocks go back), the draft's too."""
        cache.trim(seq_id, cache.seqs[seq_id].length - valid)
        self.proposer.rollback(seq_id, valid)

    def forget(self, seq_id) -> None:
        """A sequence is over: its books and draft cache go."""
        self.judged.pop(seq_id, None)
        self.proposer.forget(seq_id)

    def retain(self, seq_ids) -> None:
        """Forget every sequence but these (the engine's running and waiting ones)."""
        for seq_id in (set(self.judged) | set(self.proposer.drafts)) - set(seq_ids):
            self.forget(seq_id)

    def _length(self, cache, row, batch: int, spare=None) -> int:
        """This step's draft length for a row: the rule's, never past the request's end or
        the draft model's positions, never more than the budget's spare tokens or the free
        blocks hold (speculation preempts nobody). A sequence past the draft's positions
        drafts no more: its draft cache goes."""
        made, room = len(row.tokens) - row.prompt_len, self.proposer.room(row.tokens)
        if room < 1:
            self.proposer.forget(row.seq_id)
        n = min(draft_length(self.config, acceptance(*self.judged.get(row.seq_id, (0, 0))),
                             batch, self.proposer.cost),
                row.max_new_tokens - made - 1, room, math.inf if spare is None else spare)
        seq, bs = cache.seqs[row.seq_id], cache.block_size
        room = (len(seq.blocks) + len(cache.free)) * bs - seq.length    # after its one token
        return max(0, min(n, room))
