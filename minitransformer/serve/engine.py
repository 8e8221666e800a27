"""A serving engine: a request queue, N slots, batching over a paged cache (experiments 13, 14).

The batch is not a group but a set of slots. Each ``step``:
  1. preempt  if the pool cannot take every decoding sequence's next token, the latest
              admitted is swapped out to host memory and queued first, until the rest fit;
  2. decode   every sequence past its prompt gets one token, in one batched step;
  3. prefill  prompts are computed: first those already under way, then, while a slot is
              free, the next waiting request enters (its prompt gets blocks, holding any cached
              prefix) and is prefilled alone; the pass over a prompt's last token picks its
              first token;
  4. retire   a sequence that made its last token leaves its slot.
The two policies differ in two decisions only (``_admits`` and ``_retire``, side by side):

    policy      a free slot takes a waiting request ...   a finished sequence ...
    continuous  at the very next step (Orca's              leaves at once: blocks freed,
                iteration-level scheduling)                answer returned
    static      only when the whole batch is over          keeps its slot, marked finished,
                                                           as a padding row (computed, thrown
                                                           away, blocks held); the batch is
                                                           returned when its last ends

Prefix caching (``enable_prefix_caching=True``, the default; see paged.py): the full blocks of
every sequence are named as they fill, and kept after their request ends, so a later prompt that
starts with the same tokens (the next turn of a chat, a shared system prompt) is prefilled
from the first token not cached. Chunked prefill (``max_num_batched_tokens``, vLLM's name; None
is off): a step computes at most that many tokens, the decodes first (one each), then chunks
of waiting prompts in the room left, so a long prompt no longer stops every stream for the
whole of its prefill; it is spread over several steps, each a decode of the others plus a
chunk. (vLLM puts the decodes and the chunk in one forward pass over a flattened batch; here
they are two calls within the same budget.)

Exactness: each request owns its settings and seeded generator and uses generate's
``next_token``. A prompt prefilled whole with nothing cached, in ``batch_invariant=True`` mode,
gets the very tokens ``generate`` gives it alone (==): per-row-exact decode arithmetic (see
model.prepare). Three things compute the same numbers from differently shaped products, so
their last bits may move, and a token may differ only where the solo run was at a near tie
(within the tests' NEAR_TIE of choosing another): the default fast decode (the batch as one flat
matrix per projection: B times fewer weight reads); a cached prefix (its keys and values were
computed inside another sequence's pass); a chunked prefill (the prompt's keys and values
computed in pieces, each chunk attending over the cache).

Parallel samples: a request with ``n`` > 1 is n sequences (result ids id .. id + n - 1) that
enter together, when n slots are free. Its prompt is prefilled once; the samples hold its
blocks through ``PagedCache.fork`` and copy a block only when they write into it (the last,
partly filled one, at their first decode). Sample i draws with its own generator seeded
seed + i, from the same logits, so it gets the tokens of a single request seeded seed + i
(the copies hold the same bits). Once admitted, each sample is a sequence like any other:
preempted, cancelled, retired on its own.

Logprobs: a request asking for them (``logprobs``, ``prompt_logprobs``: k alternatives) gets
each token's log-probability from the logits that chose it (logprobs.py), the prompt's from
its one prefill, whose every position goes through the head then; such a prompt is computed
whole, its cached prefix blocks not reused (they hold no logits).

Memory: a request is admitted only if the pool can take its prompt with room for its next
token, and every running sequence's next token. Outcomes: "finished" (eos or
max_new_tokens); "cancelled" by ``cancel`` (tokens so far, blocks freed at once); "rejected"
at submission if prompt + max_new_tokens (or the prompt and n first tokens) exceeds the
whole pool. A malformed request is a
ValueError at submission, and nothing of it is queued. The clock is the engine's measured
compute time (it jumps ahead when idle).
Records: ``results`` holds a request's Result (id -> Result) from its submission until its
owner ``release``s it once over: ``run`` for the requests it was given (they are in its Run),
the online engine once it has handed a request's end over. Per-step timelines
(``decode_times``, ``prefill_times``: (batch size or tokens, seconds); ``memory``: the pool's
PagedStats) are kept only with ``history=True``, which also keeps every record for the engine's
life: what an experiment asks for. Without it an engine that serves for days holds what its
running requests need and counters (``steps``, ``preemptions``, ``prefix_queries``,
``prefix_hits``); a server's long-run view is /metrics (prometheus.py).
Leaves out: priorities, recompute-preemption, one forward pass for decodes and chunks together.

Example: three requests of 1, 3 and 1 tokens through 2 slots. Continuous reuses the slot
request 0 leaves; static holds request 0's row as padding until request 1 ends, so request 2
waits for the next batch:

>>> from minitransformer.checkpoints.synth import qwen2_config, random_model
>>> model = random_model(qwen2_config())
>>> requests = [Request((1, 2), n, eos_token_id=[]) for n in (1, 3, 1)]
>>> for policy in ("continuous", "static"):
...     config = EngineConfig(max_num_seqs=2, policy=policy)
...     run = Engine(model, config, history=True).run(requests)
...     r0, r1, r2 = run.results
...     print(policy, run.steps, "steps; decode batch sizes",
...           [B for B, _ in run.decode_times], "; 0 returned with 1:",
...           r0.returned == r1.returned)
continuous 3 steps; decode batch sizes [1, 1] ; 0 returned with 1: False
static 4 steps; decode batch sizes [2, 2] ; 0 returned with 1: True

With a budget of 4 tokens a step, a 10-token prompt is prefilled in chunks of 4, 4 and 2, and
a second request with the same prompt finds its first 8 tokens cached (two blocks of 4):

>>> config = EngineConfig(max_num_seqs=1, block_size=4, max_num_batched_tokens=4)
>>> engine = Engine(model, config, history=True)
>>> run = engine.run([Request(tuple(range(1, 11)), 1, eos_token_id=[])] * 2)
>>> [n for n, _ in run.prefill_times], [r.cached_tokens for r in run.results]
([4, 4, 2, 2], [0, 8])
>>> engine.prefix_queries, engine.prefix_hits             # prompt tokens looked up / found
(20, 8)
"""
import math
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from minitransformer.backend import memory_bytes, synchronize, to_numpy
from minitransformer.checks import is_integer, is_real
from minitransformer.generate import check_prompt, eos_ids, last_logits, seeded_rng
from minitransformer.kvquant import cache_bytes_per_token
from minitransformer.logprobs import check_top, token_logprob
from minitransformer.model import forward, head
from minitransformer.serve.config import EngineConfig
from minitransformer.serve.paged import PagedCache, blocks_for
from minitransformer.sampling import check_sampling, next_token
from minitransformer.serve.records import Request, Result, Run, metrics  # noqa: F401 (the API)



