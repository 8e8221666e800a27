"""A serving engine: a request queue, N slots, batching over a paged cache (experiments 13, 14).

The batch is not a group but a set of slots. Each ``step``:
  1. admit    while a slot is free, the next waiting request enters: its prompt gets blocks
              (sharing any cached prefix) and is prefilled alone, which picks its first token;
  2. preempt  if the pool cannot take every running sequence's next token, the latest
              admitted is swapped out to host memory and queued first, until the rest fit;
  3. decode   every sequence that was already running gets one token, in one batched step;
  4. retire   a sequence that made its last token leaves its slot.
The two policies differ in two decisions only (``_admits`` and ``_retire``, side by side):

    policy      a free slot takes a waiting request ...   a finished sequence ...
    continuous  at the very next step (Orca's              leaves at once: blocks freed,
                iteration-level scheduling)                answer returned
    static      only when the whole batch is over          stays as a padding row (computed,
                                                           thrown away, blocks held); the batch
                                                           is returned when its last ends

Exactness: each request owns its settings and seeded generator and uses generate's
``next_token``, and is prefilled alone. With ``batch_invariant=True`` it is decoded with
per-row-exact arithmetic (see model.prepare), so its tokens are the ones ``generate`` gives it
alone. The default decodes the batch as one flat matrix per projection (B times fewer weight
reads), which moves logits in their last bits: a token can change only where the solo run was
at a near tie. Prefix sharing is a like exception in both modes: shared keys/values were
computed inside another prompt's prefill, whose sums group their terms differently, and may
differ in the last bit (so far no test has seen a token change).

Memory: a request is admitted only if the pool can take its prompt with room for its next
token, and every running sequence's next token. Outcomes: "finished" (eos or
max_new_tokens); "cancelled" by ``cancel`` (tokens so far, blocks freed at once); "rejected"
at submission if prompt + max_new_tokens exceeds the whole pool. A malformed request is a
ValueError at submission, and nothing of it is queued. The clock is the engine's measured
compute time (it jumps ahead when idle).
Leaves out: chunked prefill, priorities, recompute-preemption, caching freed prefixes.

Example: three requests of 1, 3 and 1 tokens through 2 slots. Continuous reuses the slot
request 0 leaves; static holds request 0's row as padding until request 1 ends, so request 2
waits for the next batch:

>>> from minitransformer.synth import qwen2_config, random_model
>>> model = random_model(qwen2_config())
>>> requests = [Request((1, 2), n, eos_token_id=[]) for n in (1, 3, 1)]
>>> for policy in ("continuous", "static"):
...     run = Engine(model, slots=2, policy=policy).run(requests)
...     r0, r1, r2 = run.results
...     print(policy, run.steps, "steps; decode batch sizes",
...           [B for B, _ in run.decode_times], "; 0 returned with 1:",
...           r0.returned == r1.returned)
continuous 3 steps; decode batch sizes [1, 1] ; 0 returned with 1: False
static 4 steps; decode batch sizes [2, 2] ; 0 returned with 1: True
"""
import math
import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from minitransformer.backend import synchronize
from minitransformer.checks import is_integer, is_real
from minitransformer.generate import check_prompt, eos_ids, last_logits, seeded_rng
from minitransformer.model import forward
from minitransformer.serve.paged import PagedCache, blocks_for
from minitransformer.sampling import check_sampling, next_token
from minitransformer.serve.records import Request, Result, Run, metrics  # noqa: F401 (the API)

POLICIES = ("static", "continuous")
SLOTS = 8                   # the chapter's experiment 13
BLOCK_SIZE = 16             # tokens per block: vLLM's default
TOKENS_PER_SLOT = 1024      # the default pool: room for this many tokens in every slot


