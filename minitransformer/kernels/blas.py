"""How a product x @ w.T goes into BLAS: the call that is fastest on the BLAS running here.

A learner may skip this module: `multiply(x, w)` is `x @ w.T`. It exists because a decode step
is a string of products of a weight matrix with a few vectors, and the route they take into
BLAS decides what the step costs. For M rows of x there are four routes to the same numbers,
all over the one copy of w the model holds:

    flat     one matrix-matrix product, (w @ x.T).T: every weight read once for all M rows
             (with many rows OpenBLAS runs it faster this way round than x @ w.T); for one
             row, NumPy's matrix-vector product w @ x
    rows     M matrix-vector products, w @ x[m]: every weight read M times, but no packing
    slices   x @ w[r0:r1].T, a few hundred rows of w at a time: products small enough for
             a BLAS's small-matrix path (where it has one) multiply without repacking w;
             for one row, row blocks of w times the vector
    dots     one dot product per row of w and row of x: the read a BLAS dot product makes,
             the fastest streaming read on some CPUs, where the matrix-vector kernel is not

Which is fastest depends on the BLAS kernel and the CPU, not on the arithmetic: for a few rows
times one large matrix, slices can beat flat by far on a kernel with a small-matrix path
(OpenBLAS's SkylakeX) and only just on one without (its Haswell), with rows behind both. One
row is no simpler: on some CPUs the matrix-vector product streams a weight well below the rate
of a dot product over the same bytes (scripts/dev/bench_decode.py times every route per kernel
and writes docs/benchmarks/decode-<kernel>.md, its routes table). So nothing
here is tuned to one kernel: more than FEW_ROWS rows take one flat product, and for 1..FEW_ROWS
rows the first product of each shape times the routes (for one row, `rows` is the very call
`flat` makes, so three) on its own operands and keeps the fastest for that shape. A weight of
COLD_BYTES or more is timed as a decode step reads it, from memory (a decode step reads every
weight once, so none of them is still cached when its turn comes): each timing takes the next
of a ring of copies of it, FLUSH_BYTES of them (twice the caches), so the others were read since
that copy's last timing; a weight over LARGE_BYTES (a vocabulary's head), too large to copy so
often, is timed after FLUSH_BYTES of other data are read, or after a whole pass over a
weight of FLUSH_BYTES or more, which evicts what the caches held itself (the copies and that
data are one scratch memory, in small pages, given back once the model is built). rows and
dots, M alike passes over w, are timed as one pass, counted M times; a route far slower than the
fastest after two trials is timed no more, and slices, many small products, stops as soon as
it has taken longer than the fastest route so far (it has lost: the route taken is the same).

The weight's own layout matters as much: BLAS reads a row-major (n, in) w and the same values
laid out column-major (w.T row-major, so x @ w.T is BLAS's plain untransposed product) at
different speeds, and for a few rows the column-major one can be the faster (on some kernels;
bench_decode.py's batching table times the row-major model beside the laid-out one, in the same
docs/benchmarks/ files). So each weight matrix the
model multiplies is laid out once, where the model is built (`arrange`, called by fused.py): the
routes for each row count the process will run (`rows_run`: 1 and FEW_ROWS; a server adds its
max_num_seqs through `expect_rows` before it loads) are timed over both layouts side by side,
the weight is copied column-major only where that layout is the faster at every count, and the
fastest route of each count *in the layout taken* is kept with it (one layout per shape; never
under MT_PRODUCTS, so that two runs compare bits over the same layout).
`MT_LAYOUT=row-major|column-major` fixes the layout of every weight instead, and measures none
(read at import): row-major is the checkpoint's own, the library before it measured layouts,
for a benchmark's before and after in one run (scripts/dev/bench_serving.py). In
either layout `flat` is the one product that reads w untransposed: (w @ x.T).T row-major,
x @ w.T column-major; `dots` reads rows of w, which column-major are strided: not taken there.

Measured once, remembered: timing every shape takes seconds, so what was measured (a layout
with its routes, a route) is kept per machine in a small file (tuning.py: the CPU, the BLAS, its
kernel and threads decide the answer) and read back at the next load; only what the file lacks
is timed, and a load that times says so on stderr. The file is data: a name in it that is not
a layout or a route taken there is measured again, never used. MT_TUNING=remeasure measures
again on purpose; MT_TUNING=off keeps nothing (each process measures for itself).

The routes sum in different orders, so their last bits differ. Within a process a shape always
takes the same route, so the same calls give the same bits (a row of a batch-invariant step makes
the very call the row alone makes, linear.py); across processes it is the same where they read
one file, but may differ where each measured, and `MT_PRODUCTS=flat|rows|slices|dots` fixes it
for every shape of 1..FEW_ROWS rows (read at import, as MT_BACKEND) for a comparison of bits
between two runs. On CuPy every product is one cuBLAS call (flat); the strict test backend runs
exactly NumPy's calls on the data it wraps (backend.numpy_kernel).
"""
import itertools
import mmap
import time

