"""The experiment scripts not covered elsewhere run end to end on a tiny checkpoint.

These are smoke tests with teeth: each script must exit cleanly, and where its table carries an
exact figure (the chapter's budget and speculative formulas, identical tokens) the figure is
checked. Timings are printed by the scripts, never asserted here.
"""
import builtins
import io
import json
import keyword
import os
import re
import tokenize
from pathlib import Path

import pytest

import run_all
from minitransformer.kernels import blas, tuning

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A Qwen2 checkpoint with the project's real tokenizer, small enough for seconds."""
    from minitransformer.checkpoints.synth import make_checkpoint, qwen2_config, train_tokenizer
    tokenizer = train_tokenizer()
    config = qwen2_config(vocab_size=tokenizer.get_vocab_size(), max_position_embeddings=512,
                          eos_token_id=0)
    return str(make_checkpoint(tmp_path_factory.mktemp("tiny"), config, tokenizer=tokenizer))


def test_exp01_identical_tokens(tiny, run_script):
    out, _ = run_script("exp01_kv_cache", "--model", tiny, "--max-new-tokens", 12)
    assert "tokens identical: 12 of 12  -> identical output" in out


def test_exp11_window_holds_what_the_formula_says(tiny, run_script, monkeypatch):
    """The rotating cache's bytes and the paged engine's blocks against their formulas, each
    row checked by the script (a mismatch exits); planted: a ring of one slot too many, and
    an engine that releases no block, each fail it."""
    out, _ = run_script("exp11_sliding_window", "--model", tiny, "--window", "4",
                        "--lengths", "2,9", "--block-size", "2")
    assert "16.0 GB    512 MB" in out and out.count("yes") == 12
    assert "every layer W=4          9        2     2         3" in out   # 5 blocks, 3 released
    import minitransformer.serve.blocks as blocks
    monkeypatch.setattr(blocks.BlockManager, "slide", lambda books, seq_id: 0)
    _, err = run_script("exp11_sliding_window", "--model", tiny, "--window", "4",
                        "--lengths", "9", "--block-size", "2", status=2)
    assert "the engine holds 5 blocks and released 0, the formula says 2 of 5" in err
    monkeypatch.undo()
    import minitransformer.kvcache as kvcache
    allocate = kvcache.KVCache.allocate.__func__
    monkeypatch.setattr(kvcache.KVCache, "allocate", classmethod(
        lambda cls, c, b, n, *a, **k: allocate(cls, c, b, n, *a, **k | {"spare": 1})))
    _, err = run_script("exp11_sliding_window", "--model", tiny, "--window", "4",
                        "--lengths", "9", status=2)
    assert "the formula says" in err


def test_formula_scripts_print_the_chapter_figures(tiny, run_script):
    out, _ = run_script("exp24_memory_budget")
    assert "337" in out and "65,378" in out and "3,136" in out and "13.0 GB" in out
    out, _ = run_script("exp22_speculative_formula")
    assert "-> 3.40x" in out and "-> 0.79x" in out
    out, _ = run_script("exp10_mha_gqa_mqa", "--chapter-model")
    assert "86,016 B/token" in out and "7.00x" in out
    out, _ = run_script("exp09_users_tokens", "--chapter-model")
    assert out.count("805,306,368") == 3
    out, _ = run_script("exp11_7b_context")
    assert "131,072 B/token" in out
    assert "MAC" in run_script("exp03_macs", "--model", tiny)[0]


def test_batching_scripts_run_and_feed_each_other(tiny, tmp_path, run_script):
    costs = tmp_path / "costs.json"
    run_script("exp12_batched_decode", "--model", tiny, "--batch-sizes", "1,2,4", "--context", 8,
               "--repeat", 2, "--save-step-costs", costs)
    assert set(json.loads(costs.read_text())["seconds"]) == {"1", "2", "4"}
    out, _ = run_script("exp13_batching_sim", "--step-costs", costs, "--slots", 4,
                        "--requests", 8, "--median", 4, "--max-len", 12, "--total", 40)
    assert "measured" in out and "continuous" in out
    out, _ = run_script("exp13_engine", "--model", tiny, "--requests", 8, "--median", 4,
                        "--max-len", 12, "--total", 40, "--prompt-len", 6, "--check")
    assert "continuous vs static" in out
    assert "prefix caching (on, the engine's default) found 0 of 48 prompt tokens" in out
    out, _ = run_script("exp14_paged_cache", "--model", tiny, "--block-sizes", "4,16")
    assert "paged" in out and "prefix caching (on) keeps finished requests' full blocks" in out
    out, _ = run_script("bench_engine", "--model", tiny, "--requests", 4, "--prompt-len", "4-8",
                        "--new-tokens", "4-8", "--slots", 2)
    assert "4/4" in out


def test_bench_parallel_samples_counts_the_blocks_of_each_way(tiny, run_script):
    """A 10-token prompt in blocks of 4 (2 full, 1 partly filled), 3 samples of 2 tokens."""
    out, _ = run_script("bench_parallel_samples", "--model", tiny, "--n", 3, "--prompt-len", 10,
                        "--new-tokens", 2, "--block-size", 4, "--repeat", 1)
    ways = ["one request, n: 3", "3 requests, prefix caching", "3 requests, no caching"]
    rows = {way: line[len(way):].split() for line in out.splitlines() for way in ways
            if line.startswith(way)}
    # (after prefill, peak, prefill tokens): the n samples hold the prompt's 3 blocks once,
    # then 2 of them copy the last; separate requests share 2 full blocks and own a last each
    # (its 2 tokens computed 3 times); without caching, 3 x 3
    assert [(r[0], r[1], r[3]) for r in rows.values()] == [
        ("3", "5", "10"), ("5", "5", "14"), ("9", "9", "30")]
    assert [r[-1] for r in rows.values()] == ["3/3"] * 3


