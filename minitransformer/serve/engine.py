"""The serving engine: requests in, tokens out, over N slots and a paged cache (exp. 13, 14).

Each ``step`` is plan -> run -> commit, each part in its own module:
  plan    scheduler.py decides on the block manager's books alone (blocks.py): who is
          preempted, who decodes, which prompt chunks prefill within the token budget, who
          is admitted, and, speculating, the draft tokens each decode row may verify (what
          speculation wants, handed to it as data); the blocks each pass fills and reads,
          so which passes run as one and whom a failed pass concerns are the plan's;
  run     runner.py: the pool does the plan's copies and swaps, then the forward passes
          (by default the decodes with their drafts and every prompt, whole or a chunk, in
          ONE pass over a ragged batch of tokens; batch-invariant mode: each row's own
          calls) -> logits; here, per pass: sampling or verification (speculate.py),
          logprobs, timings, into ``Made``; nothing is written to the books;
  commit  the scheduler takes what the passes made, once the step's clock has stopped (the
          time its tokens are stamped with): the slots written, rows trimmed to the tokens
          they kept, full blocks named, a failed pass's sequences ended, first tokens
          stamped, those that made their last retired.
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
the decode rows become a verification. The plan holds each decoding sequence's draft slots;
the run asks the proposer for every draft at once (prompt lookup over its prompt and output,
or a draft model's proposals), and the step's ONE forward pass verifies every sequence's
draft, a sequence without one feeding its last token as in a plain decode; each keeps its
accepted proposals and one token of the target's own (the library's rule, its own
generator), and the scheduler's commit trims its slots back to what it kept.

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

from minitransformer.backend import synchronize
from minitransformer.kernels import threads
from minitransformer.loader import load
from minitransformer.logprobs import token_logprob
from minitransformer.sampling import next_token
from minitransformer.serve.blocks import blocks_for
from minitransformer.serve.config import EngineConfig, check_against
from minitransformer.serve.intake import check_request
from minitransformer.serve.paged import PagedCache, check_fits
from minitransformer.serve.records import Request, Result, Run
from minitransformer.serve.runner import Feed, Runner, split_rows
from minitransformer.serve.scheduler import Made, Scheduler, Work, close, fan_out
from minitransformer.serve.speculate import Speculator


class Engine:
    def __init__(self, model, config: EngineConfig | None = None, history: bool = False,
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
        # batch-invariant: every pass reads its blocks gathered, a row's bits generate's
        self.cache = PagedCache.allocate(model.config, num_blocks, block_size,
                                         config.kv_cache_dtype, config.attention,
                                         in_place=not config.batch_invariant)
        self.runner = Runner(model, self.cache, config.batch_invariant)
        self.scheduler = Scheduler(self.cache.books, slots, config.policy,
                                   config.max_num_batched_tokens, config.enable_prefix_caching)
        self.history = history
        self.results: dict[int, Result] = {}  # request id -> Result, until released
        self.next_id, self.clock, self.steps = 0, 0.0, 0
        self.decode_times: list[tuple[int, float]] = []   # (rows, seconds), with history only
        self.prefill_times: list[tuple[int, float]] = []  # (tokens, seconds)
        self.memory: list = []                            # the pool's PagedStats, a step each
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

    def pool_need(self, request: Request) -> int:
        """Blocks a request may hold at once: its longest sequence, or its prompt with the n
        samples' first tokens (each sample writes its own copy of the last prompt block).
        More than the whole pool, and the request is rejected at submission. A request of no
        new tokens (records.Request.prompt_only) holds its prompt's blocks, shared by its
        samples. Sizes alone are read, so any thread may ask. A sequence of a model whose
        every layer slides holds, past its prompt, one window's blocks at most (blocks.py,
        ``window_blocks``), however long it runs."""
        books = self.cache.books
        bs, prompt, new = books.block_size, len(request.prompt), request.max_new_tokens
        if request.prompt_only:
            return blocks_for(prompt, bs)
        longest = blocks_for(prompt + new, bs)
        if books.window is not None:
            longest = min(longest, max(blocks_for(prompt + 1, bs), books.window_blocks))
        return max(longest, blocks_for(prompt + 1, bs) + request.n - 1)

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
        """Plan (the scheduler, speculation's drafts included), run (the pool's moves, the
        forward pass, sampling or verification: nothing written to the books), commit (the
        scheduler: every trim, seal, failure and retirement). The step's clock stops when
        its tokens exist, before the commit: the time each is stamped with. A pass that
        raises ends the sequences it concerned (the module's docstring, Faults)."""
        start = time.perf_counter()
        if not self.running() and self.waiting and self.waiting[0].result.arrival > self.clock:
            self.clock = self.waiting[0].result.arrival  # idle: jump to the next arrival
        plan = self.scheduler.schedule(self.clock, self._wanted())
        if not self.running() and self.waiting:  # an empty pool refused the first request
            raise RuntimeError("nothing running and the first request cannot be admitted")
        made = self._run(plan)
        for work in (*plan.passes, plan):       # every move done, a failed pass's too
            self._moves(work)
        synchronize()
        self.clock += time.perf_counter() - start   # every token of this step exists now
        self.steps += 1
        self.scheduler.commit(made, self.clock, self._remember if self.history else None)
        if self.speculator is not None:          # the books of sequences still served
            self.speculator.retain([seq.result.id for seq in self.running()] +
                                   [seq.result.id for seq in self.waiting])

    def _remember(self) -> None:
        """History: the pool as the step left it, before anyone retires (after the clock:
        bookkeeping, not serving)."""
        self.memory.append(self.cache.stats())

    # --- running a plan ----------------------------------------------------------------------
    def _run(self, plan) -> Made:
        """The plan's passes -> what they made: the sequences that made tokens, the passes
        that ran, those that failed or would read what a failed one was to fill (the plan's
        ``concerned``), the first error raised."""
        passes = plan.passes
        if plan.together and not self.batch_invariant:  # batch-invariant: each row's own calls
            try:
                return Made(self._mixed(plan), passes)
            except Exception as e:          # the step's fault, not the engine's
                return Made([], [], passes, e)
        made, ran, error = [], [], None
        failed: list[Work] = []
        for work in passes:
            if work in plan.concerned(failed):
                failed.append(work)
                continue
            try:
                made += self._decode(work) if work is plan.decode else self._prefill(work)
                ran.append(work)
            except Exception as e:          # the step's fault, not the engine's
                failed, error = failed + [work], error or e
        return Made(made, ran, failed, error)

    def _moves(self, work) -> None:
        """Carry out a pass's moves (or the plan's last ones), once."""
        moves, work.moves = work.moves, []
        self.runner.do(moves)

    def _decode(self, work) -> list:
        """The decode rows in one batched forward pass, each feeding its last token and the
        proposals of its draft -> the rows that made tokens (a padding row's are computed and
        thrown away)."""
        self._moves(work)
        fed, drafts = self._propose(work)
        start = time.perf_counter()
        logits = self.runner.decode([seq.result.id for seq in work.rows], work.starts,
                                    fed)                                          # (R, V)
        made = self._take_all(work.rows, split_rows(logits, map(len, fed)), drafts)
        if self.history:
            self.decode_times.append((len(work.rows), time.perf_counter() - start))
        return made

    def _mixed(self, plan) -> list:
        """The decodes (each its last token and its draft) and the prompt chunks of a step in
        ONE forward pass, a ragged batch of tokens (runner.ragged): every weight read once
        -> the sequences that made tokens."""
        for work in plan.passes:
            self._moves(work)
        decode = plan.decode
        fed, drafts = self._propose(decode)
        start = time.perf_counter()
        feeds = [Feed(seq.result.id, first, tokens)
                 for seq, first, tokens in zip(decode.rows, decode.starts, fed, strict=True)]
        for work in plan.prefill:
            (seq,), (first,) = work.rows, work.starts
            feeds.append(Feed(seq.result.id, first, seq.tokens[first:first + work.n],
                              "last" if work.firsts else "none", alone=True,
                              scored=seq.result.request.prompt_logprobs is not None))
        logits, scored = self.runner.ragged(feeds)
        made = self._take_all(decode.rows, logits[:len(decode.rows)], drafts)  # prefills' after
        for work, z, every in zip(plan.prefill, logits[len(decode.rows):],
                                  scored[len(decode.rows):], strict=True):
            made += self._first_tokens(work, z[-1] if work.firsts else None, every)
        if self.history:            # one pass for both: each list gets its whole time
            seconds = time.perf_counter() - start
            self.decode_times += [(len(decode.rows), seconds)] * bool(decode.rows)
            self.prefill_times += [(work.n, seconds) for work in plan.prefill]
        return made

    def _prefill(self, work) -> list:
        """A chunk of one prompt, in one forward pass -> its samples, with their first tokens
        when it is the prompt's last chunk."""
        self._moves(work)
        (seq,), (first,), n = work.rows, work.starts, work.n
        start = time.perf_counter()
        last, every = self.runner.prompt(seq.result.id, first, seq.tokens[first:first + n],
                                         bool(work.firsts),
                                         seq.result.request.prompt_logprobs is not None)
        made = self._first_tokens(work, last, every)
        if self.history:
            self.prefill_times.append((n, time.perf_counter() - start))
        return made

    def _first_tokens(self, work, last, every) -> list:
        """A prompt chunk's pass made its logits: every position's (n, V) score its prompt
        logprobs (None: not asked), and the last one's (V,) pick the first token of each
        sample its last chunk starts -> those samples."""
        (seq,), (first,) = work.rows, work.starts
        if every is not None:       # position p's logits score prompt token p + 1
            k = seq.result.request.prompt_logprobs
            seq.result.prompt_logprobs += [token_logprob(row, token, k) for row, token
                                            in zip(every, seq.tokens[first + 1:], strict=False)]
        for member in work.firsts:
            self._sample(member, last)
        return list(work.firsts)

    # --- speculation's parts of a step (speculate.py) ----------------------------------------
    def _wanted(self):
        """Speculating, the draft tokens each decoding sequence would verify, by id (the plan
        cuts them to the budget and the free blocks); None when not speculating."""
        if self.speculator is None:
            return None
        decoding = [seq for seq in self.running() if not seq.prefilling]
        return dict(zip([seq.result.id for seq in decoding],
                        self.speculator.wants(decoding), strict=True))

    def _propose(self, work) -> tuple:
        """-> per decode row, the tokens it feeds (its last token, then its draft's proposals,
        at most the slots the plan held), and its Draft (None: not speculating)."""
        if self.speculator is None or not work.rows:
            return [[seq.tokens[-1]] for seq in work.rows], [None] * len(work.rows)
        drafts = self.speculator.propose(work.rows, work.drafts)
        return [[seq.tokens[-1]] + draft.tokens
                for seq, draft in zip(work.rows, drafts, strict=True)], drafts

    def _take_all(self, rows, logits, drafts) -> list:
        """Each decode row's tokens from its logits (_take) -> the rows that made any. The
        rows that sample draw first, side by side on the threads where that was measured
        faster for so many rows, with or without a top-p or top-k sort (threads.map_in_parts:
        a draw reads only its row's logits and generator, so each row draws the same token on
        any thread), then each row takes its tokens, in order."""
        rows = list(zip(rows, logits, drafts, strict=True))
        drawing = [(seq, z[0]) for seq, z, draft in rows
                   if draft is None and not seq.padding and not seq.result.request.prompt_only]
        cuts = any(s.top_p < 1 or s.top_k for s in (seq.result.request.sampling
                                                     for seq, _ in drawing))   # a sort
        drawn = dict(zip([id(seq) for seq, _ in drawing],
                         threads.map_in_parts(lambda row: self._draw(*row), drawing,
                                              ("draws", cuts)), strict=True))
        return [seq for seq, z, draft in rows if self._take(seq, z, draft, drawn.get(id(seq)))]

    def _take(self, seq, logits, draft, token: int | None = None) -> bool:
        """A decode row's tokens from its logits (k, V), one per token it fed: sampled (token:
        drawn already), or its draft verified (its accepted proposals and one of the target's
        own, appended up to its end) -> whether it made any (a padding row's are thrown away)."""
        if seq.padding:
            return False
        if draft is None:
            self._sample(seq, logits[0], token)
            return True
        assert self.speculator is not None  # a draft: the engine speculates
        kept = self.speculator.verify(seq, logits, draft)
        for token, z in zip(kept, logits, strict=False):    # fewer kept than rows: a rejection
            self._append(seq, token, z)
            if seq.done:            # an eos among the kept tokens: the rest are not made
                break
        return True

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
        need = self.pool_need(request)
        for seq in seqs:
            if need > self.cache.books.num_blocks:
                close(seq.result, "rejected", self.clock, reason=f"needs up to {need} "
                      f"blocks of {bs} tokens; the pool has {self.cache.books.num_blocks}")
            elif request.prompt_only and request.prompt_logprobs is None:
                close(seq.result, "finished", self.clock)   # nothing to compute
        if seqs[0].result.status == "waiting":
            self.waiting.extend(seqs)
        return seqs[0].result.id

    def _sample(self, seq, logits, token: int | None = None) -> None:
        """Pick the next token (token: drawn already, _take_all); its logprob (when asked)
        from the same logits, before the request's sampling settings touch them. A
        prompt-only request picks none (records.Request.prompt_only)."""
        if seq.result.request.prompt_only:
            return
        self._append(seq, self._draw(seq, logits) if token is None else token, logits)

    def _draw(self, seq, logits) -> int:
        """The next token of seq from its logits (V,), by its request's sampling settings."""
        return next_token(logits, seq.tokens, seq.result.request.sampling, seq.rng)

    def _append(self, seq, token: int, logits) -> None:
        """A token made from these logits: into the sequence, and its logprob when asked."""
        request = seq.result.request
        seq.tokens.append(token)
        seq.result.tokens.append(token)
        if request.logprobs is not None:
            seq.result.logprobs.append(token_logprob(logits, token, request.logprobs))

