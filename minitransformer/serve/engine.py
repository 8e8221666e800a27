"""The serving engine: requests in, tokens out, over N slots and a paged cache (exp. 13, 14).

Each ``step`` is plan -> run -> commit, each part in its own module:
  plan    scheduler.py decides on the block manager's books alone (blocks.py): who is
          preempted, who decodes, which prompt chunks prefill within the token budget, who
          is admitted;
  run     here: the pool does the plan's copies and swaps (paged.py), the forward passes
          (the decodes and every prompt, whole or a chunk, in ONE pass over a ragged batch
          of tokens), the head, sampling, logprobs, timings;
  commit  the scheduler stamps first tokens and retires those that made their last.
A request of n > 1 samples is fanned out here, before the scheduler, into n sequences (ids
id .. id + n - 1, seeds seed + i) that share its one prefill; its holder (``run``'s results,
the online Ticket) gathers the n choices by id and cancels each. The policies differ twice:

    policy      a free slot takes a waiting request ...   a finished sequence ...
    continuous  at the very next step (Orca's              leaves at once: blocks freed,
                iteration-level scheduling)                answer returned
    static      only when the whole batch is over          keeps its slot as a padding row
                                                           (computed, thrown away) until
                                                           its batch ends

Speculative decoding (``speculative_config``: vLLM's ``--speculative-config``, speculate.py):
the decode pass becomes a verification. Each decoding sequence may carry a draft (prompt lookup
over its prompt and output, or a draft model's proposals), and the ONE forward pass of the
step's decodes verifies every sequence's draft, a sequence without one feeding its last token
as in a plain decode; each keeps its accepted proposals and one token of the target's own (the
library's rule, its own generator), and its cache is trimmed back to what it kept.

Faults: an exception raised while a plan runs (a forward pass, the head, sampling, a draft)
is the step's, not the engine's. The sequences it concerned end with status "error" and the
exception named in their reason; everyone else goes on, tokens unchanged:

    concerned      the rows of the pass that raised (a batched pass fails as a whole, as
                   vLLM aborts the batch: no row is retried alone to find a culprit), and
                   those of a later pass of the step that would read a block it was to fill
                   (a prompt admitted in the same step finds a chunk's full blocks by name);
                   in the default mode the step is one pass, so all of it. The samples
                   waiting to share a concerned prompt end with it; a static batch's padding
                   row keeps its answer.
    not concerned  the other passes of the step (their tokens are made and kept), those
                   swapped out or back in, the prompts under way without a chunk this step,
                   the waiting.
    the books      every move of the plan is carried out, the blocks left unwritten lose
                   their names (no later prompt finds keys never computed), the concerned
                   sequences' blocks go back, and ``check()`` must hold.

A failure of the plan, the commit, or the abort itself leaves books nobody can vouch for: it
is raised from ``step``, the engine cannot go on (the online loop says so and stops).

Prefix caching, chunked prefill, parallel samples, logprobs, memory admission, speculation, the
records kept and the exactness policy: docs/serving.md, "The engine".

Example: three requests of 1, 3 and 1 tokens through 2 slots. Continuous reuses the slot
request 0 leaves; static holds request 0's row as padding until request 1 ends:

>>> from minitransformer.checkpoints.synth import qwen2_config, random_model
>>> model = random_model(qwen2_config())
>>> requests = [Request((1, 2), n, eos_token_id=[]) for n in (1, 3, 1)]
>>> for policy in ("continuous", "static"):
...     config = EngineConfig(max_num_seqs=2, policy=policy)
...     run = Engine(model, config, history=True).run(requests)
...     print(policy, run.steps, "steps; decode batch sizes", [B for B, _ in run.decode_times])
continuous 3 steps; decode batch sizes [1, 1]
static 4 steps; decode batch sizes [2, 2]
"""
import math
import time

import numpy as np

from minitransformer.backend import synchronize, to_numpy
from minitransformer.generate import last_logits, last_logits_alone
from minitransformer.loader import load
from minitransformer.logprobs import token_logprob
from minitransformer.model import forward, head
from minitransformer.sampling import next_token
from minitransformer.serve.blocks import Copy, blocks_for
from minitransformer.serve.config import EngineConfig, check_against
from minitransformer.serve.intake import check_request
from minitransformer.serve.paged import PagedCache, RaggedView, check_fits
from minitransformer.serve.records import Request, Run
from minitransformer.serve.scheduler import Scheduler, close, fan_out
from minitransformer.serve.speculate import Row, Speculator


