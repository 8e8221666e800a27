"""What blas.py measured, kept on disk per machine (kernels/tuning.py): read back instead of
measured again; filed under the machine, so another CPU, BLAS, kernel or thread count measures
for itself; what the file holds is checked before it is taken, so a wrong or corrupt entry is
measured again and never makes a wrong product; written whole, by several processes at once."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from minitransformer.backend import to_device, to_numpy
from minitransformer.kernels import blas, tuning

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def file(monkeypatch, tmp_path):
    """A tuning file of the test's own (not there yet), nothing in this process's memory."""
    path = tmp_path / "cache" / "tuning.json"
    monkeypatch.setenv("MT_TUNING_CACHE", str(path))
    monkeypatch.setattr(tuning, "MODE", "remember")
    monkeypatch.setattr(tuning, "read_once", {})
    monkeypatch.setattr(tuning, "said", set())
    for name, value in (("chosen", {}), ("laid_out", {}), ("FIXED", None),
                        ("FIXED_LAYOUT", None), ("rows_run", {1, blas.FEW_ROWS})):
        monkeypatch.setattr(blas, name, value)
    return path


@pytest.fixture
def timed(monkeypatch):
    """The measurements blas.py makes, counted (timings() calls); the real ones run."""
    calls, measure = [], blas.timings
    monkeypatch.setattr(blas, "timings", lambda x, ws, *a: calls.append(len(x)) or
                        measure(x, ws, *a))
    return calls


def operands(M, n=70, cols=24):
    rng = np.random.default_rng(M)
    return (rng.standard_normal((M, cols)).astype(np.float32),
            rng.standard_normal((n, cols)).astype(np.float32))


def arranged(w) -> np.ndarray:
    """blas.arrange(w) on this backend, back on the host in the layout it took (to_numpy
    copies row-major under the strict backend, as cupy.asnumpy does)."""
    laid = blas.arrange(to_device(w))
    return blas.in_layout(to_numpy(laid), blas.layout_on_device(laid))


def entries(path) -> dict:
    """This machine's entries in the file."""
    return json.loads(path.read_text())["machines"][tuning.machine()]


def plant(path, machine_entries: dict, format=tuning.FORMAT):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"format": format, "machines": machine_entries}))