import numpy as np

from minitransformer.backend import BACKEND, numpy_kernel, xp
from minitransformer.checks import environment_choice
from minitransformer.kernels import threads, tuning
from minitransformer.progress import tell

ROUTES = ("flat", "rows", "slices", "dots")
ONE_ROW = ("flat", "slices", "dots")  # for one row, `rows` is `flat`'s own matrix-vector call
FEW_ROWS = 16            # up to this many rows, the route is measured; above it, flat
FIXED = environment_choice("MT_PRODUCTS", ROUTES, "a BLAS route", "to measure")
LAYOUTS = ("row-major", "column-major")
FIXED_LAYOUT = environment_choice("MT_LAYOUT", LAYOUTS, "a layout", "to measure")
SPLITS = ("whole", "parts")
FIXED_SPLIT = environment_choice("MT_SPLIT", SPLITS, "a split", "to measure")
SPLIT_TRIALS = 5         # timings of a product whole and in parts (the fastest of each counts)
PART_COLUMNS = 16        # a part's output columns: a multiple of this (64 bytes of float32)
TRIALS = 3               # timings per route and layout when a shape is measured (the fastest)
COLD_BYTES = 1 << 20     # a weight this large is timed from memory, as a decode step reads it
# read between two timings of a weight from memory: twice the caches one core reads through
# (at least 16 MiB), 128 MiB where the system does not say how large they are
FLUSH_BYTES = max(2 * tuning.cache_bytes(), 1 << 24) if tuning.cache_bytes() else 1 << 27
LARGE_BYTES = FLUSH_BYTES // 4  # up to this a weight is timed over copies of itself, above flushed
COPY_ROWS = 256          # rows of w copied at a time into the column-major layout
PRUNE, PRUNE_AFTER = 3, 2  # a route this many times slower after so many trials: timed no more
room = None              # the scratch memory measuring works in (scratch()), when it is
rows_run = {1, FEW_ROWS}  # the row counts a weight's layout is decided over (expect_rows adds)
chosen: dict = {}        # (M, n, in, layout, dtypes) -> the route measured fastest there
laid_out: dict = {}      # (n, in, dtype, row counts) -> the layout measured faster for that shape
split: dict = {}         # (M, n, in, layout, dtypes, route, T) -> parts measured fastest: 1 or T


def multiply(x, w, out=None):
    """x (M, in) @ w (n, in).T -> (M, n), by the route chosen for M rows (see the docstring).

    >>> from minitransformer.backend import to_device, to_numpy
    >>> a, b = xp.ones((2, 3), xp.float32), to_device(np.arange(12.0, dtype=np.float32))
    >>> to_numpy(multiply(a, b.reshape(4, 3))).tolist()
    [[3.0, 12.0, 21.0, 30.0], [3.0, 12.0, 21.0, 30.0]]
    """
    if BACKEND == "cupy":                                            # one cuBLAS call
        return flat(x, w, out)
    return on_device(x, w, out)


def numpy_multiply(x, w, out=None):
    """multiply on NumPy arrays: for code already running on NumPy's data (quant/matmul.py).
    The route chosen (flat for more than FEW_ROWS rows), whole on one thread or in parts on the
    pool's threads (`parts`, threads.py)."""
    route = route_for(x, w)
    if out is None:
        out = np.empty((len(x), len(w)), np.result_type(x, w)).view(type(x))  # (M, n)
    return in_parts(route, x, w, out, parts(x, w, route))


