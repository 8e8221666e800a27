"""The scheduler: who runs in a step, decided on the books alone, as a Plan (experiment 13).

It holds the waiting queue and the slots, and the block manager's books, which nobody else
writes; it never sees the model or an array. Each ``schedule`` decides, in this order:
  1. preempt  if the pool cannot take every decoding sequence's next token, the latest
              admitted is swapped out (a move for the pool) and queued first;
  2. decode   every sequence past its prompt gets room for one token;
  3. prefill  prompts under way get a chunk first, then, while a slot is free, the next
              waiting request is admitted (its prompt given blocks, holding any cached
              prefix) and gets one; at most ``budget`` tokens in all (None: no limit);
  4. drafts   speculating, each decoding sequence gets slots for the draft tokens it may
              verify (``Work.drafts``): what speculation wants, cut to the budget's tokens
              left and to the free list's blocks (never a kept prefix block).
The plan counts its tokens in the books at once (vLLM counts them when scheduled): the full
blocks a chunk fills are named at once, so a prompt admitted later in the same step finds
them. After the engine has run the plan, writing nothing to the books, ``commit`` takes what
it made (``Made``): the slots written, a failed pass's sequences ended, each row trimmed back
to the tokens it kept (rejected or unproposed draft slots go back) and its full blocks named,
and a windowed model's blocks that slid out of the row's window released (blocks.py); then first-token times, and a sequence that made its last token retires (``retire``, beside
``admits``: the two decisions where the policies differ; the table is in engine.py).

The n samples of a request come fanned out (``fan_out``), n sequences queued one behind the
other, each its own; the first computes the prompt, and each other ``shares_prompt_with`` it:
it is admitted by taking the prompt's blocks (``fork``) in the plan of its last chunk, whose
logits pick every sample's first token. What it needs (a slot, a block for its first token) is
counted when its sibling is admitted, and stays free for it: it waits at the head of the
queue, which nobody overtakes.

Example, with no model: a budget of 6 tokens a step; a 10-token prompt goes in chunks of 6
and 4, and a 3-token one enters beside the second, in the 2 tokens left:

>>> from minitransformer.serve.records import Request
>>> scheduler = Scheduler(BlockManager(num_blocks=8, block_size=4), slots=2, budget=6)
>>> for i, n in enumerate((10, 3)):
...     request = Request(tuple(range(1, n + 1)), max_new_tokens=2)
...     scheduler.waiting.append(Sequence(Result(i, 0.0, request), list(request.prompt)))
>>> def chunks(plan):
...     return [(work.rows[0].result.id, work.starts[0], work.n) for work in plan.prefill]
>>> chunks(scheduler.schedule(now=0.0))         # (sequence, first position, tokens)
[(0, 0, 6)]
>>> plan = scheduler.schedule(now=0.1)           # (the engine runs each plan in between)
>>> chunks(plan), [seq.result.id for seq in plan.prefill[0].firsts]   # 0's last chunk
([(0, 6, 4), (1, 0, 2)], [0])

Each pass of a plan knows the blocks it fills and reads, so the plan says which passes may run
as one and whom a failed pass concerns. Two prompts admitted in one step, the second starting
with the first's first block, found by name before it is written:

>>> scheduler = Scheduler(BlockManager(num_blocks=8, block_size=4), slots=2)
>>> for i, prompt in enumerate(((1, 2, 3, 4, 5), (1, 2, 3, 4, 9))):
...     scheduler.waiting.append(Sequence(Result(i, 0.0, Request(prompt, 2)), list(prompt)))
>>> plan = scheduler.schedule(now=0.0)
>>> [(sorted(work.fills), sorted(work.reads)) for work in plan.passes], plan.together
([([0, 1], [0, 1]), ([2], [0, 2])], True)
>>> [[work.rows[0].result.id for work in plan.concerned([failed])] for failed in plan.passes]
[[0, 1], [1]]
"""
from collections import deque
from dataclasses import dataclass, field

