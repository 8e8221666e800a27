"""The main job's list and its report: every experiment script is in the job; the report page
holds every recorded table, the chapter's lines, and the declared plots (with matplotlib), axes
labelled and the chapter's figures marked; no path of this machine leaks into it; a real
headless browser renders it at a wide and a narrow width (skipped when no Chromium is
installed, except under CI, where .ci/run installs it and its absence is a failure)."""
import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import _report
from _table import Table

import run_all

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def test_the_main_job_runs_every_experiment_script():
    listed = {script for script, _, _ in run_all.MAIN_JOB}
    assert listed == {p.name for p in SCRIPTS.glob("exp[0-9][0-9]_*.py")}
    # the chapter's model rows of experiments 9 and 10
    assert ("exp09_users_tokens.py", set(), ["--chapter-model"]) in run_all.MAIN_JOB
    assert ("exp10_mha_gqa_mqa.py", set(), ["--chapter-model"]) in run_all.MAIN_JOB


def test_the_main_job_passes_model_and_threads_to_every_script_that_takes_them():
    for script, takes, extra in run_all.MAIN_JOB:
        if "--chapter-model" in extra:
            continue  # the chapter's shapes: no checkpoint to pass
        text = (SCRIPTS / script).read_text()
        assert (run_all.MODEL in takes) == ("add_model_argument(" in text), script
        assert (run_all.THREADS in takes) == ("add_threads_argument(" in text), script


def test_model_and_threads_go_only_where_they_are_taken():
    args = argparse.Namespace(model="m", threads=1)
    assert run_all.command("exp11_7b_context.py", set(), [], args, "x")[2:] == []
    assert run_all.command("exp12_batched_decode.py", {run_all.MODEL, run_all.THREADS},
                           ["--save-step-costs", "{step_costs}"], args, "c.json")[2:] == [
        "--model", "m", "--threads", "1", "--save-step-costs", "c.json"]
    args.model = None  # no --model: each script's own default model
    assert run_all.command("exp01_kv_cache.py", {run_all.MODEL}, [], args, "x")[2:] == []


def recorded(directory, monkeypatch):
    """Two scripts' tables recorded as run_all --report records them."""
    monkeypatch.setenv("MT_TABLES", str(directory / "tables"))
    for script in ("exp12_batched_decode", "exp02_attention_scaling"):
        monkeypatch.setattr(sys, "argv", [f"{script}.py"])
        number = int(script[3:5])
        t = Table(f"Experiment {number}: a table & more", experiment=number,
                  columns=[("B", "d"), ("step ms", ".1f"), ("tokens/s", ".1f")])
        for B, ms in ((1, 10.0), (2, 12.0), (4, 30.0), (8, 58.0)):
            t.row(B, ms, B / ms * 1e3, warning="odd row" if B == 4 else None)
        t.plot("B", ["tokens/s"], "throughput against batch size",
               xlabel="batch size B (sequences)", ylabel="throughput (tokens/s)",
               chapter=[(16, 6.0, "x6.0")] if number == 12 else ())
        t.show()


def test_report_has_every_table_and_json(tmp_path, monkeypatch, capsys):
    recorded(tmp_path, monkeypatch)
    monkeypatch.setattr(_report, "matplotlib_or_none", lambda: None)
    page = _report.write_report(tmp_path, "report").read_text()
    tables = json.loads((tmp_path / "tables.json").read_text())
    assert [t["experiment"] for t in tables] == [2, 12]          # in the chapter's order
    assert page.count("<table>") == 2 and "Experiment 2: a table &amp; more" in page
    assert "WARNING: odd row" in page and "chapter: " in page and "why ours differs" in page
    assert "pip install -e '.[report]'" in page and "data:image/png" not in page