# every script that times a model, with a short run of it
TIMED_RUNS = {
    "bench_decode": ["--context", 8, "--repeat", 1, "--buffer-mb", 16, "--matrix-mb", 8,
                     "--no-quant"],
    "exp22_speculative": ["--new-tokens", 4, "--repeats", 1, "--max-gamma", 2, "--schemes",
                          "int8-row", "--no-layers-draft", "--distilled", "none",
                          "--serving-batches", "1"],
    "bench_spec_serving": ["--batches", "1", "--new-tokens", 4, "--repeat", 1],
    "exp01_kv_cache": ["--max-new-tokens", 2],
    "exp04_cache_memory": ["--prompt-tokens", 4, "--new-tokens", 3, "--prefill-tokens", 0],
    "exp05_prefill_vs_decode": ["--prompt-tokens", 6, "--new-tokens", 2, "--repeat", 1,
                                "--warmup", 0],
    "exp06_prefill_cost": ["--lengths", 4, "--repeat", 1, "--warmup", 0],
    "exp07_decode_cost": ["--lengths", 4, "--repeat", 1, "--warmup", 0],
    "exp12_batched_decode": ["--batch-sizes", "1,2", "--context", 8, "--repeat", 1],
    "exp13_engine": ["--requests", 8, "--median", 4, "--max-len", 12, "--total", 40,
                     "--prompt-len", 6],
    "exp14_paged_cache": ["--block-sizes", 4],
    "bench_engine": ["--requests", 2, "--prompt-len", "4-8", "--new-tokens", "2-4",
                     "--slots", 2],
    "bench_mixed_step": ["--decodes", 2, "--context", 8, "--prompt-len", 24, "--chunk", 8,
                         "--block-size", 4, "--repeat", 1, "--reads", "6,9"],
    "bench_parallel_samples": ["--n", 2, "--prompt-len", 6, "--new-tokens", 2,
                               "--block-size", 4, "--repeat", 1],
    "profile_batched": ["--context", 8, "--repeat", 1, "--buffer-mb", 16, "--second", "none"],
}


@pytest.mark.parametrize("name", TIMED_RUNS)
def test_timing_scripts_fix_blas_threads_before_the_model_loads(name, tiny, run_script,
                                                                 monkeypatch):
    """--threads is in force before anything is timed, the model's load included: building a
    model times its weights' layouts and ways (blas.py), and a layout chosen under the
    library's own thread count, for steps then timed under one, is a choice made for other
    conditions than the ones the table reports."""
    import threadpoolctl
    events, limits = [], threadpoolctl.threadpool_limits
    monkeypatch.setattr(threadpoolctl, "threadpool_limits",
                        lambda *a, **k: events.append("threads") or limits(*a, **k))
    measure = blas.timings
    monkeypatch.setattr(blas, "timings",
                        lambda *a, **k: events.append("timed") or measure(*a, **k))
    for name_, value in (("laid_out", {}), ("chosen", {}), ("FIXED", None),
                         ("FIXED_LAYOUT", None)):
        monkeypatch.setattr(blas, name_, value)   # every shape measured again, here
    monkeypatch.setattr(tuning, "MODE", "off")    # not recalled from this machine's file
    run_script(name, "--model", tiny, *TIMED_RUNS[name])
    assert "timed" in events and events[0] == "threads", events[:3]


def test_bench_decode_runs_and_checks_its_bits(tiny, run_script, tmp_path):
    from minitransformer.measure.timing import blas_kernel, where_it_ran
    markdown = tmp_path / "decode.md"
    out, _ = run_script("bench_decode", "--model", tiny, "--context", 8, "--repeat", 2,
                        "--buffer-mb", 16, "--matrix-mb", 8, "--markdown", markdown)
    assert "against the memory-bandwidth floor" in out and "/ floor" in out
    assert where_it_ran().split("; BLAS:")[0] in out and f"kernel {blas_kernel()}" in out
    written = markdown.read_text()       # the same tables, headed by the kernel
    assert written.startswith(f"# Decode benchmark: OpenBLAS kernel {blas_kernel()}\n")
    assert written.count("\n### ") == 7 and "| model | B=1 ms | B=16 flat ms |" in written
    assert "Threads: the decode step and a prefill at 1 and" in out
    assert "Threads: where a decode step's time goes at 1 and" in out
    routes = out.split("Product routes:")[1].split("Decode benchmark:")[0]
    assert "W (2340, 896) float32" in routes and "dot product over the same bytes" in routes
    assert all(f" {route} " in routes for route in blas.ONE_ROW)
    assert re.search(rf"blas.py takes ({'|'.join(blas.ONE_ROW)}) for one row of this shape, "
                     "measured on this W", routes)
    assert "bit for bit" in out  # batch-invariant rows: each exactly B = 1's logits
    assert "Quantized decode" in out and "NF4 (block 64)" in out
    assert "prompt lookup on a rewrite task" in out and "yes" in out.split("rewrite task")[-1]


