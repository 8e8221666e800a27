"""A serving engine: a request queue, N slots, batching over a paged cache (experiments 13, 14).

The batch is not a group but a set of slots. Each ``step``:
  1. admit    while a slot is free, the next waiting request enters: its prompt gets blocks
              (sharing any cached prefix) and is prefilled alone, which picks its first token;
  2. decode   every sequence that was already running gets one token, in one batched step;
  3. retire   a finished sequence leaves its slot, and its blocks go back to the pool, at once.
"continuous" refills a free slot at the very next step (Orca's iteration-level scheduling).
"static" admits a batch only when every slot is free and runs it as a fixed-shape batch does:
a finished member's row stays in each step as padding (computed, thrown away, blocks held)
until the longest member ends, and the whole batch is returned then.

Exactness: each request owns its settings and seeded generator and uses generate's
``next_token``, and is prefilled alone. With ``batch_invariant=True`` it is decoded with
per-row-exact arithmetic (see model.prepare), so its tokens are the ones ``generate`` gives it
alone. The default decodes the batch as one flat matrix per projection (B times fewer weight
reads), which moves logits in their last bits: a token can change only where the solo run was
at a near tie. Prefix sharing is a like exception in both modes: shared keys/values were
computed inside another prompt's prefill, whose sums group their terms differently, and may
differ in the last bit (so far no test has seen a token change).

Memory: a request is admitted only if the pool can take its prompt and every running
sequence's next block. When the running sequences outgrow the pool, the latest admitted is
preempted: swapped out to host memory, put back at the head of the queue, swapped in bit for
bit later. Outcomes: "finished" (eos or max_new_tokens); "cancelled" by ``cancel`` (tokens so
far, blocks freed at once); "rejected" at submission if prompt + max_new_tokens exceeds the
whole pool. The clock is the engine's measured compute time (it jumps ahead when idle).
Leaves out: chunked prefill, priorities, recompute-preemption, caching freed prefixes.
"""
import math
import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from minitransformer.backend import synchronize
from minitransformer.checks import is_integer
from minitransformer.generate import check_prompt, eos_ids, last_logits, seeded_rng
from minitransformer.model import forward
from minitransformer.paged import PagedCache
from minitransformer.sampling import next_token
from minitransformer.serving import Request, Result, Run, metrics  # noqa: F401 (the API)


@dataclass(eq=False)                # compared by identity: it is a place, not a value
class _Live:                        # a request the engine is serving
    result: Result
    tokens: list                    # prompt + new tokens: what the repetition penalty sees
    rng: np.random.Generator
    eos: set
    order: int = 0                  # admission counter: the latest admitted is preempted first
    swapped: object = None          # host copy of its cache while preempted