@dataclass(eq=False)                # compared by identity: it is a place, not a value
class _Live:                        # a request the engine is serving
    result: Result
    tokens: list                    # prompt + new tokens: what the repetition penalty sees
    rng: np.random.Generator
    eos: set
    order: int = 0                  # admission counter: the latest admitted is preempted first
    swapped: object = None          # host copy of its cache while preempted
    siblings: list = field(default_factory=list)  # the other samples of its prompt, waiting

    @property
    def done(self) -> bool:
        """Its last token is made: an eos id, or max_new_tokens of them."""
        made = self.result.tokens
        return made[-1] in self.eos or len(made) == self.result.request.max_new_tokens

    @property
    def prefilling(self) -> bool:
        """Running, its prompt not all computed yet (no token made)."""
        return self.result.status == "running" and not self.result.tokens

    @property
    def finished(self) -> bool:
        """Static batching's mark: over, but still in its slot until its batch ends."""
        return self.result.status == "finished"


def pool_for(requests, slots: int, block_size: int) -> int:
    """Blocks for a pool in which every slot can hold the longest request: nobody waits for
    memory and nobody is preempted (what a contiguous cache would reserve, rounded to blocks).

    >>> pool_for([Request((1, 2, 3), 5), Request((4,), 13)], slots=2, block_size=4)  # 2 x 14/4
    8
    """
    longest = max(len(r.prompt) + r.max_new_tokens for r in requests)
    return slots * blocks_for(longest, block_size)