def test_the_default_file_is_in_the_user_s_cache_folder(monkeypatch, tmp_path):
    monkeypatch.delenv("MT_TUNING_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert tuning.path() == tmp_path / "minitransformer" / "blas-tuning.json"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert tuning.path() == Path.home() / ".cache" / "minitransformer" / "blas-tuning.json"
    monkeypatch.setenv("MT_TUNING_CACHE", str(tmp_path / "mine.json"))
    assert tuning.path() == tmp_path / "mine.json"


def test_a_layout_and_a_way_measured_once_are_read_back_not_measured(file, timed):
    x, w = operands(3)
    laid = arranged(w)
    route = blas.route_for(x, laid)
    assert sorted(timed) == [1, 3, blas.FEW_ROWS]           # the layout's counts, then 3 rows
    held = blas.layout(laid)
    kept = entries(file)
    assert kept[f"layout 70x24 <f4 rows 1,{blas.FEW_ROWS}"]["layout"] == held
    assert kept[f"route 3 70x24 {held} <f4 <f4"] == route
    blas.chosen.clear()
    blas.laid_out.clear()                                    # as a new process starts
    tuning.read_once.clear()
    timed.clear()
    again = arranged(w)
    assert blas.layout(again) == held and blas.route_for(x, again) == route and timed == []


def test_the_machine_names_numpys_blas_only(monkeypatch):
    """SciPy's own OpenBLAS, loaded beside NumPy's once scipy is imported, is not NumPy's: the
    machine's name (and so its answers) stays the same; a NumPy on the system's BLAS (no
    library of its own) is named by every BLAS loaded."""
    import threadpoolctl
    numpy_dir = Path(np.__file__).resolve().parent
    ours = {"user_api": "blas", "internal_api": "openblas", "version": "0.3.31",
            "architecture": "Haswell", "num_threads": 1,
            "filepath": str(numpy_dir.with_name("numpy.libs") / "libscipy_openblas64_.so")}
    scipys = ours | {"version": "0.3.30", "filepath": str(numpy_dir.with_name("scipy.libs")
                                                           / "libscipy_openblas.so")}
    system = ours | {"filepath": "/usr/lib/x86_64-linux-gnu/libopenblas.so.0"}
    names = []
    for loaded in ([ours], [scipys, ours], [ours, scipys], [system]):
        monkeypatch.setattr(threadpoolctl, "threadpool_info", lambda: loaded)
        names.append(tuning.machine())
    assert names[0] == names[1] == names[2] and "0.3.30" not in names[1]
    assert names[3] == names[0]          # the same version, kernel and threads: the same name
    monkeypatch.setattr(threadpoolctl, "threadpool_info", lambda: [system, scipys])
    assert "0.3.30" in tuning.machine()  # neither NumPy's own: both named


def test_another_machine_s_entries_are_not_taken(file, timed, monkeypatch):
    """The file keeps each machine's answers apart: the same shape on another CPU, BLAS
    version, kernel or thread count is measured again."""
    x, w = operands(3)
    blas.route_for(x, w)
    here = tuning.machine()
    pools = [{"internal_api": "openblas", "version": "0.3.31", "architecture": "Haswell",
              "num_threads": 2}]
    monkeypatch.setattr(tuning, "blas_pools", lambda: pools)
    elsewhere = {tuning.machine()}
    for field, value in (("architecture", "SkylakeX"), ("version", "0.3.30"),
                         ("num_threads", 1), ("internal_api", "mkl")):
        monkeypatch.setattr(tuning, "blas_pools", lambda: [pools[0] | {field: value}])
        elsewhere.add(tuning.machine())
    monkeypatch.setattr(tuning, "cpu", lambda: {"model": "Another CPU", "avx512": True})
    elsewhere.add(tuning.machine())
    assert here not in elsewhere and len(elsewhere) == 6
    blas.chosen.clear()
    timed.clear()
    blas.route_for(x, w)                                           # under "Another CPU"
    assert timed == [3]
    assert set(json.loads(file.read_text())["machines"]) == {here, tuning.machine()}


@pytest.mark.parametrize("route", blas.ROUTES)
def test_a_product_through_a_planted_way_is_the_product_of_the_way_it_names(file, timed,
                                                                           route):
    """An entry naming a route blas.py takes there is taken as it is, unmeasured: its product is
    that route's, bit for bit (not another route's: their sums run in other orders)."""
    x, w = operands(4)
    plant(file, {tuning.machine(): {"route 4 70x24 row-major <f4 <f4": route}})
    y = to_numpy(blas.multiply(to_device(x), to_device(w)))
    assert timed == [] and blas.route_for(x, w) == route
    assert np.array_equal(y, blas.CALLS[route](x, w, np.empty((4, 70), np.float32)))


@pytest.mark.parametrize("entry", ["warp", "FLAT", "dots ", None, 3, ["flat"], {"route": "flat"}])
def test_a_way_the_file_names_wrongly_is_measured_again(file, timed, entry):
    x, w = operands(4)
    key = "route 4 70x24 row-major <f4 <f4"
    plant(file, {tuning.machine(): {key: entry}})
    y = to_numpy(blas.multiply(to_device(x), to_device(w)))
    assert timed == [4]
    route = blas.route_for(x, w)
    assert route in blas.ROUTES and entries(file)[key] == route       # written over
    assert np.array_equal(y, blas.CALLS[route](x, w, np.empty((4, 70), np.float32)))


def test_dots_over_a_column_major_weight_is_not_taken_from_the_file(file, timed):
    """dots is never measured over strided rows: an entry naming it there is wrong."""
    x, w = operands(4)
    w = np.asfortranarray(w)
    plant(file, {tuning.machine(): {"route 4 70x24 column-major <f4 <f4": "dots"}})
    assert blas.route_for(x, w) in blas.candidates(4, "column-major") and timed == [4]


LAYOUT = f"layout 70x24 <f4 rows 1,{blas.FEW_ROWS}"
GOOD = {"layout": "column-major", "routes": {"1": "slices", str(blas.FEW_ROWS): "rows"}}


@pytest.mark.parametrize("entry", [
    GOOD | {"layout": "diagonal"}, GOOD | {"layout": None}, {"layout": "row-major"},
    GOOD | {"routes": {"1": "slices"}},                                   # a count missing
    GOOD | {"routes": {"1": "rows", str(blas.FEW_ROWS): "rows"}},        # rows is flat for 1
    GOOD | {"routes": {"1": "dots", str(blas.FEW_ROWS): "rows"}},        # no dots column-major
    GOOD | {"routes": ["slices", "rows"]}, "column-major", None])
def test_a_layout_the_file_holds_wrongly_is_measured_again(file, timed, entry):
    _, w = operands(1)
    plant(file, {tuning.machine(): {LAYOUT: entry}})
    laid = arranged(w)
    assert sorted(timed) == [1, blas.FEW_ROWS] and np.array_equal(laid, w)
    assert entries(file)[LAYOUT]["layout"] == blas.layout(laid)


def test_a_good_layout_entry_is_taken_with_its_ways(file, timed):
    x, w = operands(blas.FEW_ROWS)
    plant(file, {tuning.machine(): {LAYOUT: GOOD}})
    laid = arranged(w)
    assert blas.layout(laid) == "column-major" and timed == []
    assert np.array_equal(laid, w)
    assert blas.route_for(x[:1], laid) == "slices"
    assert blas.route_for(x, laid) == "rows" and timed == []


@pytest.mark.parametrize("text", ["", "{", "\x00\xff garbage", "[]", '{"format": 1}',
                                  '{"format": 1, "machines": []}',
                                  '{"format": 1, "machines": {"m": 3}}'])
def test_a_malformed_file_is_measured_again_and_replaced(file, timed, text):
    file.parent.mkdir(parents=True)
    file.write_text(text)
    x, w = operands(2)
    route = blas.route_for(x, w)
    assert timed == [2] and entries(file) == {"route 2 70x24 row-major <f4 <f4": route}


@pytest.mark.parametrize("format, key", [
    (1, "way 2 70x24 row-major <f4 <f4"),               # format 1 spelled a route 'way'
    (tuning.FORMAT + 1, "route 2 70x24 row-major <f4 <f4")])
def test_a_file_of_another_format_is_stale(file, timed, format, key):
    """An older file (or a newer one) is measured again and replaced in this format."""
    x, w = operands(2)
    plant(file, {tuning.machine(): {key: "flat"}}, format=format)
    route = blas.route_for(x, w)
    assert timed == [2] and json.loads(file.read_text())["format"] == tuning.FORMAT
    assert entries(file) == {"route 2 70x24 row-major <f4 <f4": route}


def test_a_file_that_cannot_be_written_is_no_error(file, timed, monkeypatch, tmp_path):
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("MT_TUNING_CACHE", str(tmp_path / "a-file" / "tuning.json"))
    x, w = operands(2)
    assert blas.route_for(x, w) in blas.ROUTES and timed == [2]


def test_remeasure_measures_again_and_off_leaves_the_file_alone(file, timed, monkeypatch):
    x, w = operands(2)
    key = "route 2 70x24 row-major <f4 <f4"
    plant(file, {tuning.machine(): {key: "planted"}})      # no route: only remeasure replaces it
    monkeypatch.setattr(tuning, "MODE", "off")
    blas.route_for(x, w)
    assert timed == [2] and entries(file) == {key: "planted"}
    monkeypatch.setattr(tuning, "MODE", "remeasure")
    plant(file, {tuning.machine(): {key: "rows"}})
    blas.chosen.clear()
    route = blas.route_for(x, w)
    assert timed == [2, 2] and entries(file) == {key: route}


def test_an_unknown_tuning_mode_is_refused_at_import():
    done = subprocess.run([sys.executable, "-c", "import minitransformer.kernels.tuning"],
                          capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, MT_TUNING="forget"))
    assert done.returncode != 0
    assert "MT_TUNING='forget' is not a tuning mode: use one of remember, remeasure, off, or " \
        "leave it unset to remember" in done.stderr