def test_bench_decode_times_the_step_at_one_and_n_threads_side_by_side(tiny, run_script):
    """--only-threads: the steps of 1, 8 and 16 rows and a prefill at 1 and N threads in one
    table, the read floor at each count and the idle CPU beside them; then where the steps of
    1 and 8 rows spend their time at each count (the rest's share, sampling's, and what the
    holds of BLAS at one thread save); the threads setting put back after."""
    from minitransformer.kernels import threads
    before = threads.count(), threads.pool
    out, _ = run_script("bench_decode", "--model", tiny, "--context", 8, "--repeat", 1,
                        "--buffer-mb", 4, "--only-threads", "--side-threads", 3,
                        "--threads", 1)
    timed, shares = out.split("Threads: where a decode step's time goes at 1 and 3 threads")
    assert "Threads: the decode step and a prefill at 1 and 3 threads, side by side" in timed
    assert "read floor: 4 MiB streamed at" in timed and "idle: " in timed
    rows = [line.split(None, 1)[1] for line in timed.splitlines() if line.startswith("tiny")]
    assert [r.split("  ")[0] for r in rows] == ["decode, 1 row", "decode, 8 rows",
                                                 "decode, 16 rows", "prefill, 64 tokens"]
    assert "not slower" in rows[-1]
    rows = [line.split() for line in shares.splitlines() if line.startswith("tiny")]
    assert [(int(r[1]), int(r[2])) for r in rows] == [(1, 1), (1, 3), (8, 1), (8, 3)]
    assert re.search(r"a 1-row step makes [1-9]\d* holds inside its pass's own", shares)
    assert (threads.count(), threads.pool) == before


def test_bench_decode_says_where_no_route_reaches_the_dot_product(tiny, run_script,
                                                                  monkeypatch):
    """No route streams at 100 times the dot product's rate: with that as "near", the routes table
    says none is near, and the floor table adds each model's step at the best route's rate."""
    import bench_decode
    monkeypatch.setattr(bench_decode, "NEAR_DOT", 100.0)
    out, _ = run_script("bench_decode", "--model", tiny, "--context", 8, "--repeat", 1,
                        "--buffer-mb", 16, "--matrix-mb", 8, "--no-quant")
    routes, floor = out.split("Product routes:")[1].split("Decode benchmark:")
    best = re.search(r"best library route: \w+, ([0-9.]+) GB/s", routes).group(1)
    assert re.search(rf"no route the library takes streams at 10000% of the dot product "
                     rf"here \({best} against [0-9.]+ GB/s\)", routes)
    assert re.search(rf"{Path(tiny).name}: at the best route's rate \({best} GB/s\) the "
                     r"floor is [0-9.]+ ms; the step is [0-9.]+x it \(target <= 1.25x\)", floor)
    probes = re.search(r"read bandwidth ([0-9.]+) GB/s \(dot product ([0-9.]+), matrix-vector "
                       r"([0-9.]+): the faster sets the floor\)", floor).groups()
    assert float(probes[0]) == max(map(float, probes[1:]))   # never the slower probe


def test_bench_mixed_step_writes_its_table_headed_by_the_kernel(tiny, run_script, tmp_path):
    """--markdown writes the table the run printed, under a title naming the kernel and the
    command: the docs' figures are the script's own (docs/benchmarks/mixed-step-*.md)."""
    from minitransformer.measure.timing import blas_kernel
    markdown = tmp_path / "mixed.md"
    out, _ = run_script("bench_mixed_step", "--model", tiny, *TIMED_RUNS["bench_mixed_step"],
                        "--markdown", markdown)
    written = markdown.read_text()
    assert written.startswith(f"# A step's decodes and prompt chunk: OpenBLAS kernel "
                              f"{blas_kernel()}\n")
    assert "python3 scripts/dev/bench_mixed_step.py --model " in written  # after a forced kernel
    ratio = re.search(r"one pass / \(decodes alone \+ chunk alone\): ([0-9.]+) \(fastest\)",
                      out).group(1)
    assert f"one pass / (decodes alone + chunk alone): {ratio} (fastest)" in written
    assert written.count("| both, one pass (ragged) |") == 1
    reads = out.split("gathered or in place")[1]        # --reads: each context, four ways
    for context in (6, 9):
        assert re.search(rf"\n +{context} +before: plain attention, blocks gathered .* "
                         r"1\.00\n", reads)
        assert re.search(rf"\n +{context} +after: plain attention, in place \(the default\) ",
                         reads)
        assert re.search(rf"\n +{context} +tiled attention, blocks in place ", reads)
    assert written.count("| after: plain attention, in place (the default) |") == 2


def test_mutation_judges_an_equivalent_only_where_its_run_checked_it():
    """An EQUIVALENT entry is contradicted when its mutant was killed, timed out, reached by no
    test or not made at all; one an --only run left unchecked is not judged (such a run exited
    1 for the entries outside its pattern)."""
    from mutation import EQUIVALENT, module_prefix, stale_equivalents
    listed = [m for m in EQUIVALENT if m.startswith(module_prefix("engine"))]
    m = listed[0]
    for outcome, stale in (("survived", False), ("not checked", False), ("killed", True),
                           ("timeout", True), ("no tests", True)):
        assert (m in stale_equivalents("engine", {m: outcome})) is stale, outcome
    assert stale_equivalents("engine", {}) == listed                       # none made
    assert stale_equivalents("engine", dict.fromkeys(listed, "survived")) == []


def test_mutation_shows_a_copy_the_checkouts_shared_folder(tmp_path):
    """A scratch copy's tests find stories260K two folders above their conftest.py, as the
    checkout's do: without the link every real-model test skips there, and a bug only they
    catch passes as 'not caught'."""
    from mutation import ROOT, link_shared
    if not (ROOT.parent / "shared").is_dir():
        pytest.skip("no ../shared beside the checkout")
    link_shared(tmp_path)
    assert (tmp_path / "shared").resolve() == (ROOT.parent / "shared").resolve()