from minitransformer.serve.blocks import SLID, BlockManager, Copy, Swapped
from minitransformer.serve.records import Result


@dataclass(eq=False)                # compared by identity: it is a place, not a value
class Sequence:                     # one sample of a request the engine is serving
    result: Result
    tokens: list                    # prompt + new tokens: what the repetition penalty sees
    rng: object = None              # its numpy Generator (the engine samples with it)
    eos: set = field(default_factory=set)
    order: int = 0                  # admission counter: the latest admitted is preempted first
    swapped: Swapped | None = None  # its books and host copy while preempted
    shares_prompt_with: "Sequence | None" = None  # the sibling whose prompt's blocks it will fork

    @property
    def done(self) -> bool:
        """Its last token is made: an eos id, or max_new_tokens of them."""
        made = self.result.tokens
        return len(made) == self.result.request.max_new_tokens or made[-1] in self.eos

    @property
    def prefilling(self) -> bool:
        """Running, its prompt not all computed yet (no token made)."""
        return self.result.status == "running" and not self.result.tokens

    @property
    def padding(self) -> bool:
        """Static batching's padding row: finished, but in its slot until its batch ends (its
        row computed and thrown away)."""
        return self.result.status == "finished"


@dataclass(eq=False)                # compared by identity: one pass of one plan
class Work:
    """One forward pass of a plan: rows of n new tokens each, from their starts."""
    rows: list[Sequence]
    starts: list[int]               # where each row's new tokens go
    n: int
    moves: list                     # the pool's copies and swaps to do first, in order
    firsts: list[Sequence] | tuple = ()  # a prompt's last chunk: the sequences its logits start
    drafts: list[int] | tuple = ()  # speculating, per decode row: the draft tokens it may
    #                                 verify, their slots held after its n (at most; 0: none)
    fills: frozenset = frozenset()  # the blocks its slots write (known once the plan is made)
    reads: frozenset = frozenset()  # the blocks it reads: its rows' tables, its copies' sources

    def slots(self) -> list:
        """Per row: (sequence id, first position, positions held for this pass)."""
        extra = self.drafts or [0] * len(self.rows)
        return [(seq.result.id, start, self.n + d)
                for seq, start, d in zip(self.rows, self.starts, extra, strict=True)]


@dataclass
class Made:
    """What running a plan made, for the scheduler's ``commit``."""
    seqs: list[Sequence]            # the sequences that made tokens
    ran: list[Work]                 # the Works whose pass ran: their slots are written
    failed: list[Work] | tuple = ()  # Works whose pass raised, or would read what one was to fill
    error: Exception | None = None  # the first exception raised


@dataclass
class Plan:
    decode: Work                    # one token per row: decoding sequences, then padding rows
    prefill: list                   # Works of one row each: prompt chunks, in order
    admitted: list                  # entered a slot (swapped back in, or their prompt placed)
    preempted: list                 # swapped out, queued first
    moves: list                     # moves decided after the last forward pass

    @property
    def passes(self) -> list:
        """Its forward passes, in order: the decodes (if any), then each prompt chunk."""
        return [self.decode] * bool(self.decode.rows) + self.prefill

    @property
    def together(self) -> bool:
        """May the step's passes run as ONE (the decodes, with their drafts, beside whole
        prompts or chunks alike)? Not when a later pass needs a copy of a block: a prompt
        cached in full behind the chunk filling its last block copies it once it is
        written, so the copies come first and the passes run one by one."""
        passes = self.passes
        return len(passes) > 1 and not any(isinstance(move, Copy) for work in passes[1:]
                                           for move in work.moves)

    def concerned(self, failed) -> list:
        """The passes a failure concerns: those that failed, and each later pass that reads
        a block one of them was to fill (a prompt admitted in the same step that found a
        chunk's full blocks by name, or copies one), in order: their sequences end with the
        error (engine.py's docstring, Faults)."""
        out: list[Work] = []
        for work in self.passes:
            if work in failed or any(work.reads & earlier.fills for earlier in out):
                out.append(work)
        return out


