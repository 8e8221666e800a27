"""Speculative decoding in the server: every sequence drafts, one batched pass verifies all.

The library's ``speculative_generate`` (speculative.py) runs one sequence: draft, verify in one
target pass, keep, trim. An engine step does the same for the whole batch at once, each part
where it belongs (the engine's step is plan -> run -> commit either way):

    want      ``wants``: the draft tokens each decoding sequence would verify, by the length
              rule (drafting.py's ``draft_length``), never past its request's end or the draft
              model's positions
    plan      the scheduler cuts each to the step's budget and the free list's blocks and
              holds their slots after the row's last token (``Work.drafts``): never a kept
              prefix block, never a preemption
    propose   ``propose``: every row's proposals from ONE call of the proposer (drafting.py:
              a prompt lookup, or a draft model whose cache is paged, one batched draft pass
              per draft position), at most the slots held
    verify    the engine's ONE forward pass (by default with the step's prompts, whole or
              chunks, beside them): sequence b feeds its last token and its proposals; a
              sequence without a draft feeds its last token alone, an ordinary decode row.
              Then, per sequence, ``verify``: the library's rule on its rows of logits
              (``speculative.verify``: greedy keeps the longest agreeing prefix plus one
              token of the target's own; sampling, Leviathan's rejection rule, with the
              sequence's own generator), the counters, the acceptance books, the draft's
              cache kept to the same tokens
    commit    the scheduler trims each sequence back to the tokens it kept: the slots of
              rejected (or never proposed) proposals go back to the pool, the full blocks of
              kept tokens are named for the prefix cache

The verification pass (runner.py's ``Runner.decode``, or the step's ragged pass): by default a ragged
batch (paged.RaggedView), the sequences feeding as many tokens one group, causal within each
row, all R tokens through every product at once: the weights are read once for the whole
pass, as for a decode; what grows with the rows is the arithmetic and the attention's reads of
the cache, which is why speculation pays at small batches and not at large ones (experiment
22, ``scripts/bench_spec_serving.py``). Its products are shaped otherwise than a decode's, so
a greedy token may differ from plain decoding's only at a near tie. In batch-invariant mode
each verified position is a row of its own, one token long, over its sequence's block table
at its own position, computed row by row in order by the very call a one-token decode of
that sequence makes: the very bits, so greedy tokens are the engine's without speculation (==).

The draft length, the acceptance books (a sequence's accepted and judged proposals, and at a
step where it drafts nothing its lookup's first proposal judged against the token made) and
the counters (``SpecCounters``, served under vLLM's names in /metrics): docs/serving.md,
"Speculative decoding".
Leaves out: tree drafts, EAGLE/Medusa heads, a draft model's prefix cache.
"""
from dataclasses import dataclass, field, replace

from minitransformer.serve.config import SpeculativeConfig
from minitransformer.serve.drafting import Ask, Proposer, acceptance, draft_length
from minitransformer.serve.scheduler import Sequence
from minitransformer.speculative import verify


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


@dataclass
class Draft:
    """A row's proposals for one step."""
    tokens: list[int]       # the proposed tokens (maybe none)
    q: list                 # the distributions they were drawn from (None each when greedy)
    shadow: int | None = None  # with none proposed: the lookup's first proposal, judged free


class Speculator:
    """Speculation for one engine: the drafts it wants, its proposals, their verification,
    the acceptance books and the counters. It holds no block of the target's pool. Its rows
    are the engine's decoding Sequences (scheduler.py): an id (``result.id``), the tokens
    (prompt + output; the cache holds all but the last), the request's settings, its own
    generator, and whether it is static batching's padding row (computed, thrown away)."""

    def __init__(self, config: SpeculativeConfig, model, draft_model=None, num_blocks: int = 64,
                 block_size: int = 16, batch_invariant: bool = False):
        """num_blocks, block_size: the target's pool (a draft model's pool is as large);
        batch_invariant: the draft's rows too are computed as batches of one."""
        self.config, self.model = config, model
        self.proposer = Proposer(config, model, draft_model, num_blocks, block_size,
                                 batch_invariant)
        self.counters = SpecCounters()
        self.judged: dict[int, list[int]] = {}  # sequence id -> [accepted, judged] proposals
        self.fed: list[int] = []  # per row, the last step's tokens fed (its last + drafts)

    def wants(self, rows: list[Sequence]) -> list[int]:
        """Per row, the draft tokens it would verify this step (a padding row: none); the
        plan cuts them to the budget and the free blocks."""
        decoding = sum(not seq.padding for seq in rows)
        return [0 if seq.padding else self._length(seq, decoding) for seq in rows]

    def propose(self, rows, room: list[int]) -> list[Draft]:
        """Every row's draft, from ONE call of the proposer, at most room[b] tokens (the
        slots the plan holds for it) -> a Draft per row. A row that proposes nothing (the
        rule, the budget, the blocks, no match) carries its lookup's first proposal, to be
        judged for free."""
        proposals = self.proposer.propose([Ask(seq.result.id, seq.tokens, n,
                                               seq.result.request.sampling, seq.rng)
                                           for seq, n in zip(rows, room, strict=True)])
        drafts = [Draft(tokens[:n], q[:n], None if tokens[:n] or seq.padding else
                        self.proposer.shadow(seq.tokens))
                  for seq, n, (tokens, q) in zip(rows, room, proposals, strict=True)]
        self.fed = [1 + len(draft.tokens) for draft in drafts]
        return drafts

    def verify(self, seq: Sequence, logits, draft: Draft) -> list[int]:
        """A row's logits (1 + its proposals, V) from the verification pass -> the tokens it
        keeps: its accepted proposals and one of the target's own (``speculative.verify``,
        with its own generator). The counters and its acceptance books count them, and the
        draft's cache keeps what the sequence will hold."""
        kept = verify(logits, draft.tokens, draft.q, seq.tokens, seq.result.request.sampling,
                      seq.rng)
        self.counters.count(len(draft.tokens), len(kept) - 1)
        self._judge(seq.result.id, len(draft.tokens), kept, draft.shadow)
        self.proposer.rollback(seq.result.id, len(seq.tokens) + len(kept) - 1)
        return kept

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

    def forget(self, seq_id) -> None:
        """A sequence is over: its books and the draft's blocks of it go."""
        self.judged.pop(seq_id, None)
        self.proposer.forget(seq_id)

    def retain(self, seq_ids) -> None:
        """Forget every sequence but these (the engine's running and waiting ones)."""
        for seq_id in (set(self.judged) | self.proposer.holding()) - set(seq_ids):
            self.forget(seq_id)

    def _length(self, seq: Sequence, batch: int) -> int:
        """This step's draft length for a sequence: the rule's, never past the request's end
        or the draft model's positions (the plan cuts it to the budget and the free blocks)."""
        books = self.judged.get(seq.result.id, (0, 0))
        return max(0, min(draft_length(self.config, acceptance(*books), batch,
                                       self.proposer.cost, books[1]),
                          seq.result.request.max_new_tokens - len(seq.result.tokens) - 1,
                          self.proposer.room(seq.tokens)))