def report_folder(path, cells, header="machine: load average 0.5 at start") -> Path:
    """A run_all report folder holding one table of exp05's shape: rows of (phase, tokens,
    time s), as the main job records them."""
    (path / "tables").mkdir(parents=True)
    table = {"title": "Experiment 5", "header": [header], "columns": ["phase", "tokens",
             "time s"], "rows": cells, "notes": [], "chapter": "", "differs": ""}
    (path / "tables" / "exp05_prefill_vs_decode.json").write_text(json.dumps([table]))
    return path


def test_compare_tables_masks_timings_and_rounding_and_names_the_rest(tmp_path, run_script):
    """Two runs alike but for their times (a timed column, the load in a header line) and a
    float's last bits are the same; a count that moved, or a table on one side only, is named
    with both values, and the exit status is 1."""
    old = report_folder(tmp_path / "old", [["prefill", 40, 0.5], ["decode", 1.25, 0.1]])
    timed = report_folder(tmp_path / "timed", [["prefill", 40, 0.7], ["decode", 1.2500001, 0.2]],
                          header="machine: load average 3.1 at start")
    out, _ = run_script("compare_tables", old, timed)
    assert "same but for 3 timings and 1 rounding" in out
    moved = report_folder(tmp_path / "moved", [["prefill", 41, 0.5], ["decode", 1.25, 0.1]])
    out, _ = run_script("compare_tables", old, moved, status=1)
    assert "DIFFERS in 1 place" in out and "old: 40\n      new: 41" in out
    (moved / "tables" / "exp01_kv_cache.json").write_text("[]")
    out, _ = run_script("compare_tables", old, moved, status=1)
    assert "exp01_kv_cache: only in the new run" in out


def test_every_planted_bug_names_one_line_of_today_and_tests_that_exist():
    """A ledger's planted bug whose line is gone (or twice in its file), or whose tests were
    moved, is caught here rather than as 'stale' in a long --planted run."""
    from mutation import PLANTED
    root = SCRIPTS.parent
    for feature, bug, path, line, broken, tests in PLANTED:
        assert (root / path).read_text().count(line) == 1, (path, line)
        assert line != broken, bug
        for test in tests:
            assert (root / test.split("::")[0]).is_file(), (bug, test)


def test_every_planted_bug_compiles_and_reads_only_names_its_file_has():
    """A planted bug that cannot be imported (a name renamed since it was written) fails its
    tests' collection, not a test: --planted reports an error, not the bug caught. Each broken
    file must compile, and each name the broken line reads that the line did not (attributes
    aside) must be a builtin or a name the file holds."""
    from mutation import PLANTED
    root = SCRIPTS.parent
    known = set(keyword.kwlist) | set(dir(builtins))
    for feature, bug, path, line, broken, tests in PLANTED:
        original = (root / path).read_text()
        compile(original.replace(line, broken), path, "exec")
        unknown = read_names(broken) - read_names(line) - read_names(original) - known
        assert not unknown, (path, bug, unknown)


def read_names(code: str) -> set:
    """The names a piece of code reads, attributes (after a dot) left out; a piece of a
    statement (an open bracket) read up to where it stops."""
    names, previous = set(), None
    try:
        for token in tokenize.generate_tokens(io.StringIO(code.strip() + "\n").readline):
            if token.type == tokenize.NAME and previous != ".":
                names.add(token.string)
            previous = token.string
    except (tokenize.TokenError, IndentationError):
        pass
    return names


def test_the_readme_names_the_experiments_that_take_no_model(run_script):
    """Every experiment's --help lists --model but those the README names, and no other."""
    readme = " ".join((SCRIPTS.parent / "README.md").read_text().split())
    named = re.search(r"every experiment `--model PATH\|default\|smollm2`, all but (.*?), which",
                      readme).group(1)
    without = set()
    for script in sorted(SCRIPTS.glob("exp*.py")):
        out, _ = run_script(script.stem, "--help")
        if "--model" not in out:
            without.add(script.name)
    assert without == set(re.findall(r"`(exp\w+\.py)`", named)) != set()


@pytest.mark.parametrize("report", [True, False])
def test_run_all_runs_a_selection_writes_its_report_by_default_and_ends_with_its_cost(
        tiny, capfd, monkeypatch, tmp_path, report):
    """run_all starts each script as a process: its tables reach the file descriptor. The
    report is written unless --no-report, where the job says, and the job's last line is what
    it cost, the first use apart."""
    monkeypatch.setattr(run_all, "REPORT", tmp_path / "report")
    argv = ["--model", tiny, "--only", "exp(09|24)"] + ([] if report else ["--no-report"])
    assert run_all.main(argv) == 0
    out, err = capfd.readouterr()
    assert "Experiment 9: KV cache for users x tokens" in out and "Experiment 24" in out
    page = tmp_path / "report" / "index.html"
    assert page.is_file() == report and (f"report: {page}" in err) == report
    assert "Experiment 24" in (page.read_text() if report else "Experiment 24")
    assert re.search(r"the job cost \d+ s wall \([\d.]+ min\), \d+ s CPU; first use, apart: "
                     r"none \(everything was there\)\n$", err), err[-300:]


def test_the_default_report_is_outside_the_tracked_tree():
    import shutil
    import subprocess
    root = Path(run_all.__file__).resolve().parents[1]
    if shutil.which("git") is None or not (root / ".git").exists():
        pytest.skip("not a git checkout")
    page = run_all.REPORT / "index.html"
    assert subprocess.run(["git", "-C", str(root), "check-ignore", "-q", str(page)]).returncode \
        == 0