WRITER = """
import sys
from minitransformer.kernels import tuning
for i in range(40):
    tuning.remember(f"route {sys.argv[1]}-{i}", "flat")
"""


def test_processes_writing_at_once_keep_every_answer_and_a_whole_file(file):
    """Four processes add 40 answers each, at once, while this one reads the file over and
    over: every read parses (a reader sees a whole file, old or new), and the end holds all
    160 answers (each writer merged what the others had written)."""
    env = dict(os.environ, MT_TUNING_CACHE=str(file), PYTHONPATH=str(ROOT))
    writers = [subprocess.Popen([sys.executable, "-c", WRITER, str(k)], env=env)
               for k in range(4)]
    reads = 0
    while any(p.poll() is None for p in writers):
        if file.exists():
            assert isinstance(json.loads(file.read_text())["machines"], dict)
            reads += 1
    assert [p.wait() for p in writers] == [0] * 4 and reads > 0
    # the writers' machine, as they named it (this process may run another BLAS thread count)
    (kept,) = json.loads(file.read_text())["machines"].values()
    assert sorted(kept) == sorted(f"route {k}-{i}" for k in range(4) for i in range(40))
    assert not [p for p in file.parent.iterdir() if p.suffix == ".tmp"]


def test_a_load_that_measures_says_so_on_stderr_and_one_that_reads_says_nothing(
        file, capsys):
    _, w = operands(1)
    blas.arrange(to_device(w))
    lines = capsys.readouterr().err.splitlines()
    assert lines == [f"measuring how this machine multiplies a 70x24 float32 weight by 1, "
                     f"{blas.FEW_ROWS} rows, in both layouts",
                     f"kept in {file}: what this machine measured, read back at the next load"]
    blas.laid_out.clear()
    blas.arrange(to_device(w))
    assert capsys.readouterr().err == ""


