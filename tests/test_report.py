"""The main job's list and its report: every experiment script is in the job; the report page
holds every recorded table, the chapter's lines, and the declared plots (with matplotlib); a
real headless browser renders it (skipped when no Chromium is installed)."""
import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import _report
import run_all
from _table import Table

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


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
        t.plot("B", ["tokens/s"], "throughput against batch size")
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


def browser():
    return next((b for b in ("chromium", "chromium-browser", "google-chrome")
                 if shutil.which(b)), None)


@pytest.mark.skipif(browser() is None, reason="no headless Chromium installed")
def test_a_real_browser_renders_the_page(tmp_path, monkeypatch, capsys):
    image = pytest.importorskip("PIL.Image")
    pytest.importorskip("matplotlib")
    recorded(tmp_path, monkeypatch)
    page = _report.write_report(tmp_path, "report")
    shot = tmp_path / "shot.png"
    subprocess.run([browser(), "--headless", "--no-sandbox", "--disable-gpu",
                    "--hide-scrollbars", "--window-size=1000,1800", f"--screenshot={shot}",
                    page.as_uri()], check=True, capture_output=True, timeout=120)
    pixels = image.open(shot).convert("L")
    assert pixels.size == (1000, 1800)
    dark = sum(pixels.histogram()[:128])
    # text, tables and two plots' lines: far from a blank page, far from a black one
    assert 0.01 < dark / (1000 * 1800) < 0.5
    # the plots are drawn: a region below the first table is not all white
    assert pixels.crop((0, 300, 1000, 900)).getextrema()[0] < 100
