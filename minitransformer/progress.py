"""What the library says while it works: one line on stderr, for a wait a user would notice.

Tables and results are the scripts' (stdout, and their own progress on stderr); the library
itself says only what it is doing where that takes seconds: loading a checkpoint (loader.py),
measuring this machine's products once (kernels/blas.py). No line goes to stdout, so a table
piped into a file stays clean.
"""
import sys


def tell(line: str) -> None:
    """Write one line of progress on stderr, at once (flushed: a pipe would hold it back)."""
    print(line, file=sys.stderr, flush=True)
