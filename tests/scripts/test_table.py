"""The scripts' table helper: aligned text, warnings beside their rows, the chapter's lines, the
same table recorded as JSON; progress lines with a count and an estimate of what is left."""
import json

import pytest

from _chapter import CHAPTER, FIGURES
from _common import Progress
from _table import Table


def small_table():
    t = Table("Experiment 12: a title", experiment=12,
              columns=[("B", "d"), ("step ms", ".1f"), ("label", "")])
    t.header("machine: somewhere")
    t.row(1, 10.0, "one")
    t.row(16, 26.75, "sixteen", warning="batch 16 is odd")
    t.note("a note")
    return t


def test_text_is_aligned_with_the_warning_beside_its_row_and_the_chapter_last():
    lines = small_table().text().splitlines()
    assert lines[:3] == ["Experiment 12: a title", "machine: somewhere", ""]
    assert lines[3:6] == [" B  step ms  label",
                          " 1     10.0  one",
                          "16     26.8  sixteen   <- WARNING: batch 16 is odd"]
    assert lines[6:] == ["", "a note", *CHAPTER[12]]


def test_every_experiment_has_the_chapter_figure_and_a_reason():
    assert sorted(FIGURES) == list(range(1, 25))
    assert all(figures and why for figures, why in FIGURES.values())


def test_recorded_as_data(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MT_TABLES", str(tmp_path))
    t = small_table()
    t.plot("B", ["step ms"], "step against batch", xlabel="batch size B",
           ylabel="step (ms)")
    t.show()
    Table("second", columns=[("x", "d")]).row(3).show()
    assert "Experiment 12: a title" in capsys.readouterr().out
    (path,) = tmp_path.glob("*.json")
    first, second = json.loads(path.read_text())
    assert first["rows"] == [[1, 10.0, "one"], [16, 26.75, "sixteen"]]
    assert first["cells"][1] == ["16", "26.8", "sixteen"]
    assert first["warnings"] == {"1": "batch 16 is odd"}
    assert first["chapter"] == CHAPTER[12][0] and first["plots"][0]["ys"] == ["step ms"]
    assert second["rows"] == [[3]] and second["chapter"] == ""


def test_mistakes_are_caught_where_they_are_made():
    t = small_table()
    with pytest.raises(ValueError, match="unknown column 'tokens/s'"):
        t.plot("B", ["tokens/s"], "x", xlabel="B", ylabel="tokens/s")
    with pytest.raises(ValueError, match="2 values for 3 columns"):
        t.row(1, 2.0)


def test_progress_counts_and_estimates_what_is_left(capsys, monkeypatch):
    ticks = iter([0.0, 10.0, 20.0])
    monkeypatch.setattr("_common.time.perf_counter", lambda: next(ticks))
    p = Progress(4, "runs", cost=lambda i: i)      # unit i costs i: 1 + 2 + 3 + 4
    p("first")                                      # 10 s for cost 1: 9 more units -> 90 s
    p("second")                                     # 20 s for cost 3: 7 more -> 46.7 s
    assert capsys.readouterr().err.splitlines() == [
        "[1/4] runs: first (10 s, about 90 s left)",
        "[2/4] runs: second (20 s, about 47 s left)"]


def test_progress_never_counts_past_its_own_total(capsys, monkeypatch):
    monkeypatch.setattr("_common.time.perf_counter", lambda: 0.0)
    p = Progress(2, "runs", more=2)                 # a re-measurement adds a round of 2
    for name in ("a", "b", "c"):
        p(name)
    lines = capsys.readouterr().err.splitlines()
    assert [line.split("]")[0] for line in lines] == ["[1/2", "[2/2", "[3/4"]
    assert lines[2].endswith("; 2 more: measuring again, the machine was busy")