def close(result, status: str, now: float, returned: bool = True, reason: str = "") -> None:
    """Over: its last token (or its cancel) is now; returned now unless held back."""
    result.status, result.reason, result.ended = status, reason, now
    if returned:
        result.returned = now


def fan_out(request, first_id: int, prompt: list, rngs, eos: set) -> list:
    """A request's n sequences, ids first_id .. first_id + n - 1, sample i drawing with rngs[i];
    the first computes the prompt and each other shares_prompt_with it."""
    seqs = [Sequence(Result(first_id + i, float(request.arrival), request, choice=i),
                     list(prompt), rng, eos) for i, rng in enumerate(rngs)]
    for seq in seqs[1:]:
        seq.shares_prompt_with = seqs[0]
    return seqs


def hold_drafts(books: BlockManager, seq_ids, wanted, spare=None) -> list:
    """Hold the slots of each decoding sequence's draft, after its last token's -> the draft
    tokens each may verify: what speculation wanted, cut to the budget's spare tokens (None:
    no budget; the rows in order) and to what its blocks and the free list hold. Never a
    kept prefix block (evicting it loses a cached turn, and a pass of this step may still
    copy from it), never a preemption: a draft is worth less than anyone's place."""
    drafts = []
    for seq_id, n in zip(seq_ids, wanted, strict=True):
        n = max(0, min(n, books.free_room(seq_id), n if spare is None else spare))
        if n:
            books.append([seq_id], n)
        spare = None if spare is None else spare - n
        drafts.append(n)
    return drafts