PROBE = """import numpy, threadpoolctl
print("threads", max(i["num_threads"] for i in threadpoolctl.threadpool_info()
                      if i["user_api"] == "blas"))
"""


@pytest.mark.parametrize("takes", [set(), {run_all.THREADS}])
def test_run_all_names_the_blas_threads_each_script_ran_with(takes, capfd, monkeypatch,
                                                             tmp_path):
    """The summary's BLAS threads are the ones the script's BLAS had: a timing script's
    --threads, every core for the others (docs/main-job.md said 1 where three ran with 2): the
    library's one count (kernels/threads.py), here 1, not the machine's cores (OpenBLAS takes
    no more threads than cores: a count above them would read as the cores)."""
    from minitransformer.kernels import threads
    threads.set_count(1, "the test", blas=False)     # put back after (conftest)
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    monkeypatch.setattr(run_all, "MAIN_JOB", [(str(probe), takes, [])])
    assert run_all.main(["--no-report", "--threads", "1"]) == 0
    out, _ = capfd.readouterr()
    ran = int(re.search(r"^threads (\d+)$", out, re.M).group(1))
    stated = int(re.search(r"probe\.py.*?ok\s+(\d+)\s", out).group(1))
    assert ran == stated == 1


def test_first_use_is_made_before_the_job_and_timed_apart(monkeypatch, tmp_path):
    """What a script fetches once (here experiment 21's text) is made before the job, timed on
    its own; nothing when it is already there."""
    import time

    from minitransformer.measure import text
    made = []

    def fetch():
        start = time.process_time()
        while time.process_time() - start < 0.2:
            pass
        made.append(True)
    monkeypatch.setattr(run_all, "fetch_text", fetch)
    monkeypatch.setattr(text, "cache_path", lambda: tmp_path / "absent.txt")
    args = run_all.argparse.Namespace(model="default", threads=1)
    job = [("exp21_kv_cache_quality.py", {run_all.MODEL}, [])]
    (what, wall, cpu), = run_all.first_use(job, args, {})
    assert made and what == "experiment 21's text: fetched" and wall >= cpu >= 0.2
    assert run_all.first_use_line([(what, wall, cpu)]).startswith(f"{what} in ")
    monkeypatch.setattr(text, "cache_path", lambda: Path(run_all.__file__))  # there
    assert run_all.first_use(job, args, {}) == [] and len(made) == 1
    assert run_all.first_use_line([]) == "none (everything was there)"


def test_first_use_times_smollm2s_fetch_from_its_start(tiny, monkeypatch, tmp_path):
    """SmolLM2's fetch is made in its own step and timed there, before anything asks for the
    model (asking whether its drafts or k-quant copies are there fetched it untimed: the
    first-use line said 0 s for a 15 s fetch)."""
    import time

    from minitransformer.measure import text
    monkeypatch.setenv("MT_WEIGHTS_DIR", str(tmp_path))              # SmolLM2: not imported
    monkeypatch.setattr(text, "cache_path", lambda: Path(run_all.__file__))  # the text: there
    fetched = []

    def model_path(spec):
        if not fetched:                                              # the fetch: 0.2 s CPU
            start = time.process_time()
            while time.process_time() - start < 0.2:
                pass
            fetched.append(spec)
        return tiny
    monkeypatch.setattr(run_all, "model_path", model_path)
    args = run_all.argparse.Namespace(model=None, threads=1)
    job = [("exp22_speculative.py", {run_all.MODEL}, []),
           ("exp16_quant_error.py", {run_all.MODEL}, [])]
    firsts = run_all.first_use(job, args, {})
    assert firsts[0][0].endswith("fetched and imported") and firsts[0][2] >= 0.2, firsts


def test_first_use_quantizes_the_k_quant_copies_once(tiny, monkeypatch, tmp_path):
    """The k-quant copies experiments 15, 16 and 21 would quantize on a first run are made
    before the job, timed apart, once: the schemes of the selected scripts only, again when
    the model's files change, never under MT_QUANT_CACHE=off, nor for a model too small to
    keep any (each script quantizes it in no time)."""
    import quant.gguf_weight
    from minitransformer.measure import text
    monkeypatch.setenv("MT_WEIGHTS_DIR", str(tmp_path))
    monkeypatch.setattr(text, "cache_path", lambda: Path(run_all.__file__))  # the text: there
    made, real = [], run_all.quantize_scheme
    monkeypatch.setattr(run_all, "quantize_scheme", lambda weights, scheme, threads:
                        made.append(scheme) or real(weights, scheme, threads))
    args = run_all.argparse.Namespace(model=tiny, threads=1)
    job = [("exp21_quantized_quality.py", {run_all.MODEL}, [])]
    assert run_all.first_use(job, args, {}) == [] and made == []    # none of its kept
    monkeypatch.setattr(quant.gguf_weight, "KEPT_WEIGHTS", 1)        # as if each were large
    (what, wall, cpu), = run_all.first_use(job, args, {})
    assert what.startswith("the k-quant copies of ") and what.endswith(
        "(q4_k, q5_k, q6_k): quantized") and made == ["q4_k", "q5_k", "q6_k"]
    assert run_all.first_use(job, args, {}) == [] and len(made) == 3
    job.append(("exp16_quant_error.py", {run_all.MODEL}, []))
    (what, _, _), = run_all.first_use(job, args, {})                 # only the two it lacks
    assert made[3:] == ["q2_k", "q3_k"] and what.endswith("(q2_k, q3_k): quantized")
    weights = next(Path(tiny).glob("*.safetensors"))
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
    assert len(run_all.first_use(job, args, {})) == 1 and made[5:] == list(run_all.KQUANTS)
    monkeypatch.setenv("MT_QUANT_CACHE", "off")
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
    assert run_all.first_use(job, args, {}) == [] and len(made) == 10


