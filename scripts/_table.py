"""The one way every experiment prints its table: aligned plain text on stdout, the same table
recorded as data.

A ``Table`` is a title, header lines (what was measured, on what machine, with how many BLAS
threads), columns with a format each, rows of raw values, and notes under it. ``show()`` prints
it, then the chapter's figure for that experiment and one line on why ours differs (from
``_chapter.py``). When the environment variable ``MT_TABLES`` names a directory (``run_all.py``
sets it unless --no-report), ``show()`` also appends the table, raw numbers and all, to
``MT_TABLES/<script>.json``, which the report turns into HTML tables and plots. A plot is
declared on the table from its own columns (``plot()``), so a plot shows only numbers the table
shows.

A warning given with a row (a sanity check that still fired after re-measuring) is printed
beside that row, on stdout, where the reader looks.
"""
import json
import os
import sys
from pathlib import Path

from _chapter import CHAPTER, RANDOM_WEIGHTS, TRAINED

RECORD_ENV = "MT_TABLES"


class Table:
    """One table of one experiment; see the module docstring."""

    def __init__(self, title, experiment=None, columns=(), chapter=True, differs=None):
        """chapter: end with the chapter's lines (once per experiment, on its main table);
        differs: why ours differs, where this script's reason is not the experiment's."""
        self.title, self.experiment, self.chapter = title, experiment, chapter
        self.differs = differs
        self.headers, self.notes, self.rows, self.warnings, self.plots = [], [], [], {}, []
        self.columns = [c if isinstance(c, tuple) else (c, "") for c in columns]

    def header(self, *lines):
        """Lines printed under the title: what the numbers are, the machine, the threads."""
        self.headers.extend(line for line in lines if line)
        return self

    def random_weights(self, model):
        """Say in the header that quality figures are meaningless when the model is random;
        on a trained model, give the reason why ours differs that speaks of trained weights."""
        if is_random(model):
            self.header(RANDOM_WEIGHTS)
        elif self.experiment in TRAINED and self.differs is None:
            self.differs = TRAINED[self.experiment]
        return self

    def row(self, *values, warning=None):
        if self.columns and len(values) != len(self.columns):
            raise ValueError(f"{self.title}: row of {len(values)} values for "
                             f"{len(self.columns)} columns")
        if warning:
            self.warnings[len(self.rows)] = warning
        self.rows.append(list(values))
        return self

    def note(self, *lines):
        """Lines printed under the table: the comparison, the conclusion."""
        self.notes.extend(line for line in lines if line is not None)
        return self

    def plot(self, x, ys, title, *, xlabel, ylabel, kind="line", logx=False, logy=False,
             hline=None, chapter=()):
        """Declare a plot of columns ``ys`` against column ``x`` for the report.
        xlabel, ylabel: the axes' labels, units included ('batch size B (sequences)',
        'step latency (ms)').
        hline: (label, value), a level drawn across; the value must be printed in the header
        or the notes (the report draws nothing the table does not show).
        chapter: the chapter's comparable figures, [(x, y, as printed), ...], drawn as markers
        labelled "chapter"; 'as printed' must be in the chapter's line under the table."""
        names = [name for name, _ in self.columns]
        for column in [x, *ys]:
            if column not in names:
                raise ValueError(f"{self.title}: plot of unknown column {column!r}")
        if not xlabel or not ylabel:
            raise ValueError(f"{self.title}: a plot needs both axis labels, with units")
        if hline and not any(f"{hline[1]:,}" in line or str(hline[1]) in line
                             for line in self.headers + self.notes):
            raise ValueError(f"{self.title}: the level {hline[1]} is not printed with the table")
        said = " ".join(self.chapter_lines())
        for _, _, printed in chapter:
            if printed not in said:
                raise ValueError(f"{self.title}: the chapter's {printed!r} is not printed "
                                 "with the table")
        self.plots.append({"x": x, "ys": list(ys), "title": title, "kind": kind,
                           "xlabel": xlabel, "ylabel": ylabel, "logx": logx, "logy": logy,
                           "hline": hline, "chapter": [list(point) for point in chapter]})
        return self

    def text(self) -> str:
        lines = [self.title, *self.headers]
        if self.columns:
            cells = [[cell(v, fmt) for v, (_, fmt) in zip(r, self.columns, strict=True)]
                     for r in self.rows]
            widths = [max([len(name), *(len(c[i]) for c in cells)])
                      for i, (name, _) in enumerate(self.columns)]
            left = [all(isinstance(r[i], str) for r in self.rows) and bool(self.rows)
                    for i in range(len(self.columns))]
            lines += ["", line([name for name, _ in self.columns], widths, left)]
            for i, row in enumerate(cells):
                warning = f"   <- WARNING: {self.warnings[i]}" if i in self.warnings else ""
                lines.append(line(row, widths, left) + warning)
        ending = [*self.notes, *self.chapter_lines()]
        return "\n".join(lines + ([""] + ending if ending else []))

    def markdown(self) -> str:
        """The same table as Markdown (a heading, the header lines, a pipe table, the notes),
        for a script's --markdown file: figures in the documentation written by the script."""
        lines = [f"### {self.title}", "", *(f"{h}  " for h in self.headers)]
        if self.columns:
            cells = [[cell(v, fmt) for v, (_, fmt) in zip(r, self.columns, strict=True)]
                     for r in self.rows]
            left = [all(isinstance(r[i], str) for r in self.rows) and bool(self.rows)
                    for i in range(len(self.columns))]
            lines += ["", "| " + " | ".join(name for name, _ in self.columns) + " |",
                      "|" + "|".join(":---" if lf else "---:" for lf in left) + "|"]
            for i, row in enumerate(cells):
                warning = f" WARNING: {self.warnings[i]}" if i in self.warnings else ""
                lines.append("| " + " | ".join(row) + " |" + warning)
        ending = [*self.notes, *self.chapter_lines()]
        return "\n".join(lines + ([""] + [f"{n}  " for n in ending] if ending else [])) + "\n"

    def show(self):
        """Print on stdout (and record, when MT_TABLES is set)."""
        print(self.text(), flush=True)
        print(flush=True)
        if os.environ.get(RECORD_ENV):
            self.record(Path(os.environ[RECORD_ENV]))
        return self

    def chapter_lines(self):
        """() or (the chapter's figures, why ours differ), as printed."""
        lines = CHAPTER.get(self.experiment) if self.chapter else None
        if not lines:
            return ()
        return lines[0], f"why ours differs: {self.differs}" if self.differs else lines[1]

    def data(self) -> dict:
        chapter = self.chapter_lines() or ("", "")
        return {"script": Path(sys.argv[0]).stem, "experiment": self.experiment,
                "title": self.title, "header": self.headers,
                "columns": [name for name, _ in self.columns],
                "rows": [[plain(v) for v in r] for r in self.rows],
                "cells": [[cell(v, fmt) for v, (_, fmt) in zip(r, self.columns, strict=True)]
                          for r in self.rows],
                "warnings": {str(i): w for i, w in self.warnings.items()},
                "notes": self.notes, "chapter": chapter[0], "differs": chapter[1],
                "plots": self.plots, "text": self.text()}

    def record(self, directory: Path):
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"{Path(sys.argv[0]).stem}.json"
        tables = json.loads(path.read_text()) if path.is_file() else []
        tables.append(self.data())
        path.write_text(json.dumps(tables, indent=1))


def cell(value, fmt) -> str:
    if value is None:
        return ""
    if callable(fmt):
        return fmt(value)
    return format(value, fmt)


def line(cells, widths, left) -> str:
    return "  ".join(c.ljust(w) if lf else c.rjust(w)
                     for c, w, lf in zip(cells, widths, left, strict=True)).rstrip()


def plain(value):
    """A JSON-ready value: numpy scalars become Python numbers."""
    return value.item() if hasattr(value, "item") else value


def is_random(model) -> bool:
    """True for the embedded default model (random weights, made by code)."""
    from minitransformer.checkpoints.synth import default_model
    path = getattr(model, "path", model)
    try:
        return Path(path).resolve() == Path(default_model()).resolve()
    except (OSError, TypeError):
        return False