class Scheduler:
    def __init__(self, books: BlockManager, slots: int, policy: str = "continuous",
                 budget: int | None = None, prefix_caching: bool = True):
        """books: the block manager (the pool's, PagedCache.books), which only the scheduler
        writes; policy "continuous" or "static", budget (tokens a step, None: no limit) and
        prefix_caching as an EngineConfig checked them (serve/config.py)."""
        self.books, self.policy, self.budget = books, policy, budget
        self.prefix_caching = prefix_caching
        self.slots = [None] * slots
        self.waiting: deque[Sequence] = deque()  # in arrival order; preempted ones at the front
        self.now, self.admitted = 0.0, 0
        self.preemptions = 0        # since the start, over all requests
        self.prefix_queries = self.prefix_hits = 0   # prompt tokens looked up / found cached

    def running(self) -> list:
        """The sequences in slots that are not over (prefilling or decoding)."""
        return [seq for seq in self.slots if seq is not None and not seq.padding]

    def schedule(self, now: float, wanted: dict | None = None) -> Plan:
        """The step's plan: who is preempted, who decodes, which chunks prefill, who enters,
        and, speculating, each decoding row's draft slots; the blocks each pass fills and
        reads. wanted: speculating, {sequence id: the draft tokens speculation would have
        it verify} (None: no speculation; a row it does not name: none)."""
        self.now = now
        rows = [seq for seq in self.running() if not seq.prefilling] + self._padding()
        preempted = self._preempt(rows)
        starts = self.books.append([row.result.id for row in rows], 1)
        for row in rows:
            if not row.padding:
                self._seal(row)
        decode = Work(rows, starts, 1, self.books.take_moves())
        budget = None if self.budget is None else self.budget - len(rows)
        prefill, admitted = self._prefill(budget)
        moves = self.books.take_moves()            # decided after the last forward pass
        if wanted is not None and rows:
            spare = None if budget is None else budget - sum(work.n for work in prefill)
            ids = [row.result.id for row in rows]
            decode.drafts = hold_drafts(self.books, ids, [wanted.get(i, 0) for i in ids],
                                        spare)
        plan = Plan(decode, prefill, admitted, preempted, moves)
        for work in plan.passes:
            self._blocks_of(work)
        return plan

    def commit(self, made: Made, now: float, on_commit=None) -> None:
        """What the plan's run made, into the books, then the step's ends, at ``now`` (the
        engine's clock once the step's tokens exist). The written slots are no longer being
        filled; a failed pass's sequences end (the engine's docstring, Faults); every row
        that made tokens holds exactly what it computed and kept (its draft slots past them,
        rejected or never proposed, go back: ``trim``), its full blocks named. on_commit(), if
        given, is called then (the engine's memory history: the books as the step left
        them). Last, first-token times, and those that made their last token retire."""
        self.now = now
        for work in made.ran:
            for seq_id, start, held in work.slots():
                self.books.written([seq_id], [start], held)
        if made.failed:
            self.books.drop_unwritten()    # no later prompt finds keys never computed
            reason = f"the engine failed on this request's step: {made.error!r}"
            for seq in dict.fromkeys(seq for work in made.failed
                                     for seq in (*work.rows, *work.firsts)):
                self.fail(seq, reason)
        for work in made.ran:
            for seq in dict.fromkeys((*work.rows, *work.firsts)):
                self._keep(seq)
        if made.failed:
            self.books.check()
        if on_commit is not None:
            on_commit()
        for seq in made.seqs:
            if len(seq.result.tokens) == 1:
                seq.result.first_token = now
            if seq.done:
                self.retire(seq)

    # --- the two policies, side by side ------------------------------------------------------
    def admits(self) -> bool:
        """May free slots take waiting requests this step?"""
        if self.policy == "continuous":
            return True             # any free slot, at the very next step
        # static: a new batch only once the last one is over; it forms until its first token
        # (with chunked prefill, members may take several steps to prefill)
        return all(seq is None or seq.prefilling for seq in self.slots)

    def retire(self, seq) -> None:
        """A sequence made its last token: it leaves its slot (static: at its batch's end)."""
        if self.policy == "continuous":
            self._end(seq, "finished")              # its blocks go back to the pool
        else:                       # static: marked finished, its row stays in the batch,
            close(seq.result, "finished", self.now, returned=False)  # computed, thrown away
            self._end_batch_if_over()

    def _padding(self) -> list:
        """Static: finished members whose rows still run (holding their blocks)."""
        return [seq for seq in self.slots if seq is not None and seq.padding
                and seq.result.id in self.books.seqs]

    def _end(self, seq, status: str, reason: str = "") -> None:
        """A running sequence is over: its blocks back to the pool, its slot free, returned."""
        self.books.free_seq(seq.result.id)
        self._leave_slot(seq)
        close(seq.result, status, self.now, reason=reason)

    def _leave_slot(self, seq) -> None:
        """Free a slot (a sequence finished, was cancelled or preempted)."""
        self.slots[self.slots.index(seq)] = None
        self._end_batch_if_over()

    def _end_batch_if_over(self) -> None:
        """Static: once no member of the batch is running, the batch is over, now: its
        padding rows are freed and every finished member is returned."""
        if self.policy != "static" or self.running():
            return
        for i, member in enumerate(self.slots):
            if member is not None:
                if member.result.id in self.books.seqs:
                    self.books.free_seq(member.result.id)
                member.result.returned = self.now
                self.slots[i] = None

    # --- cancelling --------------------------------------------------------------------------
    def cancel(self, request_id: int, now: float) -> bool:
        """Stop a sequence now: True if it was waiting or running, False if already over.
        Those waiting to share its prompt share the first of them's: it computes it."""
        self.now = now
        for seq in list(self.waiting) + self.running():
            if seq.result.id != request_id:
                continue
            sharers = self._sharers(seq)
            for child in sharers:
                child.shares_prompt_with = None if child is sharers[0] else sharers[0]
            if seq in self.waiting:
                self.waiting.remove(seq)
                close(seq.result, "cancelled", now)
            else:
                self._end(seq, "cancelled")
            return True
        return False

    def fail(self, seq, reason: str) -> None:
        """A step could not make this sequence's tokens (its pass raised): it ends with an
        error, and so do the samples waiting to share its prompt. A static batch's padding
        row keeps its answer (made already); only its blocks go."""
        for sharer in self._sharers(seq):
            self.waiting.remove(sharer)
            close(sharer.result, "error", self.now, reason=reason)
        if not seq.padding:
            self._end(seq, "error", reason)
        elif seq.result.id in self.books.seqs:
            self.books.free_seq(seq.result.id)

    def queued(self) -> int:
        """Requests waiting (the server's queue limit): a sequence sharing a prompt is part
        of its sibling's."""
        return sum(seq.shares_prompt_with is None for seq in self.waiting)

    # --- the parts of a plan -----------------------------------------------------------------
    def _preempt(self, rows) -> list:
        """Make room for every row's next token (rows shrinks to those that stay) -> the
        preempted. Padding rows go first (nobody waits for their tokens: they keep their
        slot, finished, without blocks); then the latest admitted running sequence (vLLM's
        choice: the earliest keep their progress) is swapped out to host memory and queued
        first, to be swapped back in bit for bit when the pool has room."""
        preempted = []
        while self._growth(rows) > self.books.num_free:
            padding = [row for row in rows if row.padding]
            if padding:
                victim = padding[-1]                # still returned with its batch
                self.books.free_seq(victim.result.id)
            else:
                victim = max(self.running(), key=lambda seq: seq.order)
                victim.swapped = self.books.swap_out(victim.result.id)
                self._leave_slot(victim)
                victim.result.status = "waiting"
                victim.result.preemptions += 1
                self.preemptions += 1
                self.waiting.appendleft(victim)
                preempted.append(victim)
            if victim in rows:
                rows.remove(victim)
        return preempted

    def _prefill(self, budget) -> tuple:
        """Chunks of prompts, at most budget tokens of them (None: no limit): those under way
        first, oldest first, then newcomers -> (one Work per chunk, the newcomers)."""
        chunks, admitted, planned = [], [], set()
        admits = self.admits()                      # (static: decided before anyone enters)
        while budget is None or budget > 0:
            under_way = [seq for seq in self.running() if seq.prefilling and seq not in planned]
            seq = min(under_way, key=lambda seq: seq.order) if under_way else \
                self._admit() if admits else None
            if seq is None:
                break
            if seq not in under_way:
                admitted.append(seq)
            if not seq.prefilling:                  # a preempted sequence swapped back in
                continue
            rid, prompt = seq.result.id, seq.tokens
            done = self.books.seqs[rid].length     # prompt tokens cached or computed
            n = len(prompt) - done if budget is None else min(len(prompt) - done, budget)
            starts = self.books.append([rid], n)
            self._seal(seq)
            seq.result.prefill_chunks += 1
            firsts = self._fork(seq) if done + n == len(prompt) else []
            planned.update([seq, *firsts])
            chunks.append(Work([seq], starts, n, self.books.take_moves(), firsts))
            budget = None if budget is None else budget - n
        return chunks, admitted

    def _blocks_of(self, work) -> None:
        """A pass's blocks, once the plan is made: those its slots write (``fills``), and
        those it reads, every block of its rows' tables and its copies' sources (``reads``)."""
        books = self.books
        tables = {seq.result.id: books.seqs[seq.result.id].blocks for seq in work.rows}
        work.fills = frozenset(b for seq_id, start, held in work.slots() for b in
                               tables[seq_id][start // books.block_size:
                                              books.blocks_for(start + held)])
        work.reads = frozenset(b for table in tables.values() for b in table if b != SLID) | \
            {move.src for move in work.moves if isinstance(move, Copy)}

    def _keep(self, seq) -> None:
        """After its pass: a sequence holds the tokens it has computed, all of its tokens
        but the last made (its slots past them go back), and its full blocks are named;
        then, the tokens it holds being those it keeps, the blocks that slid out of its next
        query's window go back (blocks.py, ``slide``: a windowed model's)."""
        held = self.books.seqs.get(seq.result.id)
        if held is None:                                # over
            return
        if seq.result.tokens:                           # past its prompt
            self.books.trim(seq.result.id, held.length - (len(seq.tokens) - 1))
            if not seq.padding:
                self._seal(seq)
        self.books.slide(seq.result.id)

    def _sharers(self, seq) -> list:
        """The waiting sequences that will fork seq's prompt, in queue order."""
        return [other for other in self.waiting if other.shares_prompt_with is seq]

    def _fork(self, seq) -> list:
        """A prompt's last chunk is planned: those sharing it leave the queue for free slots
        holding its blocks (``fork``) -> all whose first tokens its logits pick. The slots
        are there: counted when seq was admitted, and nobody overtook them at the queue's head."""
        sharers = self._sharers(seq)
        for child in sharers:
            self.waiting.remove(child)
            self._enter(child)
            self.books.fork(seq.result.id, child.result.id)
            child.shares_prompt_with = None
            mine, theirs = child.result, seq.result
            mine.cached_tokens, mine.prefill_chunks = theirs.cached_tokens, theirs.prefill_chunks
            mine.prompt_logprobs = theirs.prompt_logprobs
        return [seq] + sharers

    def _enter(self, seq) -> None:
        """Into a free slot, running, the latest admitted."""
        self.slots[self.slots.index(None)] = seq
        seq.order, self.admitted = self.admitted, self.admitted + 1
        seq.result.status = "running"

    def _admit(self):
        """The head of the queue into a free slot, if it may enter -> it, or None. Nobody
        overtakes the head of the queue, first come first served. A sequence sharing a prompt
        enters only by fork (``_fork``); the one computing it, only when there are slots for
        it and for those sharing it."""
        if not self.waiting:
            return None
        seq = self.waiting[0]
        if seq.shares_prompt_with is not None or seq.result.arrival > self.now or \
                self.slots.count(None) < 1 + len(self._sharers(seq)) or not self._fits(seq):
            return None
        self._enter(self.waiting.popleft())
        if seq.swapped:             # a preempted sequence resumes where it was
            self.books.swap_in(seq.result.id, seq.swapped)
            seq.swapped = None
        else:
            self._place(seq)
        return seq

    def _place(self, seq) -> None:
        """A new prompt's blocks, holding the cached prefix it starts with (if it may)."""
        reuse, prompt, result = self._reuses(seq), seq.tokens, seq.result
        held = self.books.add(result.id, prompt, len(prompt) + result.request.max_new_tokens,
                               reuse)
        result.cached_tokens = held
        if result.request.prompt_logprobs is not None:
            result.prompt_logprobs = [None]     # nothing predicts the first token
        if self.prefix_caching and reuse:
            self.prefix_queries, self.prefix_hits = (self.prefix_queries + len(prompt),
                                                     self.prefix_hits + held)

    def _fits(self, seq) -> bool:
        """Memory admission: can the pool take this sequence with room for its next token
        (else the next step could preempt it at once; none for a prompt-only request,
        records.Request.prompt_only), and every running sequence's next?"""
        then = 0 if seq.result.request.prompt_only else 1
        if seq.swapped:
            enter = self.books.swap_in_cost(seq.swapped, then=then)
        elif self._reuses(seq):
            enter = self.books.add_cost(seq.tokens, then=then)
        else:
            enter = self.books.blocks_for(len(seq.tokens) + then)
        enter += then * len(self._sharers(seq))  # each sharer's first token: a block or a copy
        return enter + self._growth(self.running()) <= self.books.num_free

    def _growth(self, rows) -> int:
        """Free blocks the next token of every row takes (new blocks, copies of shared ones)."""
        return self.books.room_needed([row.result.id for row in rows], 1)

    @staticmethod
    def _reuses(seq) -> bool:
        """May its prompt start from cached blocks? Not when the logprobs of every prompt
        token are asked for: they need every position's logits."""
        return seq.result.request.prompt_logprobs is None

    def _seal(self, seq) -> None:
        """Prefix caching: offer the sequence's newly full blocks to later prompts."""
        if self.prefix_caching:
            self.books.seal(seq.result.id, seq.tokens)