@dataclass(eq=False)                # compared by identity: it is a place, not a value
class _Live:                        # a request the engine is serving
    result: Result
    tokens: list                    # prompt + new tokens: what the repetition penalty sees
    rng: np.random.Generator
    eos: set
    order: int = 0                  # admission counter: the latest admitted is preempted first
    swapped: object = None          # host copy of its cache while preempted

    @property
    def done(self) -> bool:
        """Its last token is made: an eos id, or max_new_tokens of them."""
        made = self.result.tokens
        return made[-1] in self.eos or len(made) == self.result.request.max_new_tokens


def pool_for(requests, slots: int, block_size: int) -> int:
    """Blocks for a pool in which every slot can hold the longest request: nobody waits for
    memory and nobody is preempted (what a contiguous cache would reserve, rounded to blocks).

    >>> pool_for([Request((1, 2, 3), 5), Request((4,), 13)], slots=2, block_size=4)  # 2 x 14/4
    8
    """
    longest = max(len(r.prompt) + r.max_new_tokens for r in requests)
    return slots * blocks_for(longest, block_size)


class Engine:
    def __init__(self, model, slots: int = SLOTS, num_blocks: int = None,
                 block_size: int = BLOCK_SIZE, policy: str = "continuous",
                 share_prefixes: bool = True, batch_invariant: bool = False):
        if policy not in POLICIES:
            raise ValueError(f"policy={policy!r}: use 'static' or 'continuous'")
        for name, n in (("slots", slots), ("block_size", block_size), ("num_blocks", num_blocks)):
            if n is not None and (not is_integer(n) or n < 1):
                raise ValueError(f"{name}={n!r}: expected an integer >= 1")
        if num_blocks is None:
            num_blocks = slots * blocks_for(TOKENS_PER_SLOT, block_size)
        self.model, self.policy, self.share = model, policy, share_prefixes
        self.batch_invariant = batch_invariant  # see "Exactness" above
        self.cache = PagedCache.allocate(model.config, num_blocks, block_size)
        self.slots = [None] * slots
        self.waiting = deque()      # _Live in arrival order; preempted ones at the front
        self.padding = []           # static: finished members whose rows still run
        self.held_back = []         # static: finished members, returned when the batch ends
        self.results, self.clock, self.steps, self.admitted = [], 0.0, 0, 0
        self.preemptions = 0        # since the engine started, over all requests
        self.decode_times, self.prefill_times, self.memory = [], [], []

    # --- the public API ----------------------------------------------------------------------
    def submit(self, request: Request) -> int:
        """Queue a request -> its id. A malformed one raises ValueError naming the field."""
        return self._queue(request, *self._check(request))

    def run(self, requests, on_step=None) -> Run:
        """Serve requests (in arrival order) until every one is over; on_step(engine), if
        given, is called after each step (a script's progress line). Every request is checked
        before any is queued: one bad request raises ValueError and queues nothing."""
        checked = []
        for i, request in enumerate(requests):
            try:
                checked.append((request, *self._check(request)))
            except ValueError as e:
                raise ValueError(f"requests[{i}]: {e}") from None
        for item in sorted(checked, key=lambda item: item[0].arrival):
            self._queue(*item)
        while self.waiting or self.running():
            self.step()
            if on_step is not None:
                on_step(self)
        return Run(self.policy, tuple(self.results), self.steps, self.clock,
                   tuple(self.decode_times), tuple(self.prefill_times), tuple(self.memory),
                   self.preemptions)

    def cancel(self, request_id: int) -> bool:
        """Stop a request now: True if it was waiting or running, False if already over."""
        for live in self.waiting:
            if live.result.id == request_id:
                self.waiting.remove(live)
                self._close(live, "cancelled", returned=True)
                return True
        for live in self.running():
            if live.result.id == request_id:
                self._end(live, "cancelled")
                return True
        return False

    def running(self) -> list:
        return [live for live in self.slots if live is not None]

    def step(self) -> None:
        """Admit and prefill, preempt, decode one token per running sequence, retire."""
        start = time.perf_counter()
        decoding = self.running()   # already running: they decode; newcomers prefill
        if not decoding and self.waiting and self.waiting[0].result.arrival > self.clock:
            self.clock = self.waiting[0].result.arrival  # idle: jump to the next arrival
        made = self._admit()
        made += self._decode(self._preempt(decoding + self.padding))  # padding rows run too
        if not decoding and not self.running() and self.waiting:  # an empty pool refused it
            raise RuntimeError("nothing running and the first request cannot be admitted")
        synchronize()
        self.clock += time.perf_counter() - start
        self.steps += 1
        self.memory.append(self.cache.stats())    # after the clock: bookkeeping, not serving
        for live in made:           # every token of this step exists at the step's end
            if len(live.result.tokens) == 1:
                live.result.first_token = self.clock
            if live.done:
                self._retire(live)

    # --- the two policies, side by side ------------------------------------------------------
    def _admits(self) -> bool:
        """May free slots take waiting requests this step?"""
        if self.policy == "continuous":
            return True             # any free slot, at the very next step
        return not self.running()   # static: a new batch only once the last one is over

    def _retire(self, live) -> None:
        """A sequence made its last token: it leaves its slot."""
        if self.policy == "continuous":
            self._end(live, "finished")             # its blocks go back to the pool
        else:                       # static: its row stays in the batch, computed and thrown
            self.padding.append(live)               # away, until the longest member ends
            self.held_back.append(live)
            self._close(live, "finished", returned=False)
            self._leave_slot(live)

    def _end(self, live, status: str) -> None:
        """A running sequence is over: its blocks back to the pool, its slot free, returned."""
        self.cache.free_seq(live.result.id)
        self._leave_slot(live)
        self._close(live, status, returned=True)

    def _leave_slot(self, live) -> None:
        """Free a slot (a sequence finished, was cancelled or preempted)."""
        self.slots[self.slots.index(live)] = None
        if self.policy == "static" and not self.running():
            self._end_batch()

    def _end_batch(self) -> None:
        """Static: the batch's last running member left, so the batch is over, now: its
        padding rows are freed and every finished member is returned."""
        for row in self.padding:
            self.cache.free_seq(row.result.id)
        for member in self.held_back:
            member.result.returned = self.clock
        self.padding, self.held_back = [], []

    # --- the parts of a step -----------------------------------------------------------------
    def _admit(self) -> list:
        """Fill free slots from the head of the queue, first come first served -> the
        newcomers, each with its first token."""
        made = []
        if not self._admits():
            return made
        while None in self.slots and self.waiting:
            live = self.waiting[0]
            if live.result.arrival > self.clock or not self._fits(live):
                break               # nobody overtakes the head of the queue
            self.waiting.popleft()
            self.slots[self.slots.index(None)] = live
            live.order, self.admitted = self.admitted, self.admitted + 1
            live.result.status = "running"
            if live.swapped:        # a preempted sequence resumes where it was
                self.cache.swap_in(live.result.id, live.swapped)
                live.swapped = None
            else:
                made.append(self._prefill(live))
        return made

    def _fits(self, live) -> bool:
        """Memory admission: can the pool take this sequence with room for its next token
        (else the next step could preempt it at once), and every running sequence's next?"""
        if live.swapped:
            enter = self.cache.swap_in_cost(live.swapped, then=1)
        else:
            enter = self.cache.add_cost(live.tokens, then=1)
        return enter + self._growth(self.running()) <= self.cache.num_free

    def _growth(self, rows) -> int:
        """Free blocks the next token of every row takes (new blocks, copies of shared ones)."""
        return sum(self.cache.blocks_needed(row.result.id, 1) for row in rows)

    def _prefill(self, live) -> _Live:
        start, rid, prompt = time.perf_counter(), live.result.id, live.tokens
        held = self.cache.add(rid, prompt, len(prompt) + live.result.request.max_new_tokens)
        hidden = forward(self.model, np.array([prompt[held:]]), self.cache.view([rid]))
        if self.share:
            self.cache.register_prefix(rid, prompt)
        live.result.shared_tokens = held
        self._sample(live, last_logits(self.model, hidden)[0])
        self.prefill_times.append((len(prompt) - held, time.perf_counter() - start))
        return live

    def _preempt(self, rows) -> list:
        """Make room for every row's next token -> the rows that stay. Padding rows go first
        (nobody waits for their tokens); then the latest admitted running sequence (vLLM's
        choice: the earliest keep their progress) is swapped out to host memory and queued
        first, to be swapped back in bit for bit when the pool has room."""
        while self._growth(rows) > self.cache.num_free:
            if self.padding:
                victim = self.padding.pop()         # still returned with its batch
                self.cache.free_seq(victim.result.id)
            else:
                victim = max(rows, key=lambda row: row.order)
                victim.swapped = self.cache.swap_out(victim.result.id)
                self._leave_slot(victim)
                victim.result.status = "waiting"
                victim.result.preemptions += 1
                self.preemptions += 1
                self.waiting.appendleft(victim)
            rows.remove(victim)
        return rows

    def _decode(self, rows) -> list:
        """One token for every row in one batched forward pass -> the rows that sampled one
        (a padding row's is computed and thrown away)."""
        if not rows:
            return []
        start, ids = time.perf_counter(), [row.result.id for row in rows]
        self.cache.make_room(ids, 1)
        newest = np.array([[row.tokens[-1]] for row in rows])              # (B, 1)
        hidden = forward(self.model, newest, self.cache.view(ids),          # decode: (B, 1, D)
                         self.batch_invariant)
        for live, logits in zip(rows, last_logits(self.model, hidden, self.batch_invariant)):
            if live in self.padding:
                self.cache.trim(live.result.id, 1)  # a padding row never grows
            else:
                self._sample(live, logits)
        self.decode_times.append((len(rows), time.perf_counter() - start))
        return [live for live in rows if live not in self.padding]

    # --- small helpers -----------------------------------------------------------------------
    def _check(self, request) -> tuple:
        """A request's fields, checked against the model before anything is held -> (prompt
        ids, its generator, its eos ids)."""
        if not isinstance(request, Request):
            raise ValueError(f"expected a minitransformer.serve.records.Request, got "
                             f"{type(request).__name__}")
        check_sampling(request.sampling)
        t = request.arrival
        if not is_real(t) or not 0 <= t < math.inf:
            raise ValueError(f"arrival must be a finite number of seconds >= 0, got {t!r}")
        prompt = check_prompt(self.model, request.prompt, request.max_new_tokens).tolist()
        return prompt, seeded_rng(request.seed), eos_ids(self.model, request.eos_token_id)

    def _queue(self, request, prompt, rng, eos) -> int:
        result = Result(len(self.results), float(request.arrival), request)
        self.results.append(result)
        live = _Live(result, prompt, rng, eos)
        need = self.cache.blocks_for(len(prompt) + request.max_new_tokens)
        if need > self.cache.num_blocks:
            self._close(live, "rejected", returned=True, reason=f"needs up to {need} blocks "
                        f"of {self.cache.block_size} tokens; the pool has {self.cache.num_blocks}")
        elif request.max_new_tokens == 0:
            self._close(live, "finished", returned=True)
        else:
            self.waiting.append(live)
        return result.id

    def _sample(self, live, logits) -> None:
        token = next_token(logits, live.tokens, live.result.request.sampling, live.rng)
        live.tokens.append(token)
        live.result.tokens.append(token)

    def _close(self, live, status, returned, reason="") -> None:
        """Over: its last token (or its cancel) is now; returned now unless held back."""
        result = live.result
        result.status, result.reason, result.finished = status, reason, self.clock
        if returned:
            result.returned = self.clock
