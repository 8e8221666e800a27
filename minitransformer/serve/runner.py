"""The run: a forward pass over a paged pool, token ids in, logits out (experiments 13, 14, 22).

A plan (scheduler.py) says which tokens each sequence feeds from which position; the runner
feeds them through the model over the pool's blocks and hands back the logits the caller
wants. It samples nothing and writes no book: the plan counted every token in the books
already, and the scheduler's commit marks them written. Two callers, each over its own pool:
the engine (the target model) and a draft model (drafting.py).

    moves    ``do``: the pool carries out a plan's copies and swaps, before a pass reads it
    decode   ``decode``: rows feeding their last token (and a verification's proposals after
             it) -> a row of logits per token fed; a plain decode is one (B, 1) batch
    prompt   ``prompt``: one row's prompt tokens (whole, or a chunk) -> its last position's
             logits, and every position's when its prompt logprobs are asked
    ragged   ``ragged``: rows of any lengths in ONE pass, flattened into one row of tokens
             (paged.RaggedView): every weight read once for all of them. Rows feeding as many
             tokens attend as one group (a decode's rows, a verification's, a draft's), a
             prompt chunk as a group of its own

Batch-invariant mode (docs/serving.md, "Exactness"): a decode's every fed token, and a draft's
every prompt, is computed by the very call a batch of one makes (generate.last_logits_alone),
so a row's bits are those it gets alone.

Example: two sequences' prompts in one ragged pass, then a decode of both, over a pool of 8
blocks of 4 slots (the books counted by hand here, as a plan would):

>>> from minitransformer.checkpoints.synth import qwen2_config, random_model
>>> from minitransformer.serve.paged import PagedCache
>>> model = random_model(qwen2_config())
>>> pool = PagedCache.allocate(model.config, 8, block_size=4)
>>> runner = Runner(model, pool)
>>> for seq_id, prompt in (("a", [5, 6, 7]), ("b", [8, 9])):
...     _ = pool.books.add(seq_id, prompt, reuse=False)
...     _ = pool.books.append([seq_id], len(prompt))
>>> logits, _ = runner.ragged([Feed("a", 0, [5, 6, 7], picks="last", alone=True),
...                            Feed("b", 0, [8, 9], picks="last", alone=True)])
>>> [z.shape for z in logits]                    # (1, V) each: their last positions'
[(1, 96), (1, 96)]
>>> starts = pool.books.append(["a", "b"], 1)
>>> runner.decode(["a", "b"], starts, [[1], [2]]).shape       # (B, V)
(2, 96)
"""
from dataclasses import dataclass

import numpy as np

from minitransformer.backend import to_numpy
from minitransformer.generate import last_logits, last_logits_alone
from minitransformer.model import forward, head
from minitransformer.serve.paged import PagedCache, RaggedView

PICKS = ("all", "last", "none")     # whose logits a row of a pass wants back


@dataclass(frozen=True)
class Feed:
    """One row of a ragged pass: a sequence's new tokens, from a position."""
    seq_id: object
    start: int                      # the position of its first token (counted in the books)
    tokens: list                    # the ids it feeds
    picks: str = "all"              # the logits it wants: every token's, its last's, none
    alone: bool = False             # a prompt chunk: a group of its own
    scored: bool = False            # every position's logits too, by a head of their own
    #                                 (prompt logprobs: the bits of a prompt's own pass)


