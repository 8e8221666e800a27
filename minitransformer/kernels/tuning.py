"""What blas.py measured, kept on disk per machine: measured once, remembered.

A learner may skip this module. blas.py times the routes a product can take into BLAS and the two
layouts a weight can be held in, and takes the fastest; the answer depends on the machine, and
timing it takes seconds at every load, several times the load itself (scripts/dev/bench_load.py
times a load with the file, without it and with it empty, side by side). So, as
FFTW keeps its "wisdom" and Triton its autotuning cache, the answers are kept in a small JSON
file and read back at the next load: only what the file lacks is timed.

    file      $MT_TUNING_CACHE, else $XDG_CACHE_HOME/minitransformer/blas-tuning.json
              (~/.cache/minitransformer/blas-tuning.json where XDG_CACHE_HOME is unset)
    machine   the answers are filed under what decides them (`machine()`): the CPU's model,
              each BLAS library's name, version, kernel and thread count (as threadpoolctl
              reports them) and NumPy's version. Another CPU, a new OpenBLAS, a kernel forced by
              OPENBLAS_CORETYPE or another thread count finds nothing of its own, and measures
    entries   under the machine, one key per thing measured (blas.py spells the keys and checks
              every answer against the names it knows before taking it: a name it does not
              know is measured again, never used)

Reading: the file is data from outside, so it is read as such, once per process (the first
lookup reads it; every later one, and every answer measured here, is in memory). It is refused,
as good as empty (its products measured again, never an error), when it is not a regular file
(a FIFO, a device, a symlink to one: found by stat before it is opened, and opened without
blocking), holds more than MAX_BYTES, nests deeper than MAX_DEPTH (the format nests 5 deep;
the check runs before the parser, whose recursion would otherwise end the process's patience
first), does not parse, or is of another format.

Writing: an answer is added the moment it is measured, under a lock (fcntl, where the system
has it), by reading what the file holds now (another process may have added to it), adding to
it, and replacing the file whole (a temporary file beside it, then os.replace): a reader finds
the old file or the new one, never half of one, and two processes measuring at once each keep
what they measured. The lock is waited for LOCK_SECONDS at most: a process that holds it longer
(stopped, or hung) costs this one only the keeping. What is not kept (the lock not had, a file
that is not a regular file, a folder that cannot be written) costs nothing but the measuring
next time, and is said once, on stderr, as is where the answers were kept.

MT_TUNING=remeasure times everything again (and keeps the new answers, over the old);
MT_TUNING=off neither reads nor writes the file: each process measures for itself.
"""
import functools
import json
import os
import platform
import re
import stat
import tempfile
import time
from pathlib import Path

import numpy as np

from minitransformer.checks import environment_choice
from minitransformer.progress import tell

FORMAT = 2                      # the file's layout; a file of another is measured again
                                # (format 1 spelled blas.py's routes 'way')
MODES = ("remember", "remeasure", "off")
MODE = environment_choice("MT_TUNING", MODES, "a tuning mode", "to remember") or "remember"
MAX_BYTES = 1 << 20             # a larger file is refused (a machine's answers: a few KB)
MAX_DEPTH = 8                   # deeper nesting is refused (the format nests 5 deep)
LOCK_SECONDS = 5.0              # the longest wait for another process's lock (held for ms)

read_once: dict = {}            # {file: {machine: {key: answer}}}: what this process knows
said: set[str] = set()          # the lines about keeping already said in this process


class Refused(ValueError):
    """A tuning file not read (too large, too deep, not a regular file) or not written (its
    lock held too long, not a regular file); the message says which and why."""


def path() -> Path:
    """The file: $MT_TUNING_CACHE, else the user's cache folder (read when asked: a test or a
    CI job may point it elsewhere)."""
    if os.environ.get("MT_TUNING_CACHE"):
        return Path(os.environ["MT_TUNING_CACHE"]).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "minitransformer" / "blas-tuning.json"


def recall(key: str):
    """What this machine measured under key, as it was written (None: nothing, or not looked
    at under MT_TUNING). The caller checks it: the file is data, not trusted."""
    if MODE != "remember":
        return None
    return known(path()).get(machine(), {}).get(key)


def known(file: Path) -> dict:
    """{machine: {key: answer}}: the file as read at this process's first lookup (read), with
    what this process has kept in it since."""
    if str(file) not in read_once:
        read_once[str(file)] = read(file)
    return read_once[str(file)]