def test_an_answer_kept_quietly_is_kept_and_said_nowhere(file, capsys):
    """blas.measured_split keeps its answer mid-step: written to the file as any other, no
    line on stderr (it would land among a chat's tokens); the next loud answer says where."""
    assert tuning.remember("split 1 8x8 row-major <f4 <f4 flat 2", 2, quiet=True)
    assert json.loads(file.read_text())["machines"][tuning.machine()] == {
        "split 1 8x8 row-major <f4 <f4 flat 2": 2}
    assert capsys.readouterr().err == ""
    assert tuning.remember("route 1-0", "flat")
    assert capsys.readouterr().err == (f"kept in {file}: what this machine measured, read back "
                                       "at the next load\n")


def test_a_server_asks_for_its_slots_rows_before_it_loads(monkeypatch, file):
    """serve measures the products of max_num_seqs rows (its full decode step) at load, with
    the layouts decided over them too; a batch-invariant server multiplies one row at a time."""
    pytest.importorskip("uvicorn")
    import minitransformer as mt
    from minitransformer.serve.config import EngineConfig
    from minitransformer.serve.http import serve

    class Loaded(Exception):
        pass

    def load(path):
        raise Loaded(sorted(blas.rows_run))
    monkeypatch.setattr(mt, "load", load)
    with pytest.raises(Loaded, match=r"\[1, 5, 16\]"):
        serve("some/model", EngineConfig(max_num_seqs=5), port=0)
    monkeypatch.setattr(blas, "rows_run", {1, blas.FEW_ROWS})
    with pytest.raises(Loaded, match=r"\[1, 16\]"):
        serve("some/model", EngineConfig(max_num_seqs=5, batch_invariant=True), port=0)


# The file is input from outside (issue 48): read once, within bounds, never blocking; the
# lock waited for a bounded time; what is said about keeping true.

ROUTE_KEY = "route 4 70x24 row-major <f4 <f4"