def test_the_k_quant_copies_made_in_threads_are_each_matrixs_own_bytes(tiny, monkeypatch,
                                                                      tmp_path):
    """quantize_scheme's threads keep, for every projection matrix, the blocks its own floats
    quantize to (what quantize_model then reads back), whatever thread made them."""
    import numpy as np

    import quant.gguf_weight as gw
    from minitransformer.backend import to_numpy
    from minitransformer.loader import load
    from quant.qmodel import projection_names
    monkeypatch.setenv("MT_WEIGHTS_DIR", str(tmp_path))
    monkeypatch.setattr(gw, "KEPT_WEIGHTS", 1)                       # as if each were large
    weights = load(tiny).weights
    names = projection_names(weights)
    run_all.quantize_scheme(weights, "q4_k", threads=3)
    files = set()
    for name in names:
        w = np.asarray(to_numpy(weights[name]), np.float32)
        kind = gw.stored_type("Q4_K", w.shape[1])
        files.add(gw.kept_file(w, kind))
        assert np.array_equal(np.load(gw.kept_file(w, kind)), gw.QUANTIZERS[kind](w)), name
    assert set((tmp_path / "quantized").glob("*.npy")) == files      # each matrix's, no other


def test_exp12_draws_no_knee_from_the_smaller_row_of_an_inverted_pair(tiny, monkeypatch,
                                                                     run_script):
    """B = 8 costs less than B = 4 (flagged, still after re-measuring): either may be the wrong
    one, so the knee at B = 2, which rests on B = 4, is not concluded."""
    import exp12_batched_decode as exp12
    from minitransformer.measure.timing import Timing
    steps = {1: 0.010, 2: 0.012, 4: 0.022, 8: 0.015}

    def fake(fns, warmup=1, repeat=5, after=None):
        return [Timing((steps[fake.sizes.pop(0)],) * 3, load=0.5)] * 3
    fake.sizes = [1, 2, 4, 8] + [4, 8]       # then the flagged row and the one before it
    monkeypatch.setattr(exp12, "time_together", fake)
    out, _ = run_script("exp12_batched_decode", "--model", tiny, "--batch-sizes", "1,2,4,8",
                        "--context", 8, "--repeat", 3)
    assert "knee: B = 2" not in out
    assert "knee: not concluded, the machine was too noisy (B=8: still flagged, see its row)" \
        in out


@pytest.mark.parametrize("noisy", [False, True])
def test_exp12_concludes_only_from_steady_rows(tiny, monkeypatch, run_script, noisy):
    """Step timings injected: quiet, the knee is printed; with B = 2's repeats disagreeing
    (and fewer tokens/s than B = 1) even after re-measuring, the row is flagged with the
    figures the table prints and the knee is withheld, naming the load."""
    import exp12_batched_decode as exp12
    from minitransformer.measure.timing import Timing
    steps = {1: (0.010,) * 3, 2: (0.030, 0.060, 0.060) if noisy else (0.012,) * 3,
             4: (0.020,) * 3}

    def fake(fns, warmup=1, repeat=5, after=None):   # B = the rows the step decodes
        B = fake.sizes.pop(0)
        return [Timing(steps[B], load=3.5)] * 3
    fake.sizes = [1, 2, 4] * 2    # then the re-measurement: the flagged rows and those before
    monkeypatch.setattr(exp12, "time_together", fake)
    out, _ = run_script("exp12_batched_decode", "--model", tiny, "--batch-sizes", "1,2,4",
                        "--context", 8, "--repeat", 3)
    if not noisy:
        assert "knee: B = 2 (doubling to 4 buys +20% tokens/s, under 25%)" in out
        assert "WARNING" not in out
        return
    assert "knee: not concluded, the machine was too noisy (B=2: still flagged, see its row" \
        "; B=4: still flagged, see its row); load average 3.5" in out
    row = next(line for line in out.splitlines() if line.lstrip().startswith("2 "))
    assert "WARNING: batch 2 makes 66.7 tokens/s, 0.67x batch 1 (100.0)" in row
    assert "  66.7  " in row and any(" 100.0 " in line for line in out.splitlines())


def test_the_step_costs_doubts_quote_what_the_simulation_prints():
    """The warning quotes the medians the simulation's header prints, against the dearest
    smaller batch (a slow drift past several sizes is caught, not only a step between two)."""
    from sim.batching import TableCost
    cost = TableCost((1, 2, 5, 6, 7, 8), (0.0331, 0.0423, 0.0547, 0.0535, 0.0503, 0.0471))
    assert cost.doubts() == {     # B=6 and 7 stay within the 10% floor of B=5
        8: "B=8 47.1 ms below B=5 54.7 ms: a larger batch cannot be cheaper"}
    assert TableCost((1, 2, 4), (0.030, 0.029, 0.050)).doubts() == {}   # within 10%


SIM = ["--slots", 8, "--requests", 8, "--median", 4, "--max-len", 12, "--total", 40,
       "--loads", "0.5,1,inf", "--seeds", 1]


