"""What blas.py measured, kept on disk per machine: measured once, remembered.

A learner may skip this module. blas.py times the ways a product can go into BLAS and the two
layouts a weight can be held in, and takes the fastest; the answer depends on the machine, and
timing it takes seconds at every load (a SmolLM2 load: 7.9 s against 1.2 s without). So, as
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
              know is measured again, never used). A file that cannot be read, does not parse
              or is of another format is as good as empty: measured again, never an error

Writing: an answer is added the moment it is measured, under a lock (fcntl, where the system
has it), by reading what the file holds now (another process may have added to it), adding to
it, and replacing the file whole (a temporary file beside it, then os.replace): a reader finds
the old file or the new one, never half of one, and two processes measuring at once each keep
what they measured. A file that cannot be written costs nothing but the measuring next time.

MT_TUNING=remeasure times everything again (and keeps the new answers, over the old);
MT_TUNING=off neither reads nor writes the file: each process measures for itself.
"""
import functools
import json
import os
import platform
import tempfile
from pathlib import Path

import numpy as np

from minitransformer.checks import environment_choice

FORMAT = 1                      # the file's layout; a file of another is measured again
MODES = ("remember", "remeasure", "off")
MODE = environment_choice("MT_TUNING", MODES, "a tuning mode", "to remember") or "remember"


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
    return read(path()).get(machine(), {}).get(key)


def remember(key: str, answer) -> None:
    """Keep an answer for this machine, merged into what the file holds now (see the
    docstring); a file that cannot be written is left as it is."""
    if MODE == "off":
        return
    file, here = path(), machine()
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        with locked(file):
            machines = read(file)
            machines.setdefault(here, {})[key] = answer
            write(file, {"format": FORMAT, "machines": machines})
    except OSError:
        pass                    # read-only home, full disk: measured again next time


def read(file: Path) -> dict:
    """{machine: {key: answer}} from the file; {} for a file that is missing, unreadable, not
    JSON, of another format or of another shape."""
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("format") != FORMAT \
            or not isinstance(data.get("machines"), dict):
        return {}
    return {name: entries for name, entries in data["machines"].items()
            if isinstance(entries, dict)}


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
    file; where there is no fcntl, no lock (os.replace still keeps the file whole)."""

    def __init__(self, file: Path):
        self.lock = file.with_name(file.name + ".lock")

    def __enter__(self):
        self.fd = os.open(self.lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            import fcntl
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        except ImportError:
            pass
        return self

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
    fields = {}
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