class Engine:
    def __init__(self, model, config: EngineConfig = None, history: bool = False,
                 draft_model=None):
        """config: the engine's knobs (serve/config.py; None: the defaults); history: keep
        every record and every step's timings (docs/serving.md, "Records"), for an
        experiment's timeline; draft_model: the draft of a speculative_config whose method
        is draft_model (None: loaded from the config's path)."""
        config = EngineConfig() if config is None else config
        if not isinstance(config, EngineConfig):
            raise TypeError(f"config: expected an EngineConfig, got {type(config).__name__}")
        slots, num_blocks, block_size = config.max_num_seqs, config.num_blocks, config.block_size
        check_fits(model.config, slots, num_blocks, block_size, config.kv_cache_dtype)
        spec = config.speculative_config
        if spec is not None:        # before the pool or a draft model is made
            check_against(spec, model.config)
        self.model, self.config, self.policy = model, config, config.policy
        self.prefix_caching = config.enable_prefix_caching
        self.batch_invariant = config.batch_invariant  # docs/serving.md, "Exactness"
        self.attention = config.attention
        self.cache = PagedCache.allocate(model.config, num_blocks, block_size,
                                         config.kv_cache_dtype, config.attention)
        self.scheduler = Scheduler(self.cache.books, slots, config.policy,
                                   config.max_num_batched_tokens, config.enable_prefix_caching)
        self.history = history
        self.results = {}           # request id -> Result, until released
        self.next_id, self.clock, self.steps = 0, 0.0, 0
        self.decode_times, self.prefill_times, self.memory = [], [], []   # with history only
        self.speculator = None if spec is None else Speculator(
            spec, model, draft_model if draft_model is not None or
            spec.method != "draft_model" else load(spec.model), num_blocks, block_size,
            config.batch_invariant)

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
        More than the whole pool, and the request is rejected at submission. A request of no
        new tokens (prompt logprobs alone) holds its prompt's blocks, shared by its samples."""
        bs = self.cache.books.block_size
        if max_new_tokens == 0:
            return blocks_for(prompt_tokens, bs)
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
        running, False if already over (scheduler.cancel). What speculation held for it (its
        acceptance books, a draft model's cache) goes now: no step may follow."""
        cancelled = self.scheduler.cancel(request_id, self.clock)
        if cancelled and self.speculator is not None:
            self.speculator.forget(request_id)
        return cancelled

    def release(self, request_id: int) -> None:
        """Its owner is done with an ended request's record: the engine forgets it (unless it
        keeps history). A request still waiting or running is a ValueError."""
        result = self.results.get(request_id)
        if result is not None and math.isnan(result.returned):
            raise ValueError(f"request {request_id} is not over ({result.status})")
        if not self.history:
            self.results.pop(request_id, None)

    # the scheduler's state, as the server and the tests read it
    waiting = property(lambda self: self.scheduler.waiting)
    slots = property(lambda self: self.scheduler.slots)
    preemptions = property(lambda self: self.scheduler.preemptions)
    prefix_queries = property(lambda self: self.scheduler.prefix_queries)
    prefix_hits = property(lambda self: self.scheduler.prefix_hits)

    def running(self) -> list:
        return self.scheduler.running()

    def step(self) -> None:
        """Plan (the scheduler), run (the pool's moves, forward passes, sampling), commit. A
        pass that raises ends the sequences it concerned (the module's docstring, Faults)."""
        start = time.perf_counter()
        if not self.running() and self.waiting and self.waiting[0].result.arrival > self.clock:
            self.clock = self.waiting[0].result.arrival  # idle: jump to the next arrival
        plan = self.scheduler.schedule(self.clock)
        if not self.running() and self.waiting:  # an empty pool refused the first request
            raise RuntimeError("nothing running and the first request cannot be admitted")
        made, failed, error = self._run(plan)
        if failed:
            self._abort(plan, failed, error)
        self._moves(plan)
        synchronize()
        self.clock += time.perf_counter() - start
        self.steps += 1
        if self.history:            # after the clock: bookkeeping, not serving
            self.memory.append(self.cache.stats())
        self.scheduler.commit(made, self.clock)  # every token of this step exists now
        if self.speculator is not None:          # the books of sequences still served
            self.speculator.retain([seq.result.id for seq in self.running()] +
                                   [seq.result.id for seq in self.waiting])

    # --- running a plan ----------------------------------------------------------------------
    def _run(self, plan) -> tuple:
        """The plan's passes -> (the sequences that made tokens, the passes that failed or
        would read what a failed one was to write, the first error raised or None)."""
        passes = [plan.decode] * bool(plan.decode.rows) + plan.prefill
        if self._together(passes):
            try:
                return self._mixed(plan, passes), [], None
            except Exception as error:      # the step's fault, not the engine's
                return [], passes, error
        # a verification's drafts are tokens of the step: the plan's spare
        spare = None if self.scheduler.budget is None else \
            self.scheduler.budget - sum(len(work.rows) * work.n for work in passes)
        made, failed, error = [], [], None
        for work in [plan.decode, *plan.prefill]:
            if failed and self._reads_unwritten(work, failed):
                failed.append(work)
                continue
            try:
                made += self._decode(work, spare) if work is plan.decode else \
                    self._prefill(work)
            except Exception as e:          # the step's fault, not the engine's
                failed, error = failed + [work], error or e
        return made, failed, error

    def _reads_unwritten(self, work, failed) -> bool:
        """Would this pass read a block a failed pass was to fill (one of its rows holds it,
        found by name, or a copy takes it)?"""
        books = self.cache.books
        theirs = {b for f in failed for seq in f.rows for b in books.seqs[seq.result.id].blocks
                  if b in books.filling}
        return any(b in theirs for seq in work.rows for b in books.seqs[seq.result.id].blocks) \
            or any(isinstance(move, Copy) and move.src in theirs for move in work.moves)

    def _moves(self, work) -> None:
        """Carry out a pass's moves (or the plan's last ones), once."""
        moves, work.moves = work.moves, []
        self.cache.do(moves)

    def _abort(self, plan, failed, error) -> None:
        """A pass raised `error`: the failed passes' sequences end with it, the books made
        whole (the module's docstring, Faults). What fails here is the engine's own."""
        for work in (plan.decode, *plan.prefill):
            self._moves(work)                       # a swap out or in is someone else's
        self._moves(plan)
        self.cache.books.drop_unwritten()
        reason = f"the engine failed on this request's step: {error!r}"
        for seq in dict.fromkeys(seq for work in failed for seq in (*work.rows, *work.firsts)):
            self.scheduler.fail(seq, reason)
        self.cache.books.check()

    def _decode(self, work, spare=None) -> list:
        """One token for every row in one batched forward pass -> the rows that sampled one
        (a padding row's is computed and thrown away). Speculating, the drafts take at most
        `spare` tokens of the step's budget (None: none is set)."""
        self._moves(work)
        rows = work.rows
        if not rows:
            return []
        if self.speculator is not None:
            return self._speculate(rows, spare)
        start, ids = time.perf_counter(), [row.result.id for row in rows]
        newest = np.array([[row.tokens[-1]] for row in rows])              # (B, 1)
        view = self.cache.view(ids, work.starts)
        if self.batch_invariant:  # each row by the very call a batch of one makes
            logits = last_logits_alone(self.model, newest, view)
        else:
            logits = last_logits(self.model, newest, view)                  # (B, V)
        for seq, row in zip(rows, logits):
            if seq.finished:
                self.cache.books.trim(seq.result.id, 1)   # a padding row never grows
            else:
                self._sample(seq, row)
        if self.history:
            self.decode_times.append((len(rows), time.perf_counter() - start))
        return [seq for seq in rows if not seq.finished]

    def _together(self, passes) -> bool:
        """Run the step's passes as one? In the default mode (batch-invariant keeps each row's
        own calls), whole prompts or chunks alike, not speculating (its verification is the
        decodes' own pass); not when a later pass needs a copy of a block an earlier one
        writes (a prompt cached in full behind the chunk filling its last block): the copies
        come first."""
        return not self.batch_invariant and self.speculator is None and len(passes) > 1 and \
            not any(isinstance(move, Copy) for work in passes[1:] for move in work.moves)

    def _mixed(self, plan, passes) -> list:
        """The decodes and the prompt chunks of a step in ONE forward pass, a ragged batch of
        tokens (paged.RaggedView): every weight read once -> the sequences that sampled."""
        for work in passes:
            self._moves(work)
        start = time.perf_counter()
        parts = [(seq, first, work) for work in passes for seq, first in zip(work.rows,
                                                                             work.starts)]
        ids = np.array([[t for seq, first, work in parts                         # (1, R)
                         for t in seq.tokens[first:first + work.n]]])
        view = RaggedView(self.cache, [([seq.result.id for seq in work.rows], work.starts,
                                        work.n) for work in passes])
        hidden = forward(self.model, ids, view)                                   # (1, R, D)
        ends = np.cumsum([work.n for _, _, work in parts])                  # each row's end
        picked = [i for i, (_, _, work) in enumerate(parts) if work is plan.decode or work.firsts]
        logits = to_numpy(head(self.model, hidden[:, ends[picked] - 1]))[0]       # (m, V)
        made = []
        for i, (seq, first, work) in enumerate(parts):
            if work is not plan.decode and seq.result.request.prompt_logprobs is not None:
                self._score_prompt(seq, hidden[:, ends[i] - work.n:ends[i]], first)
        for i, z in zip(picked, logits):
            seq, _, work = parts[i]
            if work is not plan.decode:                  # a prompt's last chunk
                for member in work.firsts:
                    self._sample(member, z)
                made += work.firsts
            elif seq.finished:
                self.cache.books.trim(seq.result.id, 1)      # a padding row never grows
            else:
                self._sample(seq, z)
                made.append(seq)
        if self.history:            # one pass for both: each list gets its whole time
            seconds = time.perf_counter() - start
            self.decode_times += [(len(work.rows), seconds) for work in passes[:1]
                                  if work is plan.decode]
            self.prefill_times += [(work.n, seconds) for work in passes if work is not plan.decode]
        return made

    def _speculate(self, rows, spare=None) -> list:
        """The decode pass as a verification (speculate.py): every row's draft verified in
        ONE forward pass over the paged cache; each row's kept tokens appended up to its end,
        its cache trimmed back to them and their full blocks named -> the rows that made
        tokens (a padding row's position is computed and thrown away)."""
        start, spec = time.perf_counter(), self.speculator
        out = spec.step(self.cache, [
            Row(seq.result.id, seq.tokens, len(seq.tokens) - len(seq.result.tokens),
                seq.result.request.max_new_tokens, seq.result.request.sampling, seq.rng,
                padding=seq.finished) for seq in rows], self.batch_invariant, spare)
        for seq, (kept, logits) in zip(rows, out):
            for token, z in zip(kept, logits):
                self._append(seq, token, z)
                if seq.done:        # an eos among the kept tokens: the rest are not made
                    break
            spec.settle(self.cache, seq.result.id, len(seq.tokens) - 1)
            if self.prefix_caching and not seq.finished:
                self.cache.books.seal(seq.result.id, seq.tokens)
        if self.history:
            self.decode_times.append((len(rows), time.perf_counter() - start))
        return [seq for seq in rows if not seq.finished]

    def _prefill(self, work) -> list:
        """A chunk of one prompt, in one forward pass -> its samples, with their first tokens
        when it is the prompt's last chunk."""
        self._moves(work)
        (seq,), (done,), n = work.rows, work.starts, work.n
        start = time.perf_counter()
        hidden = forward(self.model, np.array([seq.tokens[done:done + n]]),      # (1, n, D)
                         self.cache.view([seq.result.id], work.starts))
        if seq.result.request.prompt_logprobs is not None:
            self._score_prompt(seq, hidden, done)
        if work.firsts:                              # the last prompt token's logits
            last = to_numpy(head(self.model, hidden[:, -1:]))[0, -1]          # (V,)
            for member in work.firsts:
                self._sample(member, last)
        if self.history:
            self.prefill_times.append((n, time.perf_counter() - start))
        return list(work.firsts)

    def _score_prompt(self, seq, hidden, done: int) -> None:
        """Prompt logprobs from a chunk's pass: every position through the head; position p's
        logits score prompt token p + 1 (the last prompt position's pick the first new one)."""
        z = to_numpy(head(self.model, hidden))[0]                         # (n, V)
        k, prompt = seq.result.request.prompt_logprobs, seq.tokens
        seq.result.prompt_logprobs += [token_logprob(row, token, k)
                                        for row, token in zip(z, prompt[done + 1:])]

    # --- small helpers -----------------------------------------------------------------------
    def _check(self, request) -> tuple:
        """-> (prompt ids, a generator per sample, its eos ids), or a ValueError (intake.py)."""
        return check_request(self.model, request, len(self.slots))

    def _queue(self, request, prompt, rngs, eos) -> int:
        """Fan a request out into its n sequences (ids first .. first + n - 1, fan_out), queued
        one behind the other -> the first id."""
        seqs = fan_out(request, self.next_id, prompt, rngs, eos)
        self.next_id += len(seqs)
        for seq in seqs:
            self.results[seq.result.id] = seq.result
        bs = self.cache.books.block_size
        need = self.pool_need(len(prompt), request.max_new_tokens, len(seqs))
        for seq in seqs:
            if need > self.cache.books.num_blocks:
                close(seq.result, "rejected", self.clock, reason=f"needs up to {need} "
                      f"blocks of {bs} tokens; the pool has {self.cache.books.num_blocks}")
            elif request.max_new_tokens == 0 and request.prompt_logprobs is None:
                close(seq.result, "finished", self.clock)   # nothing to compute
        if seqs[0].result.status == "waiting":
            self.waiting.extend(seqs)
        return seqs[0].result.id

    def _sample(self, seq, logits) -> None:
        """Pick the next token; its logprob (when asked) from the same logits, before the
        request's sampling settings touch them. A request of no new tokens picks none: its
        prompt's pass made its prompt logprobs, and it is done."""
        if seq.result.request.max_new_tokens == 0:
            return
        self._append(seq, next_token(logits, seq.tokens, seq.result.request.sampling, seq.rng),
                     logits)

    def _append(self, seq, token: int, logits) -> None:
        """A token made from these logits: into the sequence, and its logprob when asked."""
        request = seq.result.request
        seq.tokens.append(token)
        seq.result.tokens.append(token)
        if request.logprobs is not None:
            seq.result.logprobs.append(token_logprob(logits, token, request.logprobs))