@pytest.mark.parametrize("costs, why", [
    ({"1": 0.010, "2": 0.012, "4": 0.020, "8": 0.015},     # B=8 below B=4: a plain file
     "step cost B=8 15.0 ms below B=4 20.0 ms: a larger batch cannot be cheaper"),
    ({"seconds": {"1": 0.010, "2": 0.012, "4": 0.020, "8": 0.030},   # ordered, but flagged
      "flagged": {"4": "B=4: median 40.0 ms, 2.00x the fastest 20.0 ms: repeats disagree"}},
     "step cost flagged where measured: B=4: median 40.0 ms, 2.00x the fastest 20.0 ms")])
def test_exp13_sim_concludes_nothing_from_doubted_step_costs(tmp_path, run_script, costs, why):
    """Costs out of order, or flagged by experiment 12: the rows are printed, no ratio is."""
    path = tmp_path / "costs.json"
    path.write_text(json.dumps(costs))
    out, _ = run_script("exp13_batching_sim", "--step-costs", path, *SIM)
    assert f"WARNING: {why}" in out
    assert "continuous vs static: not concluded, the machine was too noisy (step costs at " \
        "B = " in out
    assert "the 1.6x throughput gain: not concluded" in out
    assert "both chapter figures: not concluded" in out
    assert not re.search(r"throughput \d+\.\d+x|reaches 1\.6x|at loads:", out), out
    plain = {"1": 0.010, "2": 0.012, "4": 0.020, "8": 0.030}     # the same, in order: concluded
    path.write_text(json.dumps(plain))
    out, _ = run_script("exp13_batching_sim", "--step-costs", path, *SIM)
    assert re.search(r"continuous vs static: throughput \d+\.\d+x", out)
    assert "not concluded" not in out and "WARNING" not in out


def test_exp12_s_flags_travel_with_its_step_costs_to_exp13(tiny, monkeypatch, run_script,
                                                           tmp_path):
    """Experiment 12 measuring B = 8 below B = 4 (injected timings, on both passes) writes
    the costs with the row flagged; experiment 13 concludes nothing from them, and neither
    does experiment 13 on the engine, simulating at them."""
    import exp12_batched_decode as exp12
    from minitransformer.measure.timing import Timing
    steps = {1: 0.010, 2: 0.012, 4: 0.020, 8: 0.015}

    def fake(fns, warmup=1, repeat=5, after=None):   # B = the rows the step decodes
        B = fake.sizes.pop(0)
        return [Timing((steps[B],) * 3, load=2.5)] * 3
    fake.sizes = [1, 2, 4, 8, 4, 8]     # then the re-measurement: B = 8 and the row before
    monkeypatch.setattr(exp12, "time_together", fake)
    costs = tmp_path / "costs.json"
    out, _ = run_script("exp12_batched_decode", "--model", tiny, "--batch-sizes", "1,2,4,8",
                        "--context", 8, "--repeat", 3, "--save-step-costs", costs)
    assert "WARNING: batch 8 costs 0.75x batch 4" in out
    saved = json.loads(costs.read_text())
    assert saved["seconds"] == {"1": 0.010, "2": 0.012, "4": 0.020, "8": 0.015}
    assert list(saved["flagged"]) == ["8"] and "cannot be cheaper" in saved["flagged"]["8"]
    out, _ = run_script("exp13_batching_sim", "--step-costs", costs, *SIM)
    assert "WARNING: step cost flagged where measured: batch 8 costs 0.75x batch 4" in out
    assert "continuous vs static: not concluded" in out
    assert not re.search(r"throughput \d+\.\d+x", out), out
    out, _ = run_script("exp13_engine", "--model", tiny, "--step-costs", costs, "--requests", 8,
                        "--median", 4, "--max-len", 12, "--total", 40, "--prompt-len", 6)
    simulated = out.split("Simulation (sim/batching.py)")[1]
    assert "continuous vs static (simulated): not concluded" in simulated
    assert not re.search(r"throughput \d+\.\d+x", simulated), simulated


def test_profile_batched_splits_the_step_under_two_kernels(tiny, run_script, tmp_path):
    """Every batch size profiled under the native kernel and a forced one (here the native
    kernel again, forced in the child: any machine has it); the rest is the step less the
    products and the attention."""
    from minitransformer.measure.timing import blas_kernel
    markdown = tmp_path / "profile.md"
    kernel = blas_kernel()
    out, _ = run_script("profile_batched", "--model", tiny, "--context", 8, "--repeat", 1,
                        "--buffer-mb", 16, "--second", kernel, "--markdown", markdown)
    native, forced = out.split("Batched decode step, profiled: ")[1:]
    assert native.startswith(f"OpenBLAS kernel {kernel}")       # forced where the shell forces
    assert forced.startswith(f"OpenBLAS kernel {kernel} (forced: OPENBLAS_CORETYPE={kernel})")
    assert f"kernel {kernel}, 1 thread" in forced
    for table in (native, forced):
        rows = [line.split() for line in table.splitlines() if line.startswith(Path(tiny).name)]
        assert [int(r[1]) for r in rows] == [1, 4, 16, 32]
    assert markdown.read_text().count("\n### ") == 2


def test_profile_batched_rest_is_the_step_less_its_parts(tiny):
    import argparse

    from threadpoolctl import threadpool_limits

    from profile_batched import COLUMNS, profile
    with threadpool_limits(None):       # its threads=1 holds for the profile alone
        result = profile(argparse.Namespace(model=[tiny], context=8, repeat=1, buffer_mb=16,
                                            threads=1))
    names = [name for name, _ in COLUMNS]
    for row in result["rows"]:
        step, products, attention, rest, share = (
            row[names.index(n)] for n in ("step ms", "products ms", "attention ms", "rest ms",
                                          "rest / step"))
        assert rest == pytest.approx(step - products - attention, abs=1e-9)
        assert share == pytest.approx(rest / step)