def test_the_file_is_read_once_per_process(file, timed, monkeypatch):
    """A load looks up every weight's layout and every row count's route: the file is read at
    the first lookup only (it was read and parsed at each, 8 times a load); what this process
    measures after that is kept in memory too (the file is read again only to merge into it,
    under its lock)."""
    reads, read = [], tuning.text
    monkeypatch.setattr(tuning, "text", lambda f: reads.append(f) or read(f))
    shapes = [(70, 24), (24, 70), (33, 24)]
    plant(file, {tuning.machine(): {
        **{f"layout {n}x{k} <f4 rows 1,{blas.FEW_ROWS}": GOOD for n, k in shapes},
        **{f"route {M} {n}x{k} column-major <f4 <f4": "rows" for n, k in shapes for M in (2, 3)}}})
    for n, k in shapes:
        laid = arranged(np.ones((n, k), np.float32))
        for M in (1, 2, 3, blas.FEW_ROWS):
            blas.route_for(np.ones((M, k), np.float32), laid)
    assert reads == [file] and timed == []
    blas.route_for(np.ones((5, 24), np.float32), laid)                    # measured, then kept
    blas.chosen.clear()
    timed.clear()
    reads.clear()
    blas.route_for(np.ones((5, 24), np.float32), laid)                   # known, not read again
    assert timed == [] and reads == []


def plant_text(file, text: str):
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_text(text)


def good_file(**more) -> dict:
    return {"format": tuning.FORMAT, "machines": {tuning.machine(): {ROUTE_KEY: "rows"}}, **more}


def nested(levels: int):
    value = "rows"
    for _ in range(levels):
        value = [value]
    return value


def test_a_file_over_the_size_limit_is_refused_unread(file, timed):
    """A file of more than MAX_BYTES is not read (a 20 MB one added 16 s to a load): its
    products are measured; one at the limit is read."""
    text = json.dumps(good_file())
    plant_text(file, text + " " * (tuning.MAX_BYTES - len(text)))
    x, w = operands(4)
    assert blas.route_for(x, w) == "rows" and timed == []
    plant_text(file, text + " " * (tuning.MAX_BYTES + 1 - len(text)))
    tuning.read_once.clear()
    blas.chosen.clear()
    with pytest.raises(tuning.Refused, match=f"larger than {tuning.MAX_BYTES} bytes"):
        tuning.text(file)
    assert blas.route_for(x, w) in blas.ROUTES and timed == [4]


@pytest.mark.parametrize("levels", [tuning.MAX_DEPTH - 3, tuning.MAX_DEPTH - 2, 990, 5000,
                                    100_000])
def test_a_file_nested_too_deep_is_refused_before_it_is_parsed(file, timed, levels):
    """JSON nested beyond MAX_DEPTH (the format nests 5 deep) is refused without parsing it
    (json's parser recurses per level: 5,000 deep was a RecursionError out of the load); an
    answer nested within the limit is only a wrong answer, measured again, the rest taken."""
    text = json.dumps(good_file())
    plant_text(file, text[:-2] + ', "another machine": {"route 1": ' + "[" * levels + '"rows"'
               + "]" * levels + "}}}")
    within = 3 + levels <= tuning.MAX_DEPTH                # format, machines, entries, lists
    if not within:
        with pytest.raises(tuning.Refused, match=f"nested deeper than {tuning.MAX_DEPTH}"):
            tuning.parse(file.read_text())
    x, w = operands(4)
    route = blas.route_for(x, w)
    assert (route, timed) == ("rows", []) if within else route in blas.ROUTES and timed == [4]


def special_files(tmp_path) -> dict:
    fifo = tmp_path / "a-fifo"
    os.mkfifo(fifo)
    links = {"a symlink to a FIFO": fifo, "a symlink to /dev/zero": Path("/dev/zero")}
    for name, target in links.items():
        (tmp_path / name.replace(" ", "-").replace("/", "")).symlink_to(target)
    return {"a FIFO": fifo, "/dev/zero": Path("/dev/zero"),
            "/dev/urandom": Path("/dev/urandom"), "a folder": tmp_path,
            **{name: tmp_path / name.replace(" ", "-").replace("/", "") for name in links}}


