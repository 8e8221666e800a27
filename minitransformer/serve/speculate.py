"""Speculative decoding in the server: every sequence drafts, one batched pass verifies all.

The library's ``speculative_generate`` (speculative.py) runs one sequence: draft, verify in one
target pass, keep, trim. An engine step does the same for the whole batch at once:

    propose   each decoding sequence may carry a draft of n_b tokens, all of them from ONE
              call of the proposer (drafting.py: a prompt lookup, or a draft model whose
              cache is paged, one batched draft pass per draft position); ``draft_length``
              decides n_b
    verify    ONE forward pass of the target over the paged cache, whatever the drafts:
              sequence b feeds its last token and its n_b proposals, n_b + 1 rows; a sequence
              without a draft feeds its last token alone, an ordinary decode row (batch-
              invariant: row by row, as the engine's decode)
    accept    per sequence, the library's rule on its rows of logits (``speculative.verify``:
              greedy keeps the longest agreeing prefix plus one token of the target's own;
              sampling, Leviathan's rejection rule, with the sequence's own generator)
    trim      the positions of rejected proposals leave the cache (``PagedCache.trim``): a
              block that held only rejected positions goes back to the pool, and the draft
              model's cache is trimmed to the same tokens

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
allow is cut to what fits (``fits``). The proposals are tokens of the step: with
max_num_batched_tokens set, the drafts together take at most what the plan left of it (its
decodes' last tokens and its prompt chunks come first), the rows drafting in order.

The draft length, the acceptance books (a sequence's accepted and judged proposals, and at a
step where it drafts nothing its lookup's first proposal judged against the token made) and
the counters (``SpecCounters``, served under vLLM's names in /metrics): docs/serving.md,
"Speculative decoding".
Leaves out: tree drafts, EAGLE/Medusa heads; and the chunked-prefill step's one pass: a step
with prompt chunks runs them in passes of their own after the verification.
"""
import math
from dataclasses import dataclass, field, replace

import numpy as np

from minitransformer.backend import to_numpy
from minitransformer.generate import last_logits, last_logits_alone
from minitransformer.model import forward, head
from minitransformer.serve.config import SpeculativeConfig
from minitransformer.serve.drafting import Ask, Proposer, acceptance, draft_length
from minitransformer.serve.paged import PagedView, RaggedView
from minitransformer.speculative import verify

# --- verification ----------------------------------------------------------------------------
def verify_view(cache, seq_ids, counts) -> PagedView:
    """The verification rows of a step: sequence seq_ids[b] feeds its last counts[b] tokens,
    each a row one token long at its own position, over the sequence's blocks (row order:
    sequence by sequence). They are counted in the books already (``append``); forward
    writes every row's keys and values before any row reads, and each row reads up to its
    own position."""
    ids, starts = [], []
    for seq_id, count in zip(seq_ids, counts):
        length = cache.books.seqs[seq_id].length
        ids += [seq_id] * count
        starts += range(length - count, length)
    return cache.view(ids, starts)