def test_products_in_cache_make_the_steps_products_over_slabs_that_stay_in_cache(
        tiny, monkeypatch):
    """The in-cache products make the step's products over as many weight rows (so as many
    flops), the same rows and in-dims, each over a slab under blas.COLD_BYTES: here made
    small, so every weight of the tiny model is split, the last slab the remainder."""
    import numpy as np

    from bench_decode import product_weights

    import profile_batched
    from minitransformer.backend import to_numpy
    from minitransformer.loader import load
    model = load(tiny)
    monkeypatch.setattr(blas, "COLD_BYTES", 1024)
    made = []
    monkeypatch.setattr(profile_batched, "linear", lambda x, w: made.append((x.shape, w)))
    profile_batched.products_in_cache(model, 3)()
    assert sum(rows * w.shape[0] * w.shape[1] for (rows, _), w in made) == \
        3 * product_weights(model)
    assert all(rows == 3 and k == w.shape[1] and w.nbytes < 1024 for (rows, k), w in made)
    assert len({id(w) for _, w in made}) < len(made) / 4        # slabs shared, hence cached
    first = made[0][1]                                          # layer 0's qkv, first rows
    assert np.array_equal(to_numpy(first), to_numpy(model.layers[0].qkv[:len(first)]))


def test_profile_batched_runs_the_second_kernel_in_a_child_that_forces_it(monkeypatch):
    import subprocess

    import profile_batched
    ran = []

    def fake_run(command, env, **kwargs):
        ran.append((command, env))
        return subprocess.CompletedProcess(command, 0, stdout='{"kernel": "K", "rows": []}')
    monkeypatch.setattr(profile_batched.subprocess, "run", fake_run)
    assert profile_batched.child_profile("Sandybridge", ["--repeat", 2]) == \
        {"kernel": "K", "rows": []}
    (command, env), = ran
    assert env["OPENBLAS_CORETYPE"] == "Sandybridge"
    assert command[1:] == [profile_batched.__file__, "--repeat", "2", "--child"]
    assert profile_batched.second_kernel("SkylakeX") == "Haswell"


def test_attention_work_counts_what_the_rows_hold():
    """Bytes: every key and value each row holds after its new token, the cache's own arrays
    measured; flops: 2 for q.k and 2 for p.v per held token, query head and dimension."""
    from types import SimpleNamespace

    from minitransformer.kvcache import KVCache
    from profile_batched import attention_work, row_lengths
    config = SimpleNamespace(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             head_dim=8)
    lengths = row_lengths(3, 6)                                   # 3, 4, 6 tokens
    cache = KVCache.allocate(config, 3, 7)
    held = sum(a[b, :, :n + 1].nbytes for a in cache.k + cache.v
               for b, n in enumerate(lengths))
    assert lengths.tolist() == [3, 4, 6]
    assert attention_work(config, lengths) == (held, 4 * (4 + 5 + 7) * 4 * 8 * 2)


def test_profile_batched_says_when_the_split_does_not_add_up():
    """A step faster than its parts (a busy machine's rounds): the table says so, row named."""
    from profile_batched import table
    row = ["m", 4, 10.0, 1.0, 8.0, 4.0, 2.0, 3.0, 1.0, 3.0, -1.0, -0.1, 6.0, 1.5]
    result = {"kernel": "K", "headers": [], "rows": [row, ["m", 1, *row[2:10], 1.0, 0.1,
                                                            *row[12:]]]}
    notes = table(result).notes
    assert any(n.startswith("rest below 0 (m B=4): ") for n in notes)
    result["rows"] = result["rows"][1:]
    assert not any(n.startswith("rest below 0") for n in table(result).notes)


def test_bench_load_prints_its_four_loads_side_by_side(tiny, run_script):
    out, _ = run_script("bench_load", "--model", tiny, "--repeat", "1", "--max-num-seqs", "8")
    rows = [line.split(":")[0] for line in out.splitlines()
            if re.match(r"(row-major|remembered|first|unkept): ", line)]
    assert rows == ["row-major", "remembered", "first", "unkept"]
    assert "measured for 8 rows too (serve)" in out
    assert re.search(r"targets: remembered <= 1.5x row-major \(here \d+\.\d\dx, \d+\.\d\dx "
                     r"per round\); first <= row-major \+ 3 s \(here [+-]\d+\.\d\d s, "
                     r"[+-]\d+\.\d\d s per round\)", out)


def test_first_use_knows_when_the_drafts_are_trained(monkeypatch, tmp_path):
    """The drafts count as a first use only when their cache file is missing and the model has
    layers enough to cut a draft from."""
    from types import SimpleNamespace

    from minitransformer.checkpoints.synth import make_checkpoint, qwen2_config
    from minitransformer.drafts.students import Settings, students_file
    monkeypatch.setenv("MT_WEIGHTS_DIR", str(tmp_path / "weights"))
    deep = make_checkpoint(tmp_path / "deep", qwen2_config(num_hidden_layers=Settings().layers + 1))
    shallow = make_checkpoint(tmp_path / "shallow", qwen2_config(num_hidden_layers=2))
    assert not run_all.drafts_there(str(deep)) and run_all.drafts_there(str(shallow))
    file = students_file(SimpleNamespace(path=str(deep)), Settings())
    file.parent.mkdir(parents=True)
    file.write_bytes(b"")
    assert run_all.drafts_there(str(deep))
