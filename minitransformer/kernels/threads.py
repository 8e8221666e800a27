"""How many threads the arithmetic runs on, and the pool that runs a product's parts on them.

A learner may skip this module: it changes how fast a step runs, never what it computes. A
decode step is a string of products of each weight with a few vectors, and each one reads the
whole weight: on one core the step costs the time that core takes to read the weights. BLAS
threads its large products, but not these (OpenBLAS gives a few-row product to one thread, or
splits it so finely that a second thread costs more than it saves). So, as llama.cpp splits the
rows of every matrix across its threads, blas.py may split the output columns of a step's
product into T parts (the rows of the (out, in) weight, or the matching columns of a
column-major one), each part one single-threaded BLAS call over its share of the weight, run at
once on the threads of a `Pool` (NumPy releases the GIL inside a product, so the parts really
run side by side). Whether a product is split is measured per shape, rows and T (blas.py), as
its route and layout are: where the parts are no faster, the product takes one thread.

The setting, T, one number for the whole process:

    MT_THREADS=N      read at import (a bad value is a SettingError, as MT_BACKEND's)
    --threads N       the command line (`generate`, `chat`, `serve`) and every timing script:
                      set_count(N) before the model loads
    unset             the cores this process may use, len(os.sched_getaffinity(0))

How Python's threads and BLAS's threads are set, never T of each at once (T x T threads
fighting over T cores): a split product runs its T parts on the pool's T threads (the caller's
own and T - 1 workers) with BLAS held at one thread for the call (`run`); a product that is
not split runs on the caller's thread, BLAS at one thread too (`one_blas_thread`). That holds
for every product the model makes (blas.multiply) and for its attention (kernels/attention.py:
whole, or in parts across sequences or kv heads), a prefill's included; a forward pass holds
BLAS at one thread from its start to its end (model.forward), so that each product's own hold
costs a lock, not a get and a set of BLAS's count. BLAS's own threads
synchronize many times inside one product, and each time wait for a thread that waits for a
core, on a busy machine many times over (bench_decode.py --only-threads times a prefill at 1
and N threads side by side: docs/benchmarks/threads-<kernel>.md). The rest of NumPy (a
quantizer, a draft's training) runs on BLAS's own threads: T of them where the setting was
given, else BLAS's own default (OpenBLAS: the cores it may use, or $OPENBLAS_NUM_THREADS).

The pool's workers wait on a queue, blocked in the kernel: an idle pool (an idle server) takes
no CPU. They start at the first split product; a process forked after it starts its own.
"""
import os
import queue
import threading
import time
from contextlib import contextmanager
from functools import wraps

from minitransformer.errors import SettingError


def default_count() -> int:
    """The cores this process may use (its CPU affinity), where the system says; else the
    machine's cores."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def checked_count(n, name: str = "threads") -> int:
    """n as a thread count: an integer of at least 1, else a SettingError naming it.

    >>> checked_count("2")
    2
    >>> try:
    ...     checked_count("0", "MT_THREADS")
    ... except SettingError as e:
    ...     print(e)
    MT_THREADS='0' is not a thread count: use a whole number of at least 1
    """
    try:
        value = int(str(n).strip())
    except ValueError:
        value = 0
    if value < 1 or isinstance(n, bool):
        raise SettingError(f"{name}={n!r} is not a thread count: use a whole number of at least 1")
    return value


def blas_controllers() -> list:
    """threadpoolctl's handles on the BLAS libraries loaded (NumPy's among them): each sets and
    reads its library's thread count in a microsecond."""
    import numpy  # noqa: F401 - loads NumPy's BLAS, for threadpoolctl to find
    from threadpoolctl import ThreadpoolController
    return ThreadpoolController().select(user_api="blas").lib_controllers


