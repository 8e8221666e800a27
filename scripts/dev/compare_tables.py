"""Two runs of the main job, table by table: what differs once the timings are masked.

    python3 scripts/run_all.py --report OLD      (in one tree, then --report NEW in the other)
    python3 scripts/dev/compare_tables.py OLD NEW

OLD and NEW are folders `scripts/run_all.py --report DIR` wrote (DIR itself or DIR/tables: one
JSON file per script, each table with its raw rows, its header lines and its notes). A change
that is meant to leave behaviour alone must leave every table the same but for what the
machine decides: the times and what is worked out from them. So each table is compared cell by
cell and line by line, and a difference is set apart only where it is one of these:

    timing    a cell in a timed column: its name says a time or a rate (TIMED: ms, s, med,
              tokens/s, TTFT, a measured speedup or gain ...), or the script's TIMED_COLUMNS
              name it (a ratio of two times, a simulation fed with measured step costs, a
              draft length chosen on measured costs); a header or note line that reads the
              same with every number masked and names a time, a rate or the load
              (TIMED_LINE), or belongs to a table whose figures are timed
    rounding  two floats within ROUNDING of each other (relative): the same sums in another
              order (a product's route into BLAS is measured per machine and process,
              kernels/blas.py; docs/serving.md, "Exactness"), counted and the largest shown
    memory    a peak tracemalloc measured (MEMORY's columns) within MEMORY_SHARE: it counts
              the Python objects alive at the peak too, whose bytes move from run to run and
              with any change to the code (what a product's first call measures and keeps,
              the tuning file read), counted and the largest shown

Everything else that differs is printed, cell or line, old against new; a table or a script on
one side only is named. One line per table on stdout, the differences under it; the exit
status is 1 when anything but timings differs. Nothing is run: the runs are the caller's
(docs/testing.md, "Tables unchanged", says how they were made).
"""
import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: _common

from _common import run

# A column whose name says a time or a rate, or a speedup measured from times
TIMED = re.compile(r"(^|\s)(ms|s|med)($|\s)|ms\b|/s\b|s/token|\btime\b|meas\.|gain|latency|"
                   r"vs B=1|vs prev|vs first|wall|CPU s")
# Columns timed by what they are worked out from, though their names do not say so: a set of
# names, ALL, or (ALL, the columns that are not)
ALL = "all"
TIMED_COLUMNS = {
    "exp02_attention_scaling": {"ratio"},                       # recompute ms / cached ms
    "exp13_batching_sim": ALL,        # simulated on the step costs experiment 12 measured
    "exp13_engine": {"steps", "preempted"},  # arrivals on the measured clock: who shares a step
    # gamma is the best predicted speedup on measured pass costs; alpha is counted at it
    "exp22_speculative": (ALL, {"draft", "c bytes", "same", "streams"}),
    "run_all": (ALL, {"script", "status", "BLAS threads"}),     # the job's own wall and CPU
}
ROUNDING = 1e-5     # floats this close (relative) differ by the order of their sums
# Columns of bytes tracemalloc measured, Python objects included, and how far they may move
MEMORY = {"exp02_attention_scaling": {"peak recompute B", "peak cached B", "peak tiled B"},
          "exp04_cache_memory": {"peak beyond weights", "bytes"},
          "exp15_weight_memory": {"allocator B"}}
MEMORY_SHARE = 0.05
# A header or note line that differs only in its numbers, and speaks of these, is a timing
TIMED_LINE = re.compile(r"\bms\b|\d s\b|seconds|tokens/s|req/s|speedup|faster|slower|"
                        r"fastest|median|throughput|latency|load average|wall|CPU|took|"
                        r"first use|\d+(\.\d+)?x\b")
# A line a script writes when the machine was too busy to conclude, or to warn of a timing:
# what it says, and not only its numbers, follows the load
NOISY = re.compile(r"not concluded, the machine was too noisy|WARNING: |still flagged")
NUMBER = re.compile(r"[-+]?\d[\d,]*(\.\d+)?(e[-+]?\d+)?")


def tables_of(folder: Path) -> dict:
    """{script: [table, ...]} from a report folder (DIR or DIR/tables)."""
    where = folder / "tables" if (folder / "tables").is_dir() else folder
    found = {p.stem: json.loads(p.read_text()) for p in sorted(where.glob("*.json"))}
    if not found:
        raise ValueError(f"{folder}: no tables (*.json) in it or in its tables/ (run_all.py "
                         "--report DIR writes them)")
    return found


