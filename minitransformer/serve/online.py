"""The engine online: a loop on a real clock that serves requests arriving while it runs.

``engine.run`` takes a list of requests known in advance and a simulated clock. A server has
neither: clients arrive whenever they like, from other threads, and want their tokens as they
are made. ``OnlineEngine`` puts the same ``Engine`` in a background thread:

    clients (any thread)              the loop (one thread, the only one touching the engine)
    submit(request, listener) --+
    cancel(ticket) -------------+-->  inbox --> engine.submit / engine.cancel
                                      engine.clock = now; engine.step()
    listener(Update) <--------------  new tokens of each request (of each of its n samples),
                                      and its end

The engine is not thread-safe, so only the loop calls it: clients leave commands in an inbox
(held under a lock for microseconds, never across a step) and the loop applies them between
steps. That keeps a step from ever blocking a client, and a client from ever seeing the engine
half-way through a step. Tokens are exactly the engine's, so each request gets the tokens
``generate`` gives it alone with the same settings and seed.

A step that fails ends the requests it concerned with status "error" and the loop goes on
(engine.py, "Faults"). An error the engine cannot go on after (raised from its step) ends
every request in flight and every one submitted with "error", refuses new ones (``Closed``),
calls ``on_failure(error)`` once (the server stops, so that a supervisor restarts it) and
stops the loop: never a loop that takes requests it cannot serve.

Listeners run on the loop thread and must return at once (put into a queue, nothing more).
A request's record is released (``Engine.release``) once its end is handed over, so an engine
that serves for days holds only its running requests' records (see engine.py, "Records").
Leaves out: priorities, a bound on how long a request may wait.
"""
import math
import queue
import threading
import time
from dataclasses import dataclass, field, replace


class QueueFull(Exception):
    """The waiting queue is at its limit: try again later (HTTP 429)."""


class Closed(Exception):
    """The engine is shutting down and takes no new request (HTTP 503)."""


MAX_WAITING = 64  # waiting requests beyond which a new one is refused (HTTP 429)


@dataclass(frozen=True)
class Update:
    tokens: tuple               # token ids made since the last update of this request
    done: bool                  # the last update: the request is over
    status: str                 # the engine's: running, finished, cancelled, rejected (or error)
    reason: str                 # why, for rejected / error
    time: float                 # seconds on the online clock when the tokens were handed over
    record: object              # the engine's record of the request (timings, preemptions)
    choice: int = 0             # which of the request's n samples these tokens belong to
    logprobs: tuple = ()        # a TokenLogprob per token, when the request asked for them


@dataclass(frozen=True)
class Snapshot:                 # the engine's state after a step, for /metrics and /health
    running: int
    waiting: int
    blocks_used: int
    blocks_total: int
    preemptions: int            # since start
    prefix_queries: int = 0     # prompt tokens looked up in the prefix cache, since start
    prefix_hits: int = 0        # of which found cached
    speculative: object = None  # a copy of the engine's speculate.SpecCounters, if it drafts


@dataclass(frozen=True)
class Sizes:                    # the engine's limits, fixed when it is built (for the HTTP layer)
    num_blocks: int             # KV blocks in the pool
    block_size: int             # tokens a block holds
    max_num_seqs: int           # sequences a step may run at once (the most samples a request has)

    @property
    def pool_tokens(self) -> int:
        return self.num_blocks * self.block_size


@dataclass(eq=False)
class Ticket:                   # a client's handle on its request
    listener: object
    n: int = 1                  # samples: the engine's ids id .. id + n - 1
    id: int | None = None       # the engine's request id, once the loop has submitted it
    sent: list[int] = field(default_factory=list)   # per sample, tokens already handed over
    over: list[bool] = field(default_factory=list)  # per sample, whether its last update was sent

    @property
    def ids(self) -> range:
        assert self.id is not None, "a ticket's ids are known once the loop submitted it"
        return range(self.id, self.id + self.n)