def finishes(call, seconds=10):
    """call(), in a thread: -> its result, or fail where it is still running after seconds (a
    read of a FIFO or a device that blocks), instead of holding the test run."""
    import threading
    done = []

    def run():
        try:
            done.append((call(), None))
        except BaseException as e:           # raised again below, in the test
            done.append((None, e))
    thread = threading.Thread(target=run, daemon=True)   # a blocked one never holds the exit
    thread.start()
    thread.join(seconds)
    assert done, f"still running after {seconds} s"
    result, error = done[0]
    if error is not None:
        raise error
    return result


SPECIAL = ["a FIFO", "/dev/zero", "/dev/urandom", "a folder", "a symlink to a FIFO",
           "a symlink to /dev/zero"]


@pytest.mark.parametrize("name", SPECIAL)
def test_a_special_file_is_refused_without_blocking_and_never_written(file, timed, tmp_path,
                                                                      monkeypatch, capsys,
                                                                      name):
    """MT_TUNING_CACHE naming a FIFO, a device or a folder (or a symlink to one): not opened
    for reading (a FIFO hung the load, /dev/zero was a MemoryError, /dev/urandom read
    forever), never locked or replaced by a file (the guards below fail the test before a
    broken check could touch /dev), and said once."""
    def guard(*args):
        raise AssertionError(f"{name}: locked or written")
    monkeypatch.setattr(tuning, "locked", guard)
    monkeypatch.setattr(tuning, "write", guard)
    special = special_files(tmp_path)[name]
    monkeypatch.setenv("MT_TUNING_CACHE", str(special))
    with pytest.raises(tuning.Refused, match="not a regular file"):
        finishes(lambda: tuning.text(special))
    x, w = operands(4)
    assert finishes(lambda: blas.route_for(x, w)) in blas.ROUTES and timed == [4]
    assert capsys.readouterr().err.splitlines() == [
        f"not kept in {special} ({tuning.kind(os.stat(special).st_mode)}, not a regular "
        "file): what this machine measured is measured again at the next load "
        "(MT_TUNING_CACHE=FILE keeps it elsewhere)"]


def test_a_fifo_swapped_in_after_the_check_is_opened_without_blocking(tmp_path, monkeypatch):
    """Between stat and open the file may change: it is opened non-blocking, and what was
    opened is asked again (a FIFO opened for reading blocks until a writer comes)."""
    fifo = special_files(tmp_path)["a FIFO"]
    regular = os.stat(__file__)
    stats = os.stat
    monkeypatch.setattr(tuning.os, "stat", lambda f, **k: regular if f == fifo else
                        stats(f, **k))                    # as if a regular file, at the check
    with pytest.raises(tuning.Refused, match="not a regular file"):
        finishes(lambda: tuning.text(fifo))


def test_a_symlink_to_a_regular_file_is_read_and_its_target_written(file, timed, tmp_path,
                                                                    monkeypatch):
    target = tmp_path / "real.json"
    plant_text(target, json.dumps(good_file()))
    link = tmp_path / "link.json"
    link.symlink_to(target)
    monkeypatch.setenv("MT_TUNING_CACHE", str(link))
    x, w = operands(4)
    assert blas.route_for(x, w) == "rows" and timed == []
    blas.route_for(*operands(2))
    assert link.is_symlink() and sorted(entries(target)) == [
        "route 2 70x24 row-major <f4 <f4", ROUTE_KEY]