def route_for(x, w) -> str:
    """The route M rows of x take to multiply w here: flat for more than FEW_ROWS rows; for
    1..FEW_ROWS, FIXED, or the route measured fastest for this shape (on this machine:
    tuning.py's file remembers it; else measured the first time the shape comes, and kept
    there)."""
    M = len(x)
    if M > FEW_ROWS:
        return "flat"
    if FIXED is not None:
        return FIXED
    key = shape_key(x, w)
    if key not in chosen:
        chosen[key] = known(tuning.recall(route_key(key)), candidates(M, layout(w))) \
            or measured_route(x, w, key)
    return chosen[key]


def measured_route(x, w, key: tuple) -> str:
    """The fastest route for these operands, timed now on one thread, as a step's product runs
    (its scratch memory given back after: a step of a new count of rows, once per machine)
    and kept in the file."""
    with threads.one_blas_thread():
        route = fastest(x, w)
    release()
    tuning.remember(route_key(key), route)
    return route


def known(answer, names: tuple):
    """answer where it is one of names, else None: what the file holds is checked, never
    trusted (a route or layout blas.py does not know, or may not take there, is measured again)."""
    return answer if isinstance(answer, str) and answer in names else None


def shape_key(x, w) -> tuple:
    """What a measured route belongs to: the rows, w's shape and layout, the dtypes."""
    return len(x), *w.shape, layout(w), x.dtype.str, w.dtype.str


def route_key(key: tuple) -> str:
    """A shape_key as the file spells it, e.g. 'route 8 3072x576 row-major <f4 <f4'."""
    M, n, cols, held, x_dtype, w_dtype = key
    return f"route {M} {n}x{cols} {held} {x_dtype} {w_dtype}"


def layout(w) -> str:
    """row-major, or column-major (w.T row-major); a matrix that is neither counts as row-major
    (its products are timed as they come, like any other)."""
    return "column-major" if w.flags.f_contiguous and not w.flags.c_contiguous else "row-major"


def candidates(M: int, held: str = "row-major") -> tuple:
    """The routes worth timing for M rows over a w held in layout `held`: every route, but for one
    row `rows` is `flat`; over a column-major w not `dots` (its rows are strided: a dot product
    per row reads them badly)."""
    routes = ONE_ROW if M == 1 else ROUTES
    return routes if held == "row-major" else tuple(r for r in routes if r != "dots")


def parts(x, w, route: str) -> int:
    """Into how many parts the product of len(x) rows by w is split: T (threads.py) where T
    parts across the pool were measured faster than the whole on one thread, for this shape,
    rows, route and T (on this machine: tuning.py's file remembers it), else 1; every count of
    more than FEW_ROWS rows (a prefill's, a long mixed step's) takes what the first such
    product of the shape measured (its rows spelled 'many' in the file);
    under MT_SPLIT=whole|parts, 1 or T for every product, and under MT_PRODUCTS (which fixes
    the calls for a comparison of bits between runs) 1 unless MT_SPLIT=parts. A function of
    the shape alone, never of the batch: a row of a batch-invariant step makes the very calls
    the row alone makes."""
    T = threads.count()
    if T == 1 or FIXED_SPLIT is not None or FIXED is not None:
        return T if FIXED_SPLIT == "parts" else 1
    key = (*shape_key(x, w), route, T)
    if len(x) > FEW_ROWS:
        key = ("many", *key[1:])
    if key not in split:
        answer = tuning.recall(split_key(key))
        split[key] = answer if type(answer) is int and answer in (1, T) \
            else measured_split(x, w, key)
    return split[key]


def split_key(key: tuple) -> str:
    """A split's key as the file spells it, e.g. 'split 1 3072x576 row-major <f4 <f4 flat 2'."""
    M, n, cols, held, x_dtype, w_dtype, route, T = key
    return f"split {M} {n}x{cols} {held} {x_dtype} {w_dtype} {route} {T}"