class OnlineEngine:
    def __init__(self, engine, max_waiting: int = MAX_WAITING, on_failure=None):
        """on_failure(error): called once, on the loop thread, if the engine cannot go on,
        after every request has its error (the server's cue to stop). A client reads the
        engine only through ``model``, ``sizes`` and ``pool_need``: its state is the loop's."""
        self.engine, self.max_waiting, self.on_failure = engine, max_waiting, on_failure
        self.model = engine.model
        books = engine.cache.books
        self.sizes = Sizes(books.num_blocks, books.block_size, engine.config.max_num_seqs)
        self.start = time.perf_counter()
        self.lock = threading.Condition()   # guards inbox and closing; wakes the loop
        self.inbox: list = []       # (request, ticket) submitted, not yet in the engine
        self.closing, self.abandon, self.error = False, False, None
        self.live: list[Ticket] = []  # tickets whose request is in the engine and not over
        self.snapshot = self._snapshot()
        self.taken = 0              # submissions the loop took from the inbox, not yet in it
        self.thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
        self.thread.start()

    def now(self) -> float:
        """Seconds since the engine started: the clock of arrivals, steps and updates."""
        return time.perf_counter() - self.start

    # --- what clients call (any thread) ------------------------------------------------------
    def pool_need(self, request) -> int:
        """KV blocks a request may hold at once (``Engine.pool_need``: sizes alone)."""
        return self.engine.pool_need(request)

    def submit(self, request, listener) -> Ticket:
        """Queue a request arriving now; listener(Update) gets its tokens. Raises ValueError
        for a request the engine would refuse (decided here, before anything is queued or
        answered), QueueFull when max_waiting requests already wait, Closed after close()."""
        return self.submit_all([(request, listener)])[0]

    def submit_all(self, requests) -> list:
        """Queue (request, listener) pairs arriving now, all or none: -> their Tickets. The
        queue's limit counts the whole batch at once (a batch of k needs k free places), so
        whether it is taken never depends on how far the engine got meanwhile."""
        for request, _ in requests:
            self.engine.check(request)
        tickets = [Ticket(listener, request.n if isinstance(request.n, int) else 1)
                   for request, listener in requests]
        with self.lock:
            if self.closing or self.error:
                raise Closed("the engine is shutting down" if self.closing else
                             f"the engine failed and cannot go on: {self.error!r}")
            waiting = self.snapshot.waiting + self.taken + \
                sum(cmd == "submit" for cmd, *_ in self.inbox)
            if waiting + len(requests) > self.max_waiting:
                raise QueueFull(f"{waiting} requests are waiting and {len(requests)} more "
                                f"arrive (the limit is {self.max_waiting})")
            arrival = self.now()
            for ticket, (request, _) in zip(tickets, requests, strict=True):
                self.inbox.append(("submit", ticket, replace(request, arrival=arrival)))
            self.lock.notify()
        return tickets

    def cancel(self, ticket, choice: int | None = None) -> None:
        """Stop a request (or only its sample ``choice``) now: its blocks go back to the pool
        before the next step."""
        with self.lock:
            self.inbox.append(("cancel", ticket, choice))
            self.lock.notify()

    def in_flight(self) -> int:
        """Requests submitted and not over yet (running, waiting, or still in the inbox)."""
        with self.lock:
            return len(self.live) + self.taken + sum(cmd == "submit" for cmd, *_ in self.inbox)

    def stream(self, request):
        """Yield a request's token ids as they are made (a blocking convenience, for n = 1:
        the samples of n > 1 come through ``submit``'s listener, each update saying whose)."""
        if request.n != 1:
            raise ValueError(f"stream serves one sample, got n={request.n!r}: use submit")
        updates: queue.Queue[Update] = queue.Queue()
        ticket = self.submit(request, updates.put)
        try:
            while True:
                update = updates.get()
                yield from update.tokens
                if update.done:
                    if update.status in ("rejected", "error"):
                        raise ValueError(update.reason)
                    return
        finally:
            self.cancel(ticket)     # a no-op when over; frees the blocks if the caller left

    def close(self, drain: bool = True, timeout: float | None = None) -> None:
        """Take no new request; finish the ones in flight (drain) or cancel them; stop."""
        with self.lock:
            self.closing, self.abandon = True, self.abandon or not drain
            self.lock.notify()
        self.thread.join(timeout)

    # --- the loop (its own thread) -----------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self.lock:
                while not (self.inbox or self._busy() or self.closing):
                    self.lock.wait()
                commands, self.inbox = self.inbox, []
                self.taken = sum(cmd == "submit" for cmd, *_ in commands)
            try:
                for command, ticket, argument in commands:
                    self._apply(command, ticket, argument)
                for ticket in self.live if self.abandon else ():
                    for rid in ticket.ids:          # close(drain=False): everyone, now
                        self.engine.cancel(rid)
                with self.lock:                      # the queue as clients now see it
                    self.snapshot, self.taken = self._snapshot(), 0
                if self._busy():
                    self.engine.clock = self.now()   # the engine's clock is the wall clock
                    self.engine.step()
                self._hand_over()
            except Exception as e:  # the engine's own: fail every request loudly, then stop
                self._fail(e)
                if self.on_failure is not None:
                    self.on_failure(e)
                return
            if self.closing and not self._busy():
                with self.lock:
                    if not self.inbox:
                        return

    def _busy(self) -> bool:
        return bool(self.engine.waiting or self.engine.running())

    def _apply(self, command, ticket, argument) -> None:
        """Apply a client's command: "submit" (argument is the request) or "cancel" (argument
        is the sample to stop, or None for all of them)."""
        if command == "cancel":
            if ticket.id is not None:   # None: its submission was refused, it is over
                for choice, rid in enumerate(ticket.ids):
                    if argument is None or argument == choice:
                        self.engine.cancel(rid)
            return
        try:
            ticket.id = self.engine.submit(argument)
        except ValueError as e:     # bad ids or lengths: the request ends here
            ticket.n = 1
            return self._send(ticket, Update((), True, "rejected", str(e), self.now(), None))
        ticket.sent, ticket.over = [0] * ticket.n, [False] * ticket.n
        self.live.append(ticket)

    def _hand_over(self) -> None:
        """Give each live request its new tokens, sample by sample; a request whose samples
        are all over leaves the live list. The queue's snapshot is taken first: a client that
        has its first token, and sends another request at once, is counted running, not
        waiting (the waiting limit's 429 would otherwise count it for a moment)."""
        with self.lock:
            self.snapshot = self._snapshot()
        now, still = self.now(), []
        for ticket in self.live:
            for choice, rid in enumerate(ticket.ids):
                record, sent = self.engine.results[rid], ticket.sent[choice]
                new = tuple(record.tokens[sent:])
                done = not math.isnan(record.returned)   # static batching: at batch end
                if ticket.over[choice] or not (new or done):
                    continue
                ticket.sent[choice], ticket.over[choice] = sent + len(new), done
                self._send(ticket, Update(new, done, record.status, record.reason, now, record,
                                          choice, tuple(record.logprobs[sent:sent + len(new)])))
            if not all(ticket.over):
                still.append(ticket)
            else:                   # handed over: the engine may forget the records
                for rid in ticket.ids:
                    self.engine.release(rid)
        self.live = still

    def _snapshot(self) -> Snapshot:
        cache = self.engine.cache
        return Snapshot(len(self.engine.running()), self.engine.scheduler.queued(),
                        cache.books.num_blocks - cache.books.num_free, cache.books.num_blocks,
                        self.engine.preemptions, self.engine.prefix_queries,
                        self.engine.prefix_hits, None if self.engine.speculator is None
                        else self.engine.speculator.counters.copy())

    def _send(self, ticket, update) -> None:
        try:
            ticket.listener(update)
        except Exception:           # a broken listener must not stop everyone else's tokens
            if ticket.id is not None:
                for rid in ticket.ids:
                    self.engine.cancel(rid)

    def _fail(self, error) -> None:
        with self.lock:
            self.error = error
            orphans, self.inbox = [t for c, t, _ in self.inbox if c == "submit"], []
        for ticket in self.live + orphans:
            self._send(ticket, Update((), True, "error", f"engine failed: {error!r}",
                                      self.now(), None))
        self.live = []