class Engine:
    def __init__(self, model, slots: int = 8, num_blocks: int = None, block_size: int = 16,
                 policy: str = "continuous", share_prefixes: bool = True,
                 batch_invariant: bool = False):
        if policy not in ("static", "continuous"):
            raise ValueError(f"policy={policy!r}: use 'static' or 'continuous'")
        for name, n in (("slots", slots), ("block_size", block_size), ("num_blocks", num_blocks)):
            if n is not None and (not is_integer(n) or n < 1):
                raise ValueError(f"{name}={n!r}: expected an integer >= 1")
        if num_blocks is None:
            num_blocks = slots * -(-1024 // block_size)  # 1,024 tokens per slot
        self.model, self.policy, self.share = model, policy, share_prefixes
        self.batch_invariant = batch_invariant  # see "Exactness" above
        self.cache = PagedCache.allocate(model.config, num_blocks, block_size)
        self.slots = [None] * slots
        self.waiting = deque()      # _Live in arrival order; preempted ones at the front
        self.padding = []           # static: finished members whose rows still run
        self.results, self.clock, self.steps, self.admitted = [], 0.0, 0, 0
        self.decode_times, self.prefill_times, self.memory = [], [], []

    def submit(self, request: Request) -> int:
        """Queue a request -> its id. Bad ids or lengths raise ValueError."""
        prompt = check_prompt(self.model, request.prompt, request.max_new_tokens).tolist()
        rng, eos = seeded_rng(request.seed), eos_ids(self.model, request.eos_token_id)
        result = Result(len(self.results), request.arrival, request)
        self.results.append(result)
        live = _Live(result, prompt, rng, eos)
        need = self.cache.blocks_for(len(prompt) + request.max_new_tokens)
        if need > self.cache.num_blocks:
            self._end(live, "rejected", f"needs up to {need} blocks of "
                      f"{self.cache.block_size} tokens; the pool has {self.cache.num_blocks}")
        elif request.max_new_tokens == 0:
            self._end(live, "finished")
        else:
            self.waiting.append(live)
        return result.id

    def cancel(self, request_id: int) -> bool:
        """Stop a request now: True if it was waiting or running, False if already over."""
        for live in [*self.waiting, *self.running()]:
            if live.result.id == request_id:
                if live in self.waiting:
                    self.waiting.remove(live)
                else:
                    self._leave_slot(live)
                self._end(live, "cancelled")
                return True
        return False

    def running(self) -> list:
        return [live for live in self.slots if live is not None]

    def step(self) -> None:
        """Admit, prefill, decode one token per running sequence, retire."""
        start = time.perf_counter()
        decoding = self.running()
        if not decoding and self.waiting and self.waiting[0].result.request.arrival > self.clock:
            self.clock = self.waiting[0].result.request.arrival  # idle: jump to the arrival
        made = self._admit() + self._decode(decoding)
        if not decoding and not self.running() and self.waiting:  # an empty pool refused it
            raise RuntimeError("nothing running and the first request cannot be admitted")
        self.memory.append(self.cache.stats())
        synchronize()
        self.clock += time.perf_counter() - start
        self.steps += 1
        for live in made:           # every token of this step exists at the step's end
            if len(live.result.tokens) == 1:
                live.result.first_token = self.clock
            if live.tokens[-1] in live.eos or \
                    len(live.result.tokens) == live.result.request.max_new_tokens:
                self._leave_slot(live, keep_row=self.policy == "static")
                self._end(live, "finished")
        if self.policy == "static" and not self.running():
            self._end_batch()

    def run(self, requests, on_step=None) -> Run:
        """Serve requests (in arrival order) until every one is over; on_step(engine), if
        given, is called after each step (a script's progress line)."""
        for request in sorted(requests, key=lambda r: r.arrival):
            self.submit(request)
        while self.waiting or self.running():
            self.step()
            if on_step is not None:
                on_step(self)
        return Run(self.policy, tuple(self.results), self.steps, self.clock,
                         tuple(self.decode_times), tuple(self.prefill_times),
                         tuple(self.memory), sum(r.preemptions for r in self.results))

    # --- the parts of a step -----------------------------------------------------------------
    def _admit(self) -> list:
        made = []
        if self.policy == "static":
            if self.running():
                return made         # static: a new batch only once the last one is over
            self._end_batch()       # (a batch cut short by cancel ends here)
        while None in self.slots and self.waiting:
            live = self.waiting[0]
            if live.result.request.arrival > self.clock:
                break
            held = live.swapped.length if live.swapped else len(live.tokens)
            cost = live.swapped.blocks if live.swapped else self.cache.add_cost(live.tokens)
            growth = sum(self.cache.blocks_needed(s.result.id, 1) for s in self.running())
            if cost + growth + (held % self.cache.block_size == 0) > self.cache.num_free:
                break               # first come, first served: nobody overtakes it
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

    def _decode(self, decoding) -> list:
        rows = [s for s in decoding if s in self.slots] + self.padding  # not cancelled meanwhile
        while sum(self.cache.blocks_needed(s.result.id, 1) for s in rows) > self.cache.num_free:
            if self.padding:        # padding goes first: nobody is waiting for its tokens
                rows.remove(self.padding[-1])
                self.cache.free_seq(self.padding.pop().result.id)
                continue
            victim = max(rows, key=lambda s: s.order)   # the latest admitted, as vLLM does
            rows.remove(victim)
            self._leave_slot(victim, swap=True)
            victim.result.status = "waiting"
            victim.result.preemptions += 1
            self.waiting.appendleft(victim)
        if not rows:
            return []
        start, ids = time.perf_counter(), [s.result.id for s in rows]
        self.cache.make_room(ids, 1)
        newest = np.array([[s.tokens[-1]] for s in rows])                   # (B, 1)
        hidden = forward(self.model, newest, self.cache.view(ids),          # decode: (B, 1, D)
                         self.batch_invariant)
        for live, logits in zip(rows, last_logits(self.model, hidden, self.batch_invariant)):
            if live in self.padding:  # a finished row of a static batch: computed, discarded
                self.cache.trim(live.result.id, 1)
            else:
                self._sample(live, logits)
        self.decode_times.append((len(rows), time.perf_counter() - start))
        return [live for live in rows if live not in self.padding]

    # --- small helpers -----------------------------------------------------------------------
    def _sample(self, live, logits) -> None:
        token = next_token(logits, live.tokens, live.result.request.settings, live.rng)
        live.tokens.append(token)
        live.result.tokens.append(token)

    def _leave_slot(self, live, swap=False, keep_row=False) -> None:
        """Out of its slot: swapped out, kept as a static batch's padding row, or freed."""
        self.slots[self.slots.index(live)] = None
        if swap:
            live.swapped = self.cache.swap_out(live.result.id)
        elif keep_row:
            self.padding.append(live)
        else:
            self.cache.free_seq(live.result.id)

    def _end(self, live, status, reason="") -> None:
        result = live.result
        result.status, result.reason, result.finished = status, reason, self.clock
        if live not in self.padding:  # a static batch's members are returned at its end
            result.returned = self.clock

    def _end_batch(self) -> None:
        """Static: the longest member is done; free the padding rows, return everyone."""
        for live in self.padding:
            self.cache.free_seq(live.result.id)
        self.padding = []
        for result in self.results:  # padding rows dropped for memory are returned now too
            if result.status == "finished" and math.isnan(result.returned):
                result.returned = self.clock