def measured_split(x, w, key: tuple) -> int:
    """Time the product whole on one thread and in T parts on the pool, side by side, from
    memory as a step reads w (`rings`, as the routes are timed), SPLIT_TRIALS each, interleaved
    -> T where the parts' fastest is threads.SPLIT_GAIN of the whole's or less, else 1
    (where more threads do not help, a tiny weight or a bandwidth-bound read, the product
    takes one thread: never slower at T threads than at 1). Kept in the file, quietly: it is
    measured when a step first makes the product (for M rows, where a layout is measured at
    load), a few products long, so no pause to explain, and a line would land in the middle of
    the tokens a chat or `generate` is showing."""
    M, n, cols, held, _, _, route, T = key
    out = np.empty((len(x), n), np.result_type(x, w))
    turns = itertools.cycle(rings([w])[0])
    best = dict.fromkeys((1, T), float("inf"))
    for _ in range(SPLIT_TRIALS):
        for count in best:
            w = next(turns)
            if w.nbytes > LARGE_BYTES:
                flush_caches(flush_buffer())
            start = time.perf_counter()
            in_parts(route, x, w, out, count)
            best[count] = min(best[count], time.perf_counter() - start)
    release()
    taken = T if best[T] <= threads.SPLIT_GAIN * best[1] else 1
    tuning.remember(split_key(key), taken, quiet=True)
    return taken


def in_parts(route: str, x, w, out, count: int):
    """x @ w.T into out by `route`: whole on this thread (count 1), or its output columns cut
    into `count` parts (part_bounds), each the same route over its rows of w, on the pool's
    threads; BLAS at one thread in either case (threads.py)."""
    call = CALLS[route]
    if count == 1:
        with threads.one_blas_thread():
            return call(x, w, out)
    align = slice_rows(len(x), w.shape[1]) if route == "slices" else PART_COLUMNS
    threads.run([lambda r0=r0, r1=r1: call(x, w[r0:r1], out[:, r0:r1])
                 for r0, r1 in part_bounds(len(w), count, align)])
    return out