class Pool:
    """T threads for the parts of a product: the caller's own and T - 1 workers.

    `run(tasks)` hands tasks[1:] to the workers, runs tasks[0] itself, and returns when every
    task is done (the first error raised again). One caller at a time: a second thread that
    calls while the pool is busy (a server's loop while a test decodes beside it) runs its
    tasks itself, one after another: the same calls, so the same numbers.

    >>> pool, out = Pool(2), []
    >>> pool.run([lambda: out.append(1), lambda: out.append(2)])
    >>> sorted(out)
    [1, 2]
    """

    def __init__(self, size: int):
        self.size = size
        self.busy = threading.Lock()
        self.workers: list[tuple[queue.SimpleQueue, threading.Thread]] = []  # (inbox, thread)
        self.pid: int | None = None   # the process the workers were started in
        self.done: queue.SimpleQueue[BaseException | None]  # each task's end (start makes it)

    def run(self, tasks) -> None:
        if len(tasks) == 1 or self.size == 1 or not self.busy.acquire(blocking=False):
            for task in tasks:
                task()
            return
        try:
            self.start()
            inboxes = [inbox for inbox, _ in self.workers]
            for inbox, task in zip(inboxes, tasks[1:], strict=False):   # fewer tasks: idle workers
                inbox.put(task)
            errors: list[BaseException | None] = [None]
            try:
                tasks[0]()
            except BaseException as e:
                errors[0] = e
            errors += [self.done.get() for _ in tasks[1:len(inboxes) + 1]]
            for task in tasks[len(inboxes) + 1:]:         # more tasks than threads: the rest here
                task()
            error = next((e for e in errors if e is not None), None)
            if error is not None:
                raise error
        finally:
            self.busy.release()

    def start(self) -> None:
        """Start the workers, once per process (a forked child has none of its parent's)."""
        if self.pid == os.getpid():
            return
        self.done, self.pid = queue.SimpleQueue(), os.getpid()
        self.workers = []
        for i in range(1, self.size):
            inbox: queue.SimpleQueue = queue.SimpleQueue()
            thread = threading.Thread(target=self.work, args=(inbox,), daemon=True,
                                      name=f"product-part-{i}")
            thread.start()
            self.workers.append((inbox, thread))

    def work(self, inbox) -> None:
        """A worker: wait for a task (blocked, no CPU), run it, say it is done; None ends it."""
        while (task := inbox.get()) is not None:
            try:
                task()
                self.done.put(None)
            except BaseException as e:
                self.done.put(e)

    def stop(self) -> None:
        """End the workers (after the ones running finish their task)."""
        if self.pid == os.getpid():
            for inbox, _ in self.workers:
                inbox.put(None)
        self.workers, self.pid = [], None


COUNT = checked_count(os.environ["MT_THREADS"], "MT_THREADS") \
    if os.environ.get("MT_THREADS", "").strip() else default_count()
SET_BY = "MT_THREADS" if os.environ.get("MT_THREADS", "").strip() else "default"
pool = Pool(COUNT)


def count() -> int:
    """T: the threads the step's products may be split across."""
    return COUNT


def set_count(n, set_by: str = "--threads", blas: bool = True) -> int:
    """Make T = n for the rest of the process: the pool's threads, and BLAS's own (unless
    blas is False: a test putting the setting back as it found it) -> n."""
    global COUNT, SET_BY, pool
    n = checked_count(n)
    if n != pool.size:
        pool.stop()
        pool = Pool(n)
    COUNT, SET_BY = n, set_by
    if blas:
        from threadpoolctl import threadpool_limits
        threadpool_limits(limits=n, user_api="blas")
    return n


kept: dict[int, Pool] = {}  # n -> the pool of n threads `using` made, kept for its next time