def remember(key: str, answer, quiet: bool = False) -> bool:
    """Keep an answer for this machine, merged into what the file holds now (see the
    docstring) -> whether it was kept. Where it was kept is said once (unless quiet: an answer
    measured in the middle of a step, whose line would land in the middle of an answer on a
    person's screen); why not, always once."""
    if MODE == "off":
        return False
    file, here = path(), machine()
    known(file).setdefault(here, {})[key] = answer          # this process knows it either way
    try:
        target = keep(file, here, key, answer)
    except (OSError, Refused) as e:
        why = f"{e.strerror}: {e.filename}" if isinstance(e, OSError) and e.filename else e
        say_once(f"not kept in {file} ({why}): what this machine measured is measured again "
                 f"at the next load (MT_TUNING_CACHE=FILE keeps it elsewhere)")
        return False
    if not quiet:
        say_once(f"kept in {target}: what this machine measured, read back at the next load")
    return True


def keep(file: Path, here: str, key: str, answer) -> Path:
    """Add {key: answer} under machine `here` to the file, under its lock -> the file written
    (a symlink's target: the link stays). Raises Refused or OSError where it cannot."""
    target = Path(os.path.realpath(file))
    if target.exists() and not stat.S_ISREG(mode := target.stat().st_mode):
        raise Refused(f"{kind(mode)}, not a regular file")
    target.parent.mkdir(parents=True, exist_ok=True)
    with locked(target):
        machines = read(target)
        machines.setdefault(here, {})[key] = answer
        write(target, {"format": FORMAT, "machines": machines})
    return target


def say_once(line: str) -> None:
    if line not in said:
        said.add(line)
        tell(line)


def read(file: Path) -> dict:
    """{machine: {key: answer}} from the file; {} for a file that is missing, unreadable,
    refused (see the docstring), not JSON, of another format or of another shape."""
    try:
        data = parse(text(file))
    except (OSError, ValueError):                # Refused and UnicodeDecodeError among them
        return {}
    if not isinstance(data, dict) or data.get("format") != FORMAT \
            or not isinstance(data.get("machines"), dict):
        return {}
    return {name: entries for name, entries in data["machines"].items()
            if isinstance(entries, dict)}


def text(file: Path) -> str:
    """The file's text, at most MAX_BYTES of it; Refused for what is not a regular file (asked
    before opening it, and of what was opened: opened without blocking, so a FIFO swapped in
    between cannot hold the process)."""
    mode = os.stat(file).st_mode                  # of what a symlink points to
    if not stat.S_ISREG(mode):
        raise Refused(f"{file}: {kind(mode)}, not a regular file")
    with os.fdopen(os.open(file, os.O_RDONLY | os.O_NONBLOCK), "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise Refused(f"{file}: not a regular file")
        data = f.read(MAX_BYTES + 1)
    if len(data) > MAX_BYTES:
        raise Refused(f"{file}: larger than {MAX_BYTES} bytes")
    return data.decode("utf-8")


def kind(mode: int) -> str:
    """What a file's stat mode says it is, in words: 'a FIFO', 'a character device', ..."""
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISDIR, "a folder")):
        if test(mode):
            return name
    return "not a regular file"


STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)   # a JSON string, escapes and all


def parse(text: str):
    """JSON text -> its value; Refused where it nests deeper than MAX_DEPTH (checked first:
    json's parser recurses once per level)."""
    if depth(text) > MAX_DEPTH:
        raise Refused(f"nested deeper than {MAX_DEPTH}")
    return json.loads(text)


def depth(text: str) -> int:
    """How deep JSON text nests its arrays and objects (brackets inside strings not counted).

    >>> depth('{"a": [1, {"b": "[[["}]}'), depth('[' * 5000), depth('3')
    (3, 5000, 0)
    """
    brackets = np.frombuffer(STRING.sub("", text).encode(), np.uint8)
    steps = np.isin(brackets, tuple(b"[{")).astype(np.int64) - np.isin(brackets, tuple(b"]}"))
    return int(np.cumsum(steps).max(initial=0))