def part_bounds(n: int, count: int, align: int) -> list:
    """[(r0, r1)]: n output columns cut into at most `count` runs of about n / count, each
    starting at a multiple of `align` (for `slices`, its slice: every part makes the very
    calls the whole makes over its columns).

    >>> part_bounds(3072, 2, 16), part_bounds(100, 2, 16), part_bounds(20, 2, 16)
    ([(0, 1536), (1536, 3072)], [(0, 64), (64, 100)], [(0, 16), (16, 20)])
    """
    step = -(-n // count)
    step = -(-step // align) * align
    return [(r0, min(r0 + step, n)) for r0 in range(0, n, step)]


def expect_rows(*counts) -> None:
    """The process will also multiply this many rows at once (a server's max_num_seqs): the
    weights laid out from now on are decided over these counts too, and their routes for them
    measured at load, not at the first step that makes them. Above FEW_ROWS a product is one
    flat product: nothing to measure."""
    rows_run.update(M for M in counts if 1 <= M <= FEW_ROWS)


def arrange(w):
    """A weight matrix w (n, in) as the model should hold it here: w itself, or the same values
    laid out column-major where its products of every row count of rows_run (1 and FEW_ROWS,
    and any expect_rows added) are faster in it (timed side by side, once per shape and dtype
    on this machine; see the docstring); a read-only w (a view of the checkpoint's file) is
    copied, once, into the layout taken. Anything else (a quantized weight, a vector, CuPy's
    arrays) is given back as it is; under MT_LAYOUT, w in that layout; under a fixed
    MT_PRODUCTS, in its own."""
    if BACKEND == "cupy" or getattr(w, "ndim", 0) != 2 or not isinstance(w, xp.ndarray):
        return w
    laid = arrange_on_device(w)
    # nothing copied: w itself (under strict, not a new handle on the same data)
    return w if same_on_device(laid, w) else laid


def numpy_arrange(w):
    """arrange on a NumPy array."""
    if FIXED_LAYOUT is not None or FIXED is not None:
        return in_layout(w, FIXED_LAYOUT or layout(w))
    counts = tuple(sorted(rows_run))
    key = (*w.shape, w.dtype.str, counts)
    if key not in laid_out:
        laid_out[key] = recalled_layout(w, counts)
        if laid_out[key] is None:
            laid_out[key], laid = measured_layout(w, counts)
            return laid                                  # the copy timed: not made again
    return in_layout(w, laid_out[key])


def layout_key(w, counts: tuple) -> str:
    """What a measured layout belongs to, as the file spells it: 'layout 3072x576 <f4 rows 1,16'."""
    return f"layout {w.shape[0]}x{w.shape[1]} {w.dtype.str} rows {','.join(map(str, counts))}"


def recalled_layout(w, counts: tuple):
    """The layout the file holds for w's shape and these row counts, with the route of each count
    in that layout (put into `chosen`); None unless the file names a layout and a route for every
    count, each one that blas.py takes there."""
    answer = tuning.recall(layout_key(w, counts))
    if not isinstance(answer, dict) or not isinstance(answer.get("routes"), dict):
        return None
    taken = known(answer.get("layout"), LAYOUTS)
    routes = {M: known(answer["routes"].get(str(M)), candidates(M, taken)) for M in counts}
    if taken is None or None in routes.values():
        return None
    keep_routes(w, taken, routes)
    return taken


def measured_layout(w, counts: tuple) -> tuple:
    """Time w's shape in both layouts (faster_layout), saying so on stderr -> (the layout
    taken, w in it); its routes go into `chosen`, both into the file."""
    rows = ", ".join(map(str, counts))
    tell(f"measuring how this machine multiplies a {w.shape[0]}x{w.shape[1]} {w.dtype} weight "
         f"by {rows} rows, in both layouts")
    pair = {name: in_layout(w, name) for name in LAYOUTS}
    with threads.one_blas_thread():
        taken, routes = faster_layout(pair, counts)
    keep_routes(w, taken, routes)
    tuning.remember(layout_key(w, counts),
                    {"layout": taken, "routes": {str(M): route for M, route in routes.items()}})
    return taken, pair[taken]


def keep_routes(w, taken: str, routes: dict) -> None:
    """{M: route} for w's shape held in layout `taken`, into `chosen`: not measured again."""
    for M, route in routes.items():
        key = (M, *w.shape, taken, w.dtype.str, w.dtype.str)  # (M, n, in, layout, dtypes)
        chosen[key] = route


def in_layout(w, name: str):
    """w, or a copy of it laid out as named. A read-only w is copied in either case: the
    checkpoint's own bytes (loader.py hands a float32 matrix over as a view of the mapped file),
    copied once, straight into the layout the model keeps (a copy row-major first and then
    column-major would touch twice the memory). A column-major copy is made COPY_ROWS rows at a
    time: both sides of a block stay in the cache (one strided copy of a vocabulary's head
    misses it at every read)."""
    if layout(w) == name and w.flags.writeable:
        return w
    if name == "row-major":
        return np.array(w, order="C")
    held = np.empty(w.shape, w.dtype, order="F")
    for r0 in range(0, len(w), COPY_ROWS):
        held[r0:r0 + COPY_ROWS] = w[r0:r0 + COPY_ROWS]
    return held


def faster_layout(pair: dict, counts: tuple = (1, FEW_ROWS)) -> tuple:
    """Time a weight's routes for each row count in both layouts ({layout: w}), side by side ->
    (the layout taken, {M: the route measured fastest for M rows in that layout}): row-major
    unless column-major is the faster at every count."""
    w = pair["row-major"]
    x = np.ones((max(counts), w.shape[1]), w.dtype)
    turns = rings([pair[name] for name in LAYOUTS])
    best = {M: timings(x[:M], turns) for M in counts}                # M -> [{route: seconds}]
    times = {M: [min(t.values()) for t in best[M]] for M in best}
    taken = "column-major" if all(t[1] < t[0] for t in times.values()) else "row-major"
    routes = {M: per_layout[LAYOUTS.index(taken)] for M, per_layout in best.items()}
    return taken, {M: min(routes[M], key=routes[M].get) for M in routes}


def fastest(x, w) -> str:
    """Time the routes for len(x) rows on these operands (TRIALS each, interleaved) -> the
    fastest."""
    routes = timings(x, rings([w]))[0]
    return min(routes, key=routes.get)


def timings(x, turns) -> list:
    """Time the routes for len(x) rows over each matrix of turns (a list per matrix: the copies
    of it that its timings take in turn, `rings`; all of one shape), TRIALS each, interleaved
    -> per matrix, {route: its fastest time}. After PRUNE_AFTER trials, a route more than PRUNE
    times slower than the fastest over its matrix is timed no more: two timings that slow are
    no spike, and it cannot win (a slow route can cost a second a trial). A weight over
    LARGE_BYTES is flushed from the caches before its timings, but not after a timing that
    read all of a weight of FLUSH_BYTES or more: a pass over twice the caches has evicted what
    they held (a vocabulary's head: 30 flushes of FLUSH_BYTES saved).
    """
    w = turns[0][0]
    out = np.empty((len(x), len(w)), np.result_type(x, w))
    calls = {"flat": flat, "rows": rows, "slices": slices, "dots": dots}  # as named now
    best = [dict.fromkeys(candidates(len(x), layout(ring[0])), float("inf")) for ring in turns]
    live = [list(times) for times in best]
    cycles = [itertools.cycle(ring) for ring in turns]
    evicted = False          # the timing before read a whole weight of FLUSH_BYTES or more
    for trial in range(TRIALS):
        for turn, times, routes in zip(cycles, best, live, strict=True):
            for route in routes:
                w = next(turn)
                seconds, whole = timed(calls[route], route, x, w, out, min(times.values()),
                                       flush=w.nbytes > LARGE_BYTES and not evicted)
                times[route] = min(times[route], seconds)
                evicted = whole and w.nbytes >= FLUSH_BYTES
            if trial + 1 >= PRUNE_AFTER:
                routes[:] = [r for r in routes if times[r] <= PRUNE * min(times.values())]
    return best


def timed(call, route: str, x, w, out, limit=float("inf"), flush=False) -> tuple:
    """One call of a route for len(x) rows over w, as `timings` counts it -> (seconds, whether
    it read all of w).

    `rows` and `dots` make M alike passes over w: timed as one pass, times M (on a large
    matrix, such as a vocabulary's head, that keeps the measuring short). `slices`, many
    calls, is made a slice at a time where a limit is set (the fastest time of another route),
    and stopped once it has taken longer: it has lost, and the route taken is the one timing
    it whole would give (a head's 655 small products for 16 rows took seconds on a busy
    machine). A weight of COLD_BYTES or more is timed from memory, as a decode step
    reads it: up to LARGE_BYTES over its copies in turn (`rings`); above, where `flush`,
    after FLUSH_BYTES of other data are read (of the scratch memory)."""
    if flush:
        flush_caches(flush_buffer())
    passes = len(x) if route in ("rows", "dots") else 1
    start, whole = time.perf_counter(), True
    if route != "slices" or limit == float("inf"):
        call(x[:1] if passes > 1 else x, w, out)
    else:
        step = slice_rows(len(x), w.shape[1])
        for r0 in range(0, len(w), step):
            call(x, w[r0:r0 + step], out[:, r0:r0 + step])
            if time.perf_counter() - start > limit:
                whole = False
                break
    return (time.perf_counter() - start) * passes, whole


def rings(ws) -> list:
    """Per matrix of ws (one or two, of one shape), the matrices its timings take in turn: the
    matrix and copies of it in its layout, at least FLUSH_BYTES of them, so that between two
    timings over one of them all the others are timed (a slices stopped early reads only a
    part): each is timed from memory, as a decode step reads its weights, and what is timed is
    the product alone (no flush read between). The
    matrix alone where it is under COLD_BYTES (timed in the cache) or over LARGE_BYTES
    (flushed before each timing: the copies would take too much memory). The copies are made
    in the scratch memory (FLUSH_BYTES + LARGE_BYTES per matrix: as many whole copies as fit,
    at least FLUSH_BYTES of them)."""
    w = ws[0]
    if not COLD_BYTES <= w.nbytes <= LARGE_BYTES:
        return [[w] for w in ws]
    region, size = FLUSH_BYTES + LARGE_BYTES, -(-w.nbytes // 64) * 64     # copies 64-aligned
    room = scratch().view(np.uint8)
    found = []
    for i, w in enumerate(ws):
        ring = [w]
        for start in range(i * region, (i + 1) * region - size + 1, size):
            flat_copy = room[start:start + w.nbytes].view(w.dtype)
            copy = flat_copy.reshape(w.shape) if layout(w) == "row-major" \
                else flat_copy.reshape(w.shape[::-1]).T                 # column-major
            copy[...] = w
            ring.append(copy)
        found.append(ring)
    return found


def scratch():
    """The memory measuring works in: the FLUSH_BYTES read to flush the caches, then room for
    a ring of copies of a weight in each of the two layouts (2 x (FLUSH_BYTES + LARGE_BYTES)
    in all). Allocated when first needed; release() gives it back once a model is built, and
    after a route measured later, at a new count of rows."""
    global room
    if room is None:
        floats = 2 * (FLUSH_BYTES + LARGE_BYTES) // 4
        room = np.frombuffer(small_pages(4 * floats), np.float32)
        room[...] = 1                      # written: every page its own (not the zero page)
    return room


def small_pages(size: int):
    """size bytes of fresh memory, advised against huge pages where the system takes advice:
    memory NumPy allocates is advised to huge pages, whose first touch can cost a virtual
    machine several times the kernel time of the same bytes in 4 KiB pages, while products
    over copies in small pages run at about the same speed, in either layout and every route."""
    memory = mmap.mmap(-1, size)
    if hasattr(memory, "madvise") and hasattr(mmap, "MADV_NOHUGEPAGE"):
        memory.madvise(mmap.MADV_NOHUGEPAGE)
    return memory


def release() -> None:
    """Give back the scratch memory: fused.fuse once a model's weights are laid out,
    measured_route once a route is measured."""
    global room
    room = None


def flush_buffer():
    """The data read to flush the caches: FLUSH_BYTES of the scratch memory."""
    return scratch()[:FLUSH_BYTES // 4]


def flush_caches(buffer):
    """Read a buffer larger than the CPU's caches: what they held before is gone from them."""
    np.dot(buffer, buffer)


def same(a, b) -> bool:
    """Whether a and b are one array."""
    return a is b


def flat(x, w, out=None):
    """One matrix-matrix product with w untransposed: w @ x.T is (n, M), given back transposed
    (a view), or copied into out; for a column-major w, x @ w.T (w.T is row-major)."""
    if w.strides[0] < w.strides[1]:      # column-major (or a part of one: its rows' slice)
        return np.matmul(x, w.T, out=out)                            # (M, n)
    y = (w @ x.T).T                                                  # (M, n)
    if out is None:
        return y
    out[...] = y
    return out


def rows(x, w, out):
    """One matrix-vector product per row of x."""
    for m in range(len(x)):
        np.matmul(w, x[m], out=out[m])
    return out


def slices(x, w, out):
    """x @ w[r0:r1].T for slices of slice_rows(M, in) rows of w."""
    step = slice_rows(len(x), w.shape[1])
    for r0 in range(0, len(w), step):
        np.matmul(x, w[r0:r0 + step].T, out=out[:, r0:r0 + step])
    return out


def dots(x, w, out):
    """One dot product per row of w for each row of x: w[n] . x[m] is out[m, n].

    NumPy's matmul over a stack of (1, in) @ (in, 1) products makes each a BLAS dot product,
    in one call per row of x."""
    for m in range(len(x)):
        np.matmul(w[:, None, :], x[m, :, None], out=out[m, :, None, None])  # (n, 1, 1)
    return out


CALLS = {"flat": flat, "rows": rows, "slices": slices, "dots": dots}

# The slice size: OpenBLAS (x86-64) multiplies without repacking when its small-matrix path
# is permitted, M*N*K <= 10**6 and, for x @ w.T, M*N <= 1200, on the kernels that have one
# (SkylakeX); elsewhere the slices are simply small products, and measured like the rest.
SMALL_PRODUCT, SMALL_OUTPUT = 10 ** 6, 1200


def slice_rows(M: int, cols: int) -> int:
    """Rows of w per call when M rows of `cols` multiply it in slices.

    >>> slice_rows(4, 576), slice_rows(16, 576), slice_rows(16, 4864)
    (300, 75, 12)
    """
    return max(1, min(SMALL_PRODUCT // (M * cols), SMALL_OUTPUT // M))


on_device = numpy_kernel(numpy_multiply)  # strict: NumPy's calls on the data it wraps
arrange_on_device = numpy_kernel(numpy_arrange)
layout_on_device = numpy_kernel(layout)
same_on_device = numpy_kernel(same)  # strict: one array's data behind two handles