@contextmanager
def using(n: int):
    """T = n inside, BLAS's own threads n too, and both as they were after: for a benchmark
    timing 1 and N threads side by side in one process (a switch costs microseconds; each
    count keeps its own pool, and blas.py its own measured splits)."""
    global COUNT, pool
    n = checked_count(n)
    before, libraries = (COUNT, pool), controllers()
    blas = [lib.get_num_threads() for lib in libraries]
    COUNT, pool = n, kept.setdefault(n, pool if pool.size == n else Pool(n))
    for lib in libraries:
        lib.set_num_threads(n)
    try:
        yield
    finally:
        COUNT, pool = before
        for lib, count_before in zip(libraries, blas, strict=True):
            lib.set_num_threads(count_before)


SPLIT_GAIN = 0.95        # parts are taken only where this much faster than the whole
TRIALS = 3               # timed calls whole and in parts (alternating) before a kind is decided
# what was measured as it ran (whole_or_parts): kind -> the parts kept, 1 or the count
taken: dict[tuple, int] = {}
# the same kinds -> {1: [seconds], count: [seconds]}, while a kind is measured
timings: dict[tuple, dict[int, list[float]]] = {}


def whole_or_parts(kind: tuple, run, count: int):
    """run(1) or run(count): work that gives the same result whole on this thread or in count
    parts on the pool, whichever was measured faster for this kind of call. The first TRIALS
    calls of each kind alternate whole and in parts, timed as they run (the result is the same,
    so the choice moves only the time); then the parts are kept only where their fastest was
    SPLIT_GAIN of the whole's or less (waking a thread costs more than a small part saves).
    Kept for the process (`taken`): a kind's first calls come within its first steps.

    >>> kind = ("a doctest's squares", 4)
    >>> [whole_or_parts(kind, lambda n: [x * x for x in range(4)], 2)[-1] for _ in range(8)]
    [9, 9, 9, 9, 9, 9, 9, 9]
    >>> taken[kind] in (1, 2) and kind not in timings
    True
    """
    if kind in taken:
        return run(taken[kind])
    seen = timings.setdefault(kind, {1: [], count: []})
    n = 1 if len(seen[1]) <= len(seen[count]) else count
    start = time.perf_counter()
    out = run(n)
    seen[n].append(time.perf_counter() - start)
    if len(seen[count]) >= TRIALS:
        taken[kind] = count if min(seen[count]) <= SPLIT_GAIN * min(seen[1]) else 1
        del timings[kind]
    return out