def check_fits(config, slots: int, num_blocks: int, block_size: int,
               kv_dtype: str = "f32") -> None:
    """A ValueError saying how many bytes the KV pool and the slot table would take, when that
    is more than the backend has: checked before anything is allocated.

    >>> from minitransformer.config import ModelConfig
    >>> from minitransformer.checkpoints.synth import qwen2_config
    >>> check_fits(ModelConfig.from_dict(qwen2_config()), 8, 10**10, 16)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: a KV pool of 10000000000 blocks x 16 tokens and 8 slots need 40,960,000,000,064...
    """
    per_token = cache_bytes_per_token(config, kv_dtype)   # K and V in the pool's format
    need = num_blocks * block_size * per_token + 8 * slots  # a slot a pointer
    have, where = memory_bytes()
    if need > have:
        raise ValueError(f"a KV pool of {num_blocks} blocks x {block_size} tokens and {slots} "
                         f"slots need {need:,} bytes ({need / 2**30:,.1f} GiB), more than the "
                         f"{have:,} bytes of {where}: ask for fewer blocks or slots")


class Engine:
    def __init__(self, model, config: EngineConfig = None, history: bool = False):
        """config: the engine's knobs (serve/config.py; None: the defaults); history: keep
        every record and every step's timings (see "Records" above), for an experiment's
        timeline."""
        config = EngineConfig() if config is None else config
        if not isinstance(config, EngineConfig):
            raise TypeError(f"config: expected an EngineConfig, got {type(config).__name__}")
        slots, num_blocks, block_size = config.max_num_seqs, config.num_blocks, config.block_size
        check_fits(model.config, slots, num_blocks, block_size, config.kv_cache_dtype)
        self.model, self.config, self.policy = model, config, config.policy
        self.prefix_caching = config.enable_prefix_caching
        self.budget = config.max_num_batched_tokens
        self.batch_invariant = config.batch_invariant  # see "Exactness" above
        self.attention = config.attention
        self.cache = PagedCache.allocate(model.config, num_blocks, block_size,
                                         config.kv_cache_dtype)
        self.slots = [None] * slots
        self.waiting = deque()      # _Live in arrival order; preempted ones at the front
        self.history = history
        self.results = {}           # request id -> Result, until released (see "Records")
        self.next_id, self.clock, self.steps, self.admitted = 0, 0.0, 0, 0
        self.preemptions = 0        # since the engine started, over all requests
        self.prefix_queries = self.prefix_hits = 0   # prompt tokens looked up / found cached
        self.decode_times, self.prefill_times, self.memory = [], [], []   # with history only

    # --- the public API ----------------------------------------------------------------------
    def submit(self, request: Request) -> int:
        """Queue a request -> its id. A malformed one raises ValueError naming the field."""
        return self._queue(request, *self._check(request))

    def check(self, request: Request) -> None:
        """The ValueError ``submit`` would raise for this request, if any; nothing is queued
        and no state is read but the model's and the pool's sizes, so any thread may ask."""
        self._check(request)

    def pool_need(self, prompt_tokens: int, max_new_tokens: int, n: int = 1) -> int:
        """Blocks a request may hold at once: its longest sequence, or its prompt with the n
        samples' first tokens (each sample writes its own copy of the last prompt block).
        More than the whole pool, and the request is rejected at submission."""
        bs = self.cache.block_size
        return max(blocks_for(prompt_tokens + max_new_tokens, bs),
                   blocks_for(prompt_tokens + 1, bs) + n - 1)

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
        first = self.next_id
        for item in sorted(checked, key=lambda item: item[0].arrival):
            self._queue(*item)
        while self.waiting or self.running():
            self.step()
            if on_step is not None:
                on_step(self)
        results = tuple(self.results[i] for i in range(first, self.next_id))
        for result in results:
            self.release(result.id)
        return Run(self.policy, results, self.steps, self.clock,
                   tuple(self.decode_times), tuple(self.prefill_times), tuple(self.memory),
                   self.preemptions)

    def cancel(self, request_id: int) -> bool:
        """Stop a request (one sample of it, by its id) now: True if it was waiting or
        running, False if already over. A sample not yet forked just leaves its group; a
        cancelled prompt's other samples go back to the head of the queue, the next one
        taking its place."""
        for holder in list(self.waiting) + self.running():
            for member in holder.siblings:
                if member.result.id == request_id:          # a sample awaiting its fork
                    holder.siblings.remove(member)
                    self._close(member, "cancelled", returned=True)
                    return True
        for live in list(self.waiting) + self.running():
            if live.result.id != request_id:
                continue
            heirs, live.siblings = live.siblings, []
            if heirs:                               # the next sample waits in its place
                heirs[0].siblings = heirs[1:]
            if live in self.waiting:
                i = self.waiting.index(live)
                if heirs:
                    self.waiting[i] = heirs[0]
                else:
                    del self.waiting[i]
                self._close(live, "cancelled", returned=True)
            else:
                self._end(live, "cancelled")
                if heirs:                           # (admitted: ahead of everyone waiting)
                    self.waiting.appendleft(heirs[0])
            return True
        return False

    def release(self, request_id: int) -> None:
        """Its owner is done with an ended request's record: the engine forgets it (unless it
        keeps history). A request still waiting or running is a ValueError."""
        result = self.results.get(request_id)
        if result is not None and math.isnan(result.returned):
            raise ValueError(f"request {request_id} is not over ({result.status})")
        if not self.history:
            self.results.pop(request_id, None)

    def running(self) -> list:
        """The sequences in slots that are not over (prefilling or decoding)."""
        return [live for live in self.slots if live is not None and not live.finished]

    def step(self) -> None:
        """Preempt, decode one token per sequence past its prompt, prefill, retire."""
        start = time.perf_counter()
        if not self.running() and self.waiting and self.waiting[0].result.arrival > self.clock:
            self.clock = self.waiting[0].result.arrival  # idle: jump to the next arrival
        rows = [live for live in self.running() if not live.prefilling] + self._padding()
        rows = self._preempt(rows)
        made = self._decode(rows)
        made += self._prefill(None if self.budget is None else self.budget - len(rows))
        if not self.running() and self.waiting:  # an empty pool refused the first request
            raise RuntimeError("nothing running and the first request cannot be admitted")
        synchronize()
        self.clock += time.perf_counter() - start
        self.steps += 1
        if self.history:            # after the clock: bookkeeping, not serving
            self.memory.append(self.cache.stats())
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
        # static: a new batch only once the last one is over; it forms until its first token
        # (with chunked prefill, members may take several steps to prefill)
        return all(live is None or live.prefilling for live in self.slots)

    def _retire(self, live) -> None:
        """A sequence made its last token: it leaves its slot (static: at its batch's end)."""
        if self.policy == "continuous":
            self._end(live, "finished")             # its blocks go back to the pool
        else:                       # static: marked finished, its row stays in the batch,
            self._close(live, "finished", returned=False)   # computed and thrown away
            self._end_batch_if_over()

    def _padding(self) -> list:
        """Static: finished members whose rows still run (holding their blocks)."""
        return [live for live in self.slots if live is not None and live.finished
                and live.result.id in self.cache.seqs]

    def _end(self, live, status: str) -> None:
        """A running sequence is over: its blocks back to the pool, its slot free, returned."""
        self.cache.free_seq(live.result.id)
        self._leave_slot(live)
        self._close(live, status, returned=True)

    def _leave_slot(self, live) -> None:
        """Free a slot (a sequence finished, was cancelled or preempted)."""
        self.slots[self.slots.index(live)] = None
        self._end_batch_if_over()

    def _end_batch_if_over(self) -> None:
        """Static: once no member of the batch is running, the batch is over, now: its
        padding rows are freed and every finished member is returned."""
        if self.policy != "static" or self.running():
            return
        for i, member in enumerate(self.slots):
            if member is not None:
                if member.result.id in self.cache.seqs:
                    self.cache.free_seq(member.result.id)
                member.result.returned = self.clock
                self.slots[i] = None

    # --- the parts of a step -----------------------------------------------------------------
    def _preempt(self, rows) -> list:
        """Make room for every row's next token -> the rows that stay. Padding rows go first
        (nobody waits for their tokens: they keep their slot, finished, without blocks); then
        the latest admitted running sequence (vLLM's choice: the earliest keep their progress)
        is swapped out to host memory and queued first, to be swapped back in bit for bit
        when the pool has room."""
        while self._growth(rows) > self.cache.num_free:
            padding = [row for row in rows if row.finished]
            if padding:
                victim = padding[-1]                # still returned with its batch
                self.cache.free_seq(victim.result.id)
            else:
                victim = max(self.running(), key=lambda live: live.order)
                victim.swapped = self.cache.swap_out(victim.result.id)
                self._leave_slot(victim)
                victim.result.status = "waiting"
                victim.result.preemptions += 1
                self.preemptions += 1
                self.waiting.appendleft(victim)
            if victim in rows:
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
        logits = last_logits(self.model, newest, self.cache.view(ids),      # decode: (B, V)
                             self.batch_invariant, self.attention)
        for live, row in zip(rows, logits):
            if live.finished:
                self.cache.trim(live.result.id, 1)  # a padding row never grows
            else:
                self._sample(live, row)
                self._seal(live)
        if self.history:
            self.decode_times.append((len(rows), time.perf_counter() - start))
        return [live for live in rows if not live.finished]

    def _prefill(self, budget) -> list:
        """Compute prompts, at most budget tokens of them (None: no limit): those under way
        first, oldest first, then newcomers -> the sequences whose prompt is now done, each
        with its first token."""
        made, admits = [], self._admits()   # (static: decided once, before anyone enters)
        while budget is None or budget > 0:
            under_way = [live for live in self.running() if live.prefilling]
            live = min(under_way, key=lambda live: live.order) if under_way else \
                self._admit() if admits else None
            if live is None:
                break
            if not live.prefilling:                 # a preempted sequence swapped back in
                continue
            rid, prompt = live.result.id, live.tokens
            done = self.cache.seqs[rid].length      # prompt tokens cached or computed
            n = len(prompt) - done if budget is None else min(len(prompt) - done, budget)
            start = time.perf_counter()
            hidden = forward(self.model, np.array([prompt[done:done + n]]),   # (1, n, D)
                             self.cache.view([rid]), attention=self.attention)
            self._seal(live)
            live.result.prefill_chunks += 1
            if live.result.request.prompt_logprobs is not None:
                self._score_prompt(live, hidden, done)
            if done + n == len(prompt):             # the last prompt token's logits
                last = to_numpy(head(self.model, hidden[:, -1:]))[0, -1]      # (V,)
                made += self._first_tokens(live, last)
            if self.history:
                self.prefill_times.append((n, time.perf_counter() - start))
            budget = None if budget is None else budget - n
        return made

    def _score_prompt(self, live, hidden, done: int) -> None:
        """Prompt logprobs from a chunk's pass: every position through the head; position p's
        logits score prompt token p + 1 (the last prompt position's pick the first new one)."""
        z = to_numpy(head(self.model, hidden))[0]                         # (n, V)
        k, prompt = live.result.request.prompt_logprobs, live.tokens
        live.result.prompt_logprobs += [token_logprob(row, token, k)
                                        for row, token in zip(z, prompt[done + 1:])]

    def _first_tokens(self, live, logits) -> list:
        """A prompt is done: its other samples take their reserved slots holding its blocks
        (``fork``), and each picks a first token from the same logits with its own generator
        -> the samples."""
        for member in live.siblings:
            self.cache.fork(live.result.id, member.result.id)
            self.slots[self.slots.index(None)] = member
            member.order, self.admitted = self.admitted, self.admitted + 1
            mine, leader = member.result, live.result
            mine.status, mine.cached_tokens = "running", leader.cached_tokens
            mine.prefill_chunks, mine.prompt_logprobs = leader.prefill_chunks, \
                leader.prompt_logprobs
        group, live.siblings = [live] + live.siblings, []
        for member in group:
            self._sample(member, logits)
        return group

    def _reserved(self) -> int:
        """Slots promised to the samples of prompts still being prefilled."""
        return sum(len(live.siblings) for live in self.running())

    def _admit(self):
        """The head of the queue into a free slot, if it may enter -> it, or None. Nobody
        overtakes the head of the queue, first come first served. The n samples of a prompt
        enter together: its prefill takes a slot, and n - 1 more are reserved."""
        if not self.waiting:
            return None
        live = self.waiting[0]
        if self.slots.count(None) - self._reserved() < 1 + len(live.siblings) \
                or live.result.arrival > self.clock or not self._fits(live):
            return None
        self.waiting.popleft()
        self.slots[self.slots.index(None)] = live
        live.order, self.admitted = self.admitted, self.admitted + 1
        live.result.status = "running"
        rid, prompt = live.result.id, live.tokens
        if live.swapped:            # a preempted sequence resumes where it was
            self.cache.swap_in(rid, live.swapped)
            live.swapped = None
        else:
            reuse = self._reuses(live)
            held = self.cache.add(rid, prompt, len(prompt) + live.result.request.max_new_tokens,
                                  reuse)
            live.result.cached_tokens = held
            if live.result.request.prompt_logprobs is not None:
                live.result.prompt_logprobs = [None]    # nothing predicts the first token
            if self.prefix_caching and reuse:
                self.prefix_queries, self.prefix_hits = (self.prefix_queries + len(prompt),
                                                         self.prefix_hits + held)
        return live

    def _fits(self, live) -> bool:
        """Memory admission: can the pool take this sequence with room for its next token
        (else the next step could preempt it at once), and every running sequence's next?"""
        if live.swapped:
            enter = self.cache.swap_in_cost(live.swapped, then=1)
        elif self._reuses(live):
            enter = self.cache.add_cost(live.tokens, then=1)
        else:
            enter = self.cache.blocks_for(len(live.tokens) + 1)
        enter += len(live.siblings)     # each sample's first token: a new block or a copy
        return enter + self._growth(self.running()) <= self.cache.num_free

    def _growth(self, rows) -> int:
        """Free blocks the next token of every row takes (new blocks, copies of shared ones)."""
        return self.cache.room_needed([row.result.id for row in rows], 1)

    @staticmethod
    def _reuses(live) -> bool:
        """May its prompt start from cached blocks? Not when the logprobs of every prompt
        token are asked for: they need every position's logits."""
        return live.result.request.prompt_logprobs is None

    def _seal(self, live) -> None:
        """Prefix caching: offer the sequence's newly full blocks to later prompts."""
        if self.prefix_caching:
            self.cache.seal(live.result.id, live.tokens)

    # --- small helpers -----------------------------------------------------------------------
    def _check(self, request) -> tuple:
        """A request's fields, checked against the model before anything is held -> (prompt
        ids, a generator per sample (seed + i for sample i), its eos ids)."""
        if not isinstance(request, Request):
            raise ValueError(f"expected a minitransformer.serve.records.Request, got "
                             f"{type(request).__name__}")
        check_sampling(request.sampling)
        t = request.arrival
        if not is_real(t) or not 0 <= t < math.inf:
            raise ValueError(f"arrival must be a finite number of seconds >= 0, got {t!r}")
        prompt = check_prompt(self.model, request.prompt, request.max_new_tokens).tolist()
        n, slots = request.n, len(self.slots)
        if not is_integer(n) or not 1 <= n <= slots:
            raise ValueError(f"n must be an integer in [1, {slots}] (the engine's slots), "
                             f"got {n!r}")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(request, name) is not None:
                check_top(getattr(request, name), name)
        seeded_rng(request.seed)    # checked once: then seed + i is an integer too
        rngs = [seeded_rng(None if request.seed is None else request.seed + i) for i in range(n)]
        return prompt, rngs, eos_ids(self.model, request.eos_token_id)

    def _queue(self, request, prompt, rngs, eos) -> int:
        """Queue a request's n samples (ids first .. first + n - 1) -> the first id."""
        lives = []
        for i, rng in enumerate(rngs):
            result = Result(self.next_id, float(request.arrival), request, choice=i)
            self.results[result.id], self.next_id = result, self.next_id + 1
            lives.append(_Live(result, list(prompt), rng, eos))
        bs, need = self.cache.block_size, self.pool_need(len(prompt), request.max_new_tokens,
                                                         len(lives))
        for live in lives:
            if need > self.cache.num_blocks:
                self._close(live, "rejected", returned=True, reason=f"needs up to {need} "
                            f"blocks of {bs} tokens; the pool has {self.cache.num_blocks}")
            elif request.max_new_tokens == 0:
                self._close(live, "finished", returned=True)
        if lives[0].result.status == "waiting":
            lives[0].siblings = lives[1:]
            self.waiting.append(lives[0])
        return lives[0].result.id

    def _sample(self, live, logits) -> None:
        """Pick the next token; its logprob (when asked) from the same logits, before the
        request's sampling settings touch them."""
        request = live.result.request
        token = next_token(logits, live.tokens, request.sampling, live.rng)
        live.tokens.append(token)
        live.result.tokens.append(token)
        if request.logprobs is not None:
            live.result.logprobs.append(token_logprob(logits, token, request.logprobs))

    def _close(self, live, status, returned, reason="") -> None:
        """Over: its last token (or its cancel) is now; returned now unless held back."""
        result = live.result
        result.status, result.reason, result.finished = status, reason, self.clock
        if returned:
            result.returned = self.clock