def timed_column(script: str, name: str) -> bool:
    """Whether a column holds timings (or what is worked out from them).

    >>> timed_column("exp06_prefill_cost", "ms per token"), timed_column("exp03_macs", "ratio")
    (True, False)
    >>> timed_column("exp02_attention_scaling", "ratio"), timed_column("exp08", "B/token")
    (True, False)
    """
    extra = TIMED_COLUMNS.get(script, ())
    if extra == ALL or isinstance(extra, tuple) and extra and name not in extra[1]:
        return True
    return name in extra or bool(TIMED.search(name))


def timed_line(script: str, old: str, new: str) -> bool:
    """Whether two header or note lines differ only in the numbers of a timing.

    >>> timed_line("exp01_kv_cache", "speedup: 14.4x", "speedup: 9.9x")
    True
    >>> timed_line("exp01_kv_cache", "tokens identical: 48 of 48", "tokens identical: 47 of 48")
    False
    >>> timed_line("exp05", "ratio 15x", "the ratio: not concluded, the machine was too noisy")
    True
    """
    if script == "run_all":         # the job's summary: what it cost, what was there before
        return True
    if NOISY.search(old) or NOISY.search(new):
        return True
    timed_table = TIMED_COLUMNS.get(script) == ALL or isinstance(TIMED_COLUMNS.get(script), tuple)
    return NUMBER.sub("#", old) == NUMBER.sub("#", new) and (
        bool(TIMED_LINE.search(old)) or timed_table)


def numbers_apart(old: str, new: str) -> float:
    """How far apart the numbers of two lines alike but for them are, at most (relative; inf
    when the words differ).

    >>> numbers_apart("peak 1,000 B of 20 B", "peak 1,010 B of 20 B")
    0.009900990099009901
    """
    if NUMBER.sub("#", old) != NUMBER.sub("#", new):
        return float("inf")
    numbers = [[float(m.group().replace(",", "")) for m in NUMBER.finditer(line)]
               for line in (old, new)]
    return max((relative(a, b) for a, b in zip(*numbers, strict=True)), default=0.0)


def relative(x, y) -> float:
    """|x - y| over the larger of the two (inf unless both are numbers).

    >>> relative(646964, 648100) < MEMORY_SHARE, relative(1, "1")
    (True, inf)
    """
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (x, y)):
        return float("inf")
    return abs(x - y) / max(abs(x), abs(y)) if x != y else 0.0


def rounding(x, y) -> float:
    """How far apart two floats are, relative (0 when equal; inf for anything else).

    >>> rounding(67.592113711355, 67.59211415520241) < ROUNDING, rounding(1, 2), rounding("a", "b")
    (True, inf, inf)
    """
    if x == y:
        return 0.0
    if not all(isinstance(v, float) for v in (x, y)):
        return float("inf")
    return abs(x - y) / max(abs(x), abs(y))


def paired(old: list, new: list) -> tuple:
    """Two tables' rows paired -> ([(old row, new row)], [(side, a row of one side only)]): by
    their first cell where it is a name, one per row on both sides (a row added keeps the
    others paired), else in order.

    >>> paired([["a", 1], ["c", 3]], [["a", 1], ["b", 2], ["c", 4]])
    ([(['a', 1], ['a', 1]), (['c', 3], ['c', 4])], [('new', ['b', 2])])
    """
    keys = [[row[0] if row else None for row in rows] for rows in (old, new)]
    if not all(len(set(k)) == len(k) and all(isinstance(c, str) for c in k) for k in keys):
        extra = [("old", r) for r in old[len(new):]] + [("new", r) for r in new[len(old):]]
        return list(zip(old, new, strict=False)), extra       # the rest in `extra`
    mine = dict(zip(keys[1], new, strict=True))
    pairs = [(row, mine[k]) for k, row in zip(keys[0], old, strict=True) if k in mine]
    lone = [("old", row) for k, row in zip(keys[0], old, strict=True) if k not in mine] + \
        [("new", row) for k, row in zip(keys[1], new, strict=True) if k not in set(keys[0])]
    return pairs, lone