def verify_logits(model, cache, seq_ids, fed, batch_invariant=False):
    """One forward pass of the target over every sequence's fed tokens (its last token, then
    its proposals), counted in the books already (``append``) -> logits (R, V), R = the fed
    tokens of all, sequence by sequence (trim the rejected ones after). Default: a ragged batch
    (paged.RaggedView), the sequences feeding as many tokens one group, causal within each
    row, the R tokens through every product at once; a step without drafts, the engine's decode
    call (the very bits of a step without speculation). batch_invariant: row by row
    (``verify_view``), each the very call a batch of one makes, in order."""
    if batch_invariant:
        ids = np.array([[t] for tokens in fed for t in tokens])                # (R, 1)
        return last_logits_alone(model, ids, verify_view(cache, seq_ids, map(len, fed)))
    if all(len(tokens) == 1 for tokens in fed):     # no drafts: the engine's decode call
        return last_logits(model, np.array(fed), verify_view(cache, seq_ids, [1] * len(fed)))
    # sequences feeding as many tokens attend as one group
    by_count = {}
    for b, tokens in enumerate(fed):
        by_count.setdefault(len(tokens), []).append(b)
    order = [b for rows in by_count.values() for b in rows]          # the pass's row order
    ids = np.array([[t for b in order for t in fed[b]]])                       # (1, R)
    view = RaggedView(cache, [([seq_ids[b] for b in rows],
                               [cache.books.seqs[seq_ids[b]].length - n for b in rows], n)
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

    def __init__(self, config: SpeculativeConfig, model, draft_model=None, num_blocks: int = 64,
                 block_size: int = 16, batch_invariant: bool = False):
        """num_blocks, block_size: the target's pool (a draft model's pool is as large);
        batch_invariant: the draft's rows too are computed as batches of one."""
        self.config, self.model = config, model
        self.proposer = Proposer(config, model, draft_model, num_blocks, block_size,
                                 batch_invariant)
        self.counters = SpecCounters()
        self.judged = {}    # sequence id -> [accepted, judged] proposals, for its alpha
        self.fed = []       # the last step's tokens fed per row (its last token + drafts)

    def step(self, cache, rows, batch_invariant=False, spare=None) -> list:
        """Draft, make room, verify every row in one pass -> per row (kept tokens, the logits
        (k, V) each was chosen from). Each row's last token is counted in the books already,
        its slot held (the scheduler's plan: ``append``); every row's proposals come from ONE
        call of the proposer, then get room here, from the free list only (a block the plan
        will still copy from or revive is never taken), each cut to what fits.
        spare: the tokens of the step's budget (max_num_batched_tokens) the plan left, None
        for no budget: the drafts together take no more, the rows drafting in order.
        The caches hold the verified positions until ``settle``."""
        ids = [row.seq_id for row in rows]
        decoding = sum(not row.padding for row in rows)
        proposals = self.proposer.propose([Ask(
            row.seq_id, row.tokens, 0 if row.padding else self._length(row, decoding),
            row.settings, row.rng) for row in rows])
        fed, drafts, dists, shadows = [], [], [], []
        for row, (proposal, q) in zip(rows, proposals):
            n = fits(cache, row.seq_id, len(proposal), spare)
            cache.books.append([row.seq_id], n)
            spare = None if spare is None else spare - n
            fed.append([row.tokens[-1]] + proposal[:n])
            drafts.append(proposal[:n])
            dists.append(q[:n])
            shadows.append(None if n or row.padding else self.proposer.shadow(row.tokens))
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
        cache.books.trim(seq_id, cache.books.seqs[seq_id].length - valid)
        self.proposer.rollback(seq_id, valid)

    def forget(self, seq_id) -> None:
        """A sequence is over: its books and the draft's blocks of it go."""
        self.judged.pop(seq_id, None)
        self.proposer.forget(seq_id)

    def retain(self, seq_ids) -> None:
        """Forget every sequence but these (the engine's running and waiting ones)."""
        for seq_id in (set(self.judged) | self.proposer.holding()) - set(seq_ids):
            self.forget(seq_id)

    def _length(self, row, batch: int) -> int:
        """This step's draft length for a row: the rule's, never past the request's end or
        the draft model's positions (the pool and the budget cut it after: ``fits``)."""
        made = len(row.tokens) - row.prompt_len
        books = self.judged.get(row.seq_id, (0, 0))
        return max(0, min(draft_length(self.config, acceptance(*books), batch,
                                       self.proposer.cost, books[1]),
                          row.max_new_tokens - made - 1, self.proposer.room(row.tokens)))


def fits(cache, seq_id, n: int, spare=None) -> int:
    """How many of n proposals a sequence's verification can feed: no more than the budget's
    spare tokens (None: no budget) or the free blocks hold after its one token (speculation
    preempts nobody)."""
    seq, bs = cache.books.seqs[seq_id], cache.books.block_size
    room = (len(seq.blocks) + len(cache.books.free)) * bs - seq.length
    return max(0, min(n, room, math.inf if spare is None else spare))