class Runner:
    """Forward passes of one model over one pool: ids in, logits out (host arrays)."""

    def __init__(self, model, pool: PagedCache, batch_invariant: bool = False):
        self.model, self.pool, self.batch_invariant = model, pool, batch_invariant

    def do(self, moves) -> None:
        """A plan's copies and swaps, in order, before its passes read the pool."""
        self.pool.do(moves)

    def decode(self, seq_ids: list, starts: list[int], fed: list[list[int]]) -> np.ndarray:
        """One forward pass over the decode rows' fed tokens (row b: its last token at
        starts[b], then its proposals, in slots a plan holds) -> logits (R, V), row by row, R
        the tokens fed in all. Batch-invariant: each fed token a row of its own, one token
        long at its own position, by the very call a batch of one makes, in order (so a
        verification's logits are a plain decode's, bit for bit). Otherwise a plain decode
        is one (B, 1) batch, and a verification a ragged batch (``decode_groups``): the
        weights read once for all R."""
        model, pool = self.model, self.pool
        if self.batch_invariant:    # each fed token by the very call a batch of one makes
            ids = np.array([[t] for tokens in fed for t in tokens])               # (R, 1)
            view = pool.view([s for s, tokens in zip(seq_ids, fed, strict=True) for _ in tokens],
                             [p for first, tokens in zip(starts, fed, strict=True)
                              for p in range(first, first + len(tokens))])
            return last_logits_alone(model, ids, view)
        if all(len(tokens) == 1 for tokens in fed):
            return last_logits(model, np.array(fed), pool.view(seq_ids, starts))   # (B, V)
        logits, _ = self.ragged([Feed(s, first, tokens) for s, first, tokens in
                                 zip(seq_ids, starts, fed, strict=True)])
        return np.concatenate(logits)                                              # (R, V)

    def prompt(self, seq_id, start: int, tokens: list[int], last: bool = True,
               scored: bool = False) -> tuple:
        """One row's prompt tokens from start, in one pass -> (its last position's logits
        (V,), None unless last; every position's (n, V), None unless scored). Each is a head
        call of its own, so a prompt's bits do not depend on whether its logprobs are asked."""
        hidden = forward(self.model, np.array([tokens]),                         # (1, n, D)
                         self.pool.view([seq_id], [start]))
        every = to_numpy(head(self.model, hidden))[0] if scored else None        # (n, V)
        final = to_numpy(head(self.model, hidden[:, -1:]))[0, -1] if last else None  # (V,)
        return final, every

    def ragged(self, feeds: list[Feed]) -> tuple:
        """Rows of any lengths in ONE forward pass (the module's docstring) -> (per feed, the
        logits it picks, (k, V) for k tokens picked; per feed, every position's logits (n, V)
        if scored, else None), in the feeds' order."""
        order, groups = decode_groups([f.seq_id for f in feeds], [f.start for f in feeds],
                                      [f.tokens for f in feeds],
                                      [b for b, f in enumerate(feeds) if not f.alone])
        for b, f in enumerate(feeds):
            if f.alone:
                order.append(b)
                groups.append(([f.seq_id], [f.start], len(f.tokens)))
        ids = np.array([[t for b in order for t in feeds[b].tokens]])             # (1, R)
        hidden = forward(self.model, ids, RaggedView(self.pool, groups))          # (1, R, D)
        ends = dict(zip(order, np.cumsum([len(feeds[b].tokens) for b in order]), strict=True))
        spans = {b: range(ends[b] - len(feeds[b].tokens), ends[b]) for b in order}
        picked = {b: {"all": list(spans[b]), "last": [ends[b] - 1], "none": []}[feeds[b].picks]
                  for b in order}                               # a row's logits wanted
        logits = to_numpy(head(self.model, hidden[:, [i for b in order for i in picked[b]]]))[0]
        mine = dict(zip(order, split_rows(logits, [len(picked[b]) for b in order]),
                        strict=True))                                              # (k, V)
        scored = {b: to_numpy(head(self.model, hidden[:, spans[b].start:spans[b].stop]))[0]
                  for b in order if feeds[b].scored}                                # (n, V)
        return [mine[b] for b in range(len(feeds))], [scored.get(b) for b in range(len(feeds))]


def decode_groups(seq_ids: list, starts: list[int], fed: list[list[int]],
                  rows: list[int] | None = None) -> tuple:
    """Rows of a ragged pass as its groups: the rows feeding as many tokens attend as one
    group (a plain decode: all of them, one token each) -> (the rows' indices in the pass's
    order, the RaggedView's groups). rows: the indices to group (None: all).

    >>> decode_groups(["a", "b", "c"], [4, 9, 2], [[1], [2, 3], [4]])
    ([0, 2, 1], [(['a', 'c'], [4, 2], 1), (['b'], [9], 2)])
    """
    by_count: dict[int, list] = {}
    for b in range(len(fed)) if rows is None else rows:
        by_count.setdefault(len(fed[b]), []).append(b)
    order = [b for rows in by_count.values() for b in rows]
    return order, [([seq_ids[b] for b in rows], [starts[b] for b in rows], n)
                   for n, rows in by_count.items()]


def split_rows(logits, counts) -> list:
    """(R, V) -> one (count, V) array per row, in order."""
    return np.split(logits, np.cumsum(list(counts))[:-1])