def test_a_lock_held_too_long_is_given_up_the_answer_measured_and_not_written(
        file, timed, monkeypatch, capsys):
    """Another process holding the lock (stopped, hung): waited LOCK_SECONDS, then the answer
    is used, not written, and that is said (the wait was forever)."""
    import fcntl
    monkeypatch.setattr(tuning, "LOCK_SECONDS", 0.2)
    plant_text(file, json.dumps(good_file()))
    lock = os.open(file.with_name(file.name + ".lock"), os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)     # another open file: flock excludes it as a process
        x, w = operands(2)
        route = finishes(lambda: blas.route_for(x, w))
    finally:
        os.close(lock)
    assert route in blas.ROUTES and timed == [2] and entries(file) == {ROUTE_KEY: "rows"}
    assert capsys.readouterr().err.splitlines() == [
        f"not kept in {file} (its lock {file}.lock held by another process for over 0.2 s): "
        "what this machine measured is measured again at the next load "
        "(MT_TUNING_CACHE=FILE keeps it elsewhere)"]
    blas.chosen.clear()
    tuning.read_once.clear()                                # as the next process
    timed.clear()
    blas.route_for(x, w)                                          # the lock free: kept, and said
    assert timed == [2] and sorted(entries(file)) == ["route 2 70x24 row-major <f4 <f4", ROUTE_KEY]
    assert capsys.readouterr().err.splitlines() == [
        f"kept in {file}: what this machine measured, read back at the next load"]


def test_kept_in_is_said_only_where_it_was_kept(file, monkeypatch, tmp_path, capsys):
    """A load that measures and cannot write the file says so, and never that it kept it."""
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("MT_TUNING_CACHE", str(tmp_path / "a-file" / "tuning.json"))
    blas.arrange(to_device(operands(1)[1]))
    err = capsys.readouterr().err
    assert "kept in" not in err.replace("not kept in", "")
    assert f"not kept in {tmp_path / 'a-file' / 'tuning.json'} (File exists: {tmp_path / 'a-file'})" in err


POISONS = {
    "another machine's junk": lambda d: d["machines"].update(
        {"junk": {"route 1": {"layout": [None, {"x": -1}]}}, "more": 3, "": []}),
    "junk keys beside the entry": lambda d: d["machines"][tuning.machine()].update(
        {"route 4 70x24 column-major <f4 <f4": "dots", "route x": nested(4), "": None,
         "layout 70x24 <f4 rows 1": {"layout": "diagonal"}}),
    "unknown fields": lambda d: d.update({"extra": {"a": [1, 2.5e308]}, "format ": 2}),
    "a long string": lambda d: d["machines"].update({"x" * (tuning.MAX_BYTES // 2): {}}),
}


@pytest.mark.parametrize("route", blas.ROUTES)
@pytest.mark.parametrize("poison", sorted(POISONS))
def test_a_poisoned_file_never_changes_the_bits_of_the_route_the_clean_file_names(
        file, timed, poison, route):
    """The clean file names a route for a shape; the same file with junk beside it (within the
    limits) gives that route's product, bit for bit, unmeasured."""
    data = good_file()
    data["machines"][tuning.machine()][ROUTE_KEY] = route
    POISONS[poison](data)
    plant_text(file, json.dumps(data))
    x, w = operands(4)
    y = to_numpy(blas.multiply(to_device(x), to_device(w)))
    assert timed == [] and blas.route_for(x, w) == route
    assert np.array_equal(y, blas.CALLS[route](x, w, np.empty((4, 70), np.float32)))


@pytest.mark.parametrize("poison", ["over the size limit", "nested too deep", "a FIFO"])
def test_a_refused_file_gives_the_product_of_the_way_measured(file, timed, tmp_path,
                                                              monkeypatch, poison):
    """A file refused whole (too large, too deep, not a regular file) is as good as empty: the
    route is measured, and the product is that route's, bit for bit."""
    data = good_file()
    if poison == "over the size limit":
        plant_text(file, json.dumps(data) + " " * tuning.MAX_BYTES)
    elif poison == "nested too deep":
        data["machines"]["x"] = {"y": nested(tuning.MAX_DEPTH - 2)}
        plant_text(file, json.dumps(data))
    else:
        monkeypatch.setenv("MT_TUNING_CACHE", str(special_files(tmp_path)["a FIFO"]))
    x, w = operands(4)
    y = to_numpy(finishes(lambda: blas.multiply(to_device(x), to_device(w))))
    route = blas.route_for(x, w)
    assert timed == [4]
    assert np.array_equal(y, blas.CALLS[route](x, w, np.empty((4, 70), np.float32)))