def test_report_plots_with_matplotlib(tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    recorded(tmp_path, monkeypatch)
    page = _report.write_report(tmp_path, "report").read_text()
    assert page.count("data:image/png;base64,") == 2


def test_a_plot_needs_labelled_axes_and_printed_chapter_figures(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["exp12_batched_decode.py"])
    t = Table("Experiment 12", experiment=12, columns=[("B", "d"), ("tokens/s", ".1f")])
    with pytest.raises(ValueError, match="axis labels"):
        t.plot("B", ["tokens/s"], "throughput", xlabel="", ylabel="throughput (tokens/s)")
    with pytest.raises(ValueError, match="not printed"):     # x7.5 is no figure of the chapter
        t.plot("B", ["tokens/s"], "throughput", xlabel="B", ylabel="tokens/s",
               chapter=[(16, 7.5, "x7.5")])
    t.plot("B", ["tokens/s"], "throughput", xlabel="B", ylabel="tokens/s",
           chapter=[(16, 6.0, "x6.0")])
    assert t.data()["plots"][0]["chapter"] == [[16, 6.0, "x6.0"]]


def test_every_plot_of_the_main_job_names_its_axes_with_units():
    """Each script's plot() calls carry both labels (checked when declared), and a unit."""
    import re
    for script, _, _ in run_all.MAIN_JOB:
        text = (SCRIPTS / script).read_text()
        for call in re.findall(r"\.plot\((.*?)\)\n", text, re.S):
            assert "xlabel=" in call and "ylabel=" in call, (script, call)
            y = re.search(r'ylabel="([^"]*)"', call).group(1)
            assert "(" in y, (script, y)     # the unit, or what the figure is relative to


def test_the_chapter_is_drawn_on_the_plots_and_axes_labelled(tmp_path, monkeypatch, capsys):
    plt = pytest.importorskip("matplotlib.pyplot")
    recorded(tmp_path, monkeypatch)
    drawn = {}
    real = plt.subplots

    def spying(*args, **kwargs):
        fig, ax = real(*args, **kwargs)
        drawn[len(drawn)] = ax
        return fig, ax
    monkeypatch.setattr(plt, "subplots", spying)
    monkeypatch.setattr(plt, "close", lambda fig: None)
    _report.write_report(tmp_path, "report")
    axes = list(drawn.values())
    assert [ax.get_xlabel() for ax in axes] == ["batch size B (sequences)"] * 2
    assert [ax.get_ylabel() for ax in axes] == ["throughput (tokens/s)"] * 2
    legends = [[t.get_text() for t in ax.get_legend().get_texts()] for ax in axes]
    assert legends == [["tokens/s"], ["tokens/s", "chapter"]]     # experiment 2, then 12


def test_the_report_of_a_real_run_names_no_path_of_this_machine(tmp_path, checkpoint_dir):
    """run_all --report on real scripts: no temporary folder, no checkout or weights path in
    the page or the tables (a model by its folder name, a file by its role). The model is a
    tiny one in a temporary folder (the default model's step costs take a minute to time)."""
    out, model = tmp_path / "report", checkpoint_dir("qwen2-gqa-tied-bf16")
    done = subprocess.run([sys.executable, str(SCRIPTS / "run_all.py"), "--model", str(model),
                           "--only", "exp1[25]_|exp13_batching", "--report", str(out)],
                          capture_output=True, text=True, timeout=600,
                          env=os.environ | {"TMPDIR": str(tmp_path)})
    assert done.returncode == 0, done.stderr[-2000:]
    for name in ("index.html", "tables.json"):
        text = (out / name).read_text()
        for path in (str(tmp_path), str(SCRIPTS.parent), os.environ.get("MT_WEIGHTS_DIR"),
                     "/tmp/", str(Path.home())):
            assert not path or path not in text, (name, path)
    page = (out / "index.html").read_text()
    assert "Experiment 15: weights in memory (qwen2-gqa-tied-bf16)" in page
    assert "STEP_COSTS.json" in page and "step-cost file step_costs.json" in page


def browser():
    return next((b for b in ("chromium", "chromium-browser", "google-chrome")
                 if shutil.which(b)), None)


def screenshot(page, shot, width, height):
    subprocess.run([browser(), "--headless", "--no-sandbox", "--disable-gpu",
                    "--hide-scrollbars", f"--window-size={width},{height}",
                    f"--screenshot={shot}", page.as_uri()], check=True, capture_output=True,
                   timeout=120)


def test_a_real_browser_renders_the_page(tmp_path, monkeypatch, capsys):
    if browser() is None:
        if os.environ.get("CI"):       # .ci/run installs Chromium: its absence is a failure
            pytest.fail("no headless Chromium under CI (.ci/run installs Debian's chromium)")
        pytest.skip("no headless Chromium installed")
    image = pytest.importorskip("PIL.Image")
    pytest.importorskip("matplotlib")
    recorded(tmp_path, monkeypatch)
    monkeypatch.setattr(sys, "argv", ["exp24_memory_budget.py"])
    for i in range(24):     # as many tables as the main job: a navigation that must wrap
        Table(f"Experiment 24, table {i}: a long title", experiment=24, chapter=False).show()
    page = _report.write_report(tmp_path, "report")
    for width in (1400, 800):
        shot = tmp_path / f"shot{width}.png"
        screenshot(page, shot, width, 1800)
        pixels = image.open(shot).convert("L")
        assert pixels.size == (width, 1800)
        dark = sum(pixels.histogram()[:128])
        # text, tables and two plots' lines: far from a blank page, far from a black one
        assert 0.01 < dark / (width * 1800) < 0.5
        # the plots are drawn: a region below the first table is not all white
        assert pixels.crop((0, 300, width, 900)).getextrema()[0] < 100
        # nothing overflows sideways: the page's right margin (inside the body's 1em padding)
        # is blank, where an unwrapped navigation or a too-wide table would run on
        assert pixels.crop((width - 10, 0, width, 1800)).getextrema()[0] > 200, width


def test_no_script_puts_a_checkpoint_path_in_a_table():
    """A path names a model on one machine only: tables name it by model_name (its folder);
    a path may still appear in an error or a progress line, which the report never shows."""
    for script in sorted([*SCRIPTS.glob("*.py"), *SCRIPTS.glob("dev/*.py")]):
        for number, line in enumerate(script.read_text().splitlines(), 1):
            if ".path}" in line:
                assert any(word in line for word in ("raise", "Error", ".error(", "say(")), \
                    f"{script.name}:{number}: {line.strip()}"