def write(file: Path, data: dict) -> None:
    """Replace the file whole: written beside it under another name, then renamed over it."""
    fd, temporary = tempfile.mkstemp(dir=file.parent, prefix=file.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(temporary, file)
    except BaseException:
        os.unlink(temporary)
        raise


class locked:
    """Hold an exclusive lock on file + '.lock' (fcntl.flock) while reading and replacing the
    file, waited for LOCK_SECONDS at most (then Refused: not written); where there is no fcntl,
    no lock (os.replace still keeps the file whole). The lock file is never followed through a
    symlink and must be a regular file."""

    def __init__(self, file: Path, seconds: float | None = None):
        self.lock = file.with_name(file.name + ".lock")
        self.seconds = LOCK_SECONDS if seconds is None else seconds

    def __enter__(self):
        self.fd = os.open(self.lock, os.O_RDWR | os.O_CREAT | os.O_NONBLOCK | os.O_NOFOLLOW,
                          0o644)
        try:
            if not stat.S_ISREG(os.fstat(self.fd).st_mode):
                raise Refused(f"its lock {self.lock} is not a regular file")
            self.take()
        except BaseException:
            os.close(self.fd)
            raise
        return self

    def take(self) -> None:
        try:
            import fcntl
        except ImportError:
            return
        deadline = time.monotonic() + self.seconds
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise Refused(f"its lock {self.lock} held by another process for over "
                                  f"{self.seconds:g} s") from None
                time.sleep(0.01)

    def __exit__(self, *exc):
        os.close(self.fd)       # closing releases the lock


def machine() -> str:
    """What decides the answers, in one line: the CPU, each BLAS (library, version, kernel,
    threads: read now, a script may have changed the count) and NumPy's version."""
    pools = [f"{p['internal_api']} {p.get('version') or '?'} kernel "
             f"{p.get('architecture') or '?'} threads {p['num_threads']}" for p in blas_pools()]
    return f"{cpu()['model']} | {'; '.join(pools) or 'no BLAS'} | numpy {np.__version__}"


@functools.cache
def cpu() -> dict:
    """{"model": the CPU's name, "avx512": True, False or None (unknown)}, read from Linux's
    /proc/cpuinfo (elsewhere: the platform's name for the processor, AVX-512 unknown)."""
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
    except OSError:
        return {"model": platform.processor() or platform.machine() or "unknown",
                "avx512": None}
    fields: dict[str, str] = {}
    for line in info.splitlines():               # "model name\t: ...", the first CPU's
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    model = " ".join(fields.get("model name", "").split())
    flags = fields.get("flags", "").split()
    return {"model": model or platform.machine() or "unknown",
            "avx512": ("avx512f" in flags) if flags else None}


def cache_bytes(folder=Path("/sys/devices/system/cpu/cpu0/cache")):
    """The bytes of cache one core reads through: its data and unified caches, every level,
    summed, as Linux describes them (None where it does not: another system, a container
    that hides them).

    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as d:
    ...     for i, (kind, size) in enumerate([("Data", "32K"), ("Instruction", "32K"),
    ...                                       ("Unified", "512K"), ("Unified", "32M")]):
    ...         (Path(d) / f"index{i}").mkdir()
    ...         _ = (Path(d) / f"index{i}" / "type").write_text(kind)
    ...         _ = (Path(d) / f"index{i}" / "size").write_text(size)
    ...     cache_bytes(Path(d)) == (32 + 512 + 32 * 1024) * 1024
    True
    """
    total = 0
    for index in sorted(folder.glob("index*")):
        try:
            kind, size = ((index / name).read_text().strip() for name in ("type", "size"))
            if kind != "Instruction":
                total += int(size.rstrip("KMG")) << {"K": 10, "M": 20, "G": 30}.get(size[-1], 0)
        except (OSError, ValueError):
            return None
    return total or None


def blas_pools() -> list:
    """The BLAS libraries NumPy's products run on, as threadpoolctl reports them: dicts with
    internal_api (openblas, mkl, ...), version, architecture (OpenBLAS's kernel, e.g.
    SkylakeX or Haswell: chosen per CPU, or forced by OPENBLAS_CORETYPE), num_threads.

    Only NumPy's own where it ships one: SciPy loads an OpenBLAS of its own when imported, which
    NumPy's products never call (counted, the same machine would file its answers under two
    names, before and after an import of scipy). A NumPy built on the system's BLAS ships none:
    then every BLAS loaded."""
    from threadpoolctl import threadpool_info
    pools = [p for p in threadpool_info() if p["user_api"] == "blas"]
    return [p for p in pools if numpy_ships(p.get("filepath") or "")] or pools


def numpy_ships(library: str) -> bool:
    """Whether a loaded library's file is one NumPy's wheel ships (in numpy/ or numpy.libs/)."""
    numpy_dir = Path(np.__file__).resolve().parent
    folders = (numpy_dir, numpy_dir.with_name("numpy.libs"))
    return any(Path(library).resolve().is_relative_to(folder) for folder in folders)