def differences(script: str, old: dict, new: dict) -> tuple:
    """(how many timings differ, [relative distance of each rounding], [relative distance of
    each tracemalloc peak], [(where, old, new)] of everything else) between two tables of one
    script."""
    masked, rounded, peaks, other = 0, [], [], []
    if old["title"] != new["title"] and not timed_line(script, old["title"], new["title"]):
        other.append(("title", old["title"], new["title"]))
    if old["columns"] != new["columns"]:
        other.append(("columns", old["columns"], new["columns"]))
    pairs, lone = paired(old["rows"], new["rows"])
    other += [("a row only in the old run", row, "-") if side == "old" else
              ("a row only in the new run", "-", row) for side, row in lone]
    for i, (a, b) in enumerate(pairs):
        for j, (x, y) in enumerate(zip(a, b, strict=False)):  # other columns: said above
            name = new["columns"][j] if j < len(new["columns"]) else str(j)
            if x == y:
                continue
            if timed_column(script, name):
                masked += 1
            elif rounding(x, y) <= ROUNDING:
                rounded.append(rounding(x, y))
            elif name in MEMORY.get(script, ()) and relative(x, y) <= MEMORY_SHARE:
                peaks.append(relative(x, y))
            else:
                other.append((f"row {i + 1} ({a[0]}), column {name!r}", x, y))
    for part in ("header", "notes"):
        a, b = old.get(part) or [], new.get(part) or []
        if len(a) != len(b):            # lines added: the warnings of a busy machine, or not
            if any(NOISY.search(line) for line in a + b):
                masked += 1
            else:
                other.append((part, "\n".join(a), "\n".join(b)))
            continue
        for x, y in zip(a, b, strict=True):
            if x != y:
                if timed_line(script, x, y):
                    masked += 1
                elif script in MEMORY and numbers_apart(x, y) <= MEMORY_SHARE:
                    peaks.append(numbers_apart(x, y))     # a peak said again in words
                else:
                    other.append((part, x, y))
    for part in ("chapter", "differs"):
        if old.get(part) != new.get(part):
            other.append((part, old.get(part), new.get(part)))
    return masked, rounded, peaks, other


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("old", type=Path, help="the first run's report folder")
    parser.add_argument("new", type=Path, help="the second run's report folder")
    parser.add_argument("--markdown", metavar="FILE", help="also write the lines to FILE, "
                        "under a heading naming the two runs (docs/tables-unchanged.md)")
    args = parser.parse_args(argv)
    old, new = tables_of(args.old), tables_of(args.new)
    lines, differ = [], 0
    for script in sorted(old.keys() | new.keys()):
        if script not in old or script not in new:
            lines.append(f"{script}: only in {'the new' if script in new else 'the old'} run")
            differ += 1
            continue
        if len(old[script]) != len(new[script]):
            lines.append(f"{script}: {len(old[script])} tables, now {len(new[script])}")
            differ += 1
        for a, b in zip(old[script], new[script], strict=False):     # a count apart: said
            masked, rounded, peaks, other = differences(script, a, b)
            lines.append(f"{script}: {b['title'].splitlines()[0][:70]}: "
                         f"{verdict(masked, rounded, peaks, other)}")
            lines += [f"    {where}:\n      old: {x}\n      new: {y}" for where, x, y in other]
            differ += bool(other)
    print("\n".join(lines))
    if args.markdown:
        Path(args.markdown).write_text(
            f"# Tables unchanged: {args.old.name} against {args.new.name}\n\n"
            f"Written by `python3 scripts/dev/compare_tables.py {args.old} {args.new} "
            f"--markdown {args.markdown}`; do not edit by hand, run it again. What is set "
            "apart and why: the script's docstring; how the runs were made: docs/testing.md, "
            "\"Tables unchanged\".\n\n```\n" + "\n".join(lines) + "\n```\n")
    return 1 if differ else 0


def verdict(masked: int, rounded: list, peaks: list, other: list) -> str:
    """'same', or 'DIFFERS in N places', and what was set apart.

    >>> verdict(3, [1e-7], [], [])
    'same but for 3 timings and 1 rounding (at most 1.0e-07)'
    >>> verdict(0, [], [0.01], [("row 1", 1, 2)])
    'DIFFERS in 1 place but for 1 tracemalloc peak (at most 1.0% apart)'
    """
    apart = [f"{masked} timing{'s' if masked != 1 else ''}"] if masked else []
    if rounded:
        apart.append(f"{len(rounded)} rounding{'s' if len(rounded) != 1 else ''} "
                     f"(at most {max(rounded):.1e})")
    if peaks:
        apart.append(f"{len(peaks)} tracemalloc peak{'s' if len(peaks) != 1 else ''} "
                     f"(at most {max(peaks):.1%} apart)")
    said = f"DIFFERS in {len(other)} place{'s' if len(other) != 1 else ''}" if other else "same"
    return said + (f" but for {' and '.join(apart)}" if apart else "")


if __name__ == "__main__":
    run(main)