def map_in_parts(fn, items, kind=None) -> list:
    """[fn(item) for item in items], the items cut into at most T runs in order, each run on a
    thread of the pool: for items that share nothing (each decode row's draw of its token, from
    its own logits and its own generator), whose results are then the same whichever thread
    made them. NumPy lets go of the interpreter's lock inside its loops (a top-p draw's sort
    over the vocabulary), so the runs really run side by side. kind: what the call is, for
    whole_or_parts to cut only where cutting was measured faster; None: always cut.

    >>> map_in_parts(lambda x: x * x, range(5))
    [0, 1, 4, 9, 16]
    """
    items = list(items)
    n = min(COUNT, len(items))
    if n <= 1:
        return [fn(item) for item in items]
    out: list = [None] * len(items)

    def part(a: int, b: int) -> None:
        for i in range(a, b):
            out[i] = fn(items[i])

    def runs(count: int) -> list:
        pool.run([lambda a=a, b=b: part(a, b) for a, b in
                  ((i * len(items) // count, (i + 1) * len(items) // count)
                   for i in range(count))])
        return out
    return runs(n) if kind is None else whole_or_parts((*kind, len(items), n), runs, n)


def run(tasks) -> None:
    """Run the tasks (the parts of one product) on the pool's threads, BLAS at one thread each."""
    with one_blas_thread():
        pool.run(tasks)


holding = 0              # the one_blas_thread blocks open now, in every thread
kept_counts: list = []   # BLAS's own counts when the first of them opened, put back by the last
holding_lock = threading.Lock()
here = threading.local()  # .depth: the blocks open in this thread
# The names OpenBLAS's builds export its openblas_set_num_threads_local by: a count that every
# thread takes, set from any thread; it gives back the count it replaced (0 is not "as before":
# it sets as many as the library has threads).
LOCAL_SETTERS = ("openblas_set_num_threads_local", "scipy_openblas_set_num_threads_local64_",
                 "openblas_set_num_threads_local64_")


def depth() -> int:
    """How many one_blas_thread blocks this thread has open."""
    return getattr(here, "depth", 0)


@contextmanager
def one_blas_thread():
    """BLAS at one thread inside, as it was after: the first block to open (in any thread) sets
    it (a few microseconds), the last to close puts it back, and one opened inside another
    costs a lock (a forward pass holds it for its products, model.forward).

    It is set by openblas_set_num_threads_local where every BLAS library has it
    (`local_setters`), else by the library's own count: OpenBLAS 0.3.31 ignores
    openblas_set_num_threads called from a thread that is not the main one, and a server's
    engine loop runs in a thread of its own: there every product ran on BLAS's own T threads
    and each split part on T more (measured 5-10x slower at 2 threads than at 1 on a loaded
    2-core machine)."""
    global holding, kept_counts
    n = depth()
    here.depth = n + 1
    with holding_lock:
        if holding == 0:
            setters = local_setters()
            if setters is not None:                  # each gives back the count it replaced
                kept_counts = [set_every(1) for set_every in setters]
            else:
                kept_counts = [lib.get_num_threads() for lib in controllers()]
                for lib, count_before in zip(controllers(), kept_counts, strict=True):
                    if count_before != 1:
                        lib.set_num_threads(1)
        holding += 1
    try:
        yield
    finally:
        here.depth = n
        with holding_lock:
            holding -= 1
            if holding == 0:
                setters = local_setters()
                if setters is not None:
                    for set_every, count_before in zip(setters, kept_counts, strict=True):
                        set_every(count_before)
                else:
                    for lib, count_before in zip(controllers(), kept_counts, strict=True):
                        if count_before != 1:
                            lib.set_num_threads(count_before)


setters_found: list = []  # [the setters, or None], once found


def local_setters():
    """Each BLAS library's openblas_set_num_threads_local (LOCAL_SETTERS), as ctypes
    functions; None where a library has none (an older OpenBLAS, another BLAS)."""
    if not setters_found:
        import ctypes
        found: list | None = []
        for lib in controllers():
            dll = getattr(lib, "dynlib", None)
            name = next((n for n in LOCAL_SETTERS if dll is not None and hasattr(dll, n)), None)
            if name is None or found is None:
                found = None
                continue
            setter = getattr(dll, name)
            setter.argtypes, setter.restype = [ctypes.c_int], ctypes.c_int
            found.append(setter)
        setters_found.append(found or None)
    return setters_found[0]


def on_one_blas_thread(fn):
    """fn with BLAS held at one thread for the whole call (one_blas_thread): its products'
    own holds then cost a lock each, not BLAS's get and set."""
    @wraps(fn)
    def held_throughout(*args, **kwargs):
        with one_blas_thread():
            return fn(*args, **kwargs)
    return held_throughout


held = None


def controllers() -> list:
    """blas_controllers, found once."""
    global held
    if held is None:
        held = blas_controllers()
    return held


def describe() -> str:
    """The setting in words, for every line that says where a figure ran, e.g. 'threads: 2
    (the 2 cores this process may use; BLAS 1 in the model's products, 2 in the rest)'."""
    source = {"default": f"the {default_count()} cores this process may use",
              "MT_THREADS": "MT_THREADS"}.get(SET_BY, SET_BY)
    blas = sorted({lib.get_num_threads() for lib in controllers()})
    return (f"threads: {COUNT} ({source}; BLAS 1 in the model's products, "
            f"{', '.join(map(str, blas)) or '?'} in the rest)")


if SET_BY == "MT_THREADS":
    set_count(COUNT, SET_BY)
