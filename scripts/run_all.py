"""The main job: every experiment of the chapter, in order.

Runs each script of MAIN_JOB in turn (a fresh process each, so one experiment's memory and
timings do not leak into the next). Tables go to stdout, progress and timing to stderr. Every
script runs on its own default model (the embedded one, or the real one where the script says
so) unless --model is given, which is passed to every script that loads a model. Experiment 12
measures the batched step costs that experiment 13's simulation then uses; experiments 9 and 10
run twice, on the model and on the chapter's Qwen2.5-0.5B shape.

--report DIR also writes DIR/index.html (one self-contained page: every table, the chapter's
figures beside ours, plots; plots need matplotlib, the 'report' extra) and every table as JSON
(DIR/tables.json). Per script the wall time and the CPU time are printed: on a machine shared
with other work the CPU time is what the script would take alone (one BLAS thread). The summary
ends with the total, the load average seen between scripts, and a verdict: a machine is named
busy when the job waited for a core (wall time above 1.2x the CPU time) or other work kept the
load average a whole core above the job's own threads. --summary FILE also writes that summary
as Markdown (docs/main-job.md is written so: what the documentation says the job costs).
"""
import argparse
import os
import platform
import re
import shlex
import resource
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from _common import add_model_argument, say
from minitransformer.measure.timing import load_average
from _table import RECORD_ENV, Table

HERE = Path(__file__).resolve().parent
MODEL, THREADS = "model", "threads"      # what a script takes: --model PATH, --threads N
# The main job, in the chapter's order: (script, what it takes, extra arguments).
MAIN_JOB = [
    ("exp01_kv_cache.py", {MODEL, THREADS}, []),
    ("exp02_attention_scaling.py", {MODEL, THREADS}, []),
    ("exp03_macs.py", {MODEL}, []),
    # the long prefill, plain against tiled attention, at 512 tokens (2,048 alone: minutes)
    ("exp04_cache_memory.py", {MODEL, THREADS}, ["--prefill-tokens", "512"]),
    ("exp05_prefill_vs_decode.py", {MODEL, THREADS}, []),
    ("exp06_prefill_cost.py", {MODEL, THREADS}, []),
    ("exp07_decode_cost.py", {MODEL, THREADS}, []),
    ("exp08_cache_bytes.py", {MODEL}, []),
    ("exp09_users_tokens.py", {MODEL}, []),
    ("exp09_users_tokens.py", set(), ["--chapter-model"]),
    ("exp10_mha_gqa_mqa.py", {MODEL}, []),
    ("exp10_mha_gqa_mqa.py", set(), ["--chapter-model"]),
    ("exp11_7b_context.py", set(), []),
    ("exp12_batched_decode.py", {MODEL, THREADS}, ["--save-step-costs", "{step_costs}"]),
    ("exp13_batching_sim.py", set(), ["--step-costs", "{step_costs}"]),
    ("exp13_engine.py", {MODEL, THREADS}, []),
    ("exp14_paged_cache.py", {MODEL, THREADS}, []),
    ("exp15_weight_memory.py", {MODEL}, []),
    ("exp16_quant_error.py", {MODEL}, []),
    ("exp17_weight_outliers.py", {MODEL}, []),
    ("exp18_activation_outliers.py", {MODEL}, []),
    ("exp19_int8_activation_levels.py", {MODEL}, []),
    ("exp20_outlier_techniques.py", {MODEL}, []),
    # The two slow ones, lightened to keep the main job under 10 minutes on 2 cores: the
    # 2,048 tokens are scored in two windows of 1,024 (the attention's square cost halves),
    # and the speculative run compares prompt lookup with the best quantized draft only.
    ("exp21_quantized_quality.py", {MODEL}, ["--window", "1024"]),
    # the KV cache's formats on 256 tokens (nine prefills; 1,024 tokens and f16 alone)
    ("exp21_kv_cache_quality.py", {MODEL}, ["--tokens", "256", "--kv-dtypes", "f32", "q8_0",
                                            "q4_0"]),
    ("exp22_speculative_formula.py", set(), []),
    # Experiment 22 trains the distilled drafts on first use (about 3 CPU minutes; cached
    # under weights/drafts/ after that) and races the untrained cut, the T = 1 and the hard
    # one; experiment 23 prints the training of all three students from the same cache.
    ("exp22_speculative.py", {MODEL, THREADS},
     ["--schemes", "int8-row", "--no-layers-draft", "--repeats", "2",
      "--distilled", "cut,soft1,hard"]),
    ("exp23_soft_labels.py", {MODEL, THREADS}, []),
    ("exp24_memory_budget.py", set(), []),
]


def command(script, takes, extra, args, step_costs):
    """-> the argv that runs one entry of the main job."""
    argv = [sys.executable, str(HERE / script)]
    if MODEL in takes and args.model:
        argv += ["--model", args.model]
    if THREADS in takes:
        argv += ["--threads", str(args.threads)]
    return argv + [a.format(step_costs=step_costs) for a in extra]


def cpu_seconds() -> float:
    """CPU time (user + system) of the finished child processes so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


WAITED = 1.2      # wall time above this many times the CPU time: the job waited for a core
OTHER_LOAD = 1.0  # load average this far above the job's own threads: other work was running


def verdict(wall, cpu, loads, threads) -> str:
    """Quiet or busy, and why: from the job's own wall and CPU time and the load it saw.

    >>> verdict(600, 590, [1.0, 1.1], 1)
    'quiet: wall 1.02x CPU, load average 1.0-1.1 for 1 BLAS thread'
    >>> verdict(1039, 559, [2.9, 4.1], 1)
    'BUSY (other work shared the cores): wall 1.86x CPU, load average 2.9-4.1 for 1 BLAS thread'
    """
    known = [x for x in loads if x is not None]
    ratio = wall / cpu if cpu > 0 else float("inf")
    seen = f"load average {min(known):.1f}-{max(known):.1f}" if known else "load average unknown"
    busy = ratio > WAITED or (known and max(known) >= threads + OTHER_LOAD)
    return (f"{'BUSY (other work shared the cores)' if busy else 'quiet'}: wall {ratio:.2f}x "
            f"CPU, {seen} for {threads} BLAS thread{'s' if threads != 1 else ''}")


def markdown(summary, argv, total, cpu_total, judged) -> str:
    """The summary as the Markdown page docs/main-job.md is."""
    rows = "\n".join(f"| {s} | {status} | {wall:.1f} | {cpu:.1f} |"
                      for s, status, wall, cpu in summary.rows)
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return (f"# The main job: what it cost where it ran\n\n"
            f"Written by `python scripts/run_all.py {shlex.join(argv)}` on {when}; "
            "do not edit by hand, run it again.\n\n"
            f"- machine: {os.cpu_count()} CPU cores, {platform.machine()}, "
            f"{platform.python_implementation()} {platform.python_version()}\n"
            f"- total: **{total:.0f} s wall ({total / 60:.1f} min)**, {cpu_total:.0f} s CPU\n"
            f"- {judged}\n\n"
            "On a busy machine the wall time includes waiting for a core; the CPU time is what "
            "the job takes alone.\n\n"
            "| script | status | wall s | CPU s |\n|---|---|---:|---:|\n" + rows + "\n")


def pattern(text):
    """argparse type: --only's regular expression, compiled (a bad one refused when parsed)."""
    try:
        return re.compile(text)
    except re.error as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not a regular expression: {e}") from None


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_argument(parser, default=None)  # None: each script's own default model
    parser.add_argument("--only", type=pattern, default=None, metavar="REGEX",
                        help="run only the scripts whose name matches (e.g. 'exp0[1-8]'; "
                             "one that matches none is an error listing them)")
    parser.add_argument("--threads", type=int, default=1, metavar="N",
                        help="BLAS threads of every timing script (default: 1)")
    parser.add_argument("--report", default=None, metavar="DIR",
                        help="also write DIR/index.html and every table as JSON")
    parser.add_argument("--summary", default=None, metavar="FILE",
                        help="also write the summary (times, load, verdict) as Markdown, e.g. "
                             "docs/main-job.md")
    args = parser.parse_args(argv)
    shown_argv = sys.argv[1:] if argv is None else list(argv)
    job = [entry for entry in MAIN_JOB if not args.only or args.only.search(entry[0])]
    if not job:
        names = ", ".join(dict.fromkeys(script for script, _, _ in MAIN_JOB))
        parser.error(f"--only {args.only.pattern!r} matches none of the main job's scripts: "
                     f"{names}")
    env = dict(os.environ)
    if args.report:
        env[RECORD_ENV] = str(Path(args.report).resolve() / "tables")
        for old in Path(env[RECORD_ENV]).glob("*.json"):
            old.unlink()
    start, cpu_start, loads = time.perf_counter(), cpu_seconds(), [load_average()]
    timings = run_job(job, args, env, loads)
    failed = [script for (script, _, _), (_, status, _, _) in zip(job, timings) if status != "ok"]
    total, cpu_total = time.perf_counter() - start, cpu_seconds() - cpu_start
    judged = verdict(total, cpu_total, loads, args.threads)
    summary = summary_table(timings, failed, args.threads, total, cpu_total, judged)
    os.environ.update({k: v for k, v in env.items() if k == RECORD_ENV})
    summary.show()
    if args.summary:
        Path(args.summary).parent.mkdir(parents=True, exist_ok=True)
        Path(args.summary).write_text(markdown(summary, shown_argv, total, cpu_total, judged))
        say(f"summary: {args.summary}")
    if args.report:
        from _report import write_report
        page = write_report(Path(args.report), title="minitransformer: the chapter's tables")
        say(f"report: {page}")
    return 1 if failed else 0


def run_job(job, args, env, loads) -> list:
    """Each script of the job in its own process, in order; the load average after each
    appended to loads -> (what ran, "ok" or "FAILED (code)", wall s, CPU s) per script."""
    step_costs = Path(tempfile.mkdtemp(prefix="run_all_")) / "step_costs.json"
    timings = []
    for i, (script, takes, extra) in enumerate(job, 1):
        if script == "exp13_batching_sim.py" and not step_costs.is_file():
            extra = []  # experiment 12 did not run: the simulation's default cost model
        argv = command(script, takes, extra, args, step_costs)
        # the step-cost file lives in a temporary folder: named by its role, not its path
        shown = " ".join([script, *argv[2:]]).replace(str(step_costs), "STEP_COSTS.json")
        say(f"=== [{i}/{len(job)}] {shown} ===")
        print(f"\n{'=' * 78}\n{shown}\n{'=' * 78}", flush=True)
        t, cpu = time.perf_counter(), cpu_seconds()
        code = subprocess.run(argv, env=env).returncode
        wall, cpu = time.perf_counter() - t, cpu_seconds() - cpu
        loads.append(load_average())
        timings.append((shown, "ok" if code == 0 else f"FAILED ({code})", wall, cpu))
        say(f"=== {script}: {timings[-1][1]} in {wall:.1f} s (CPU {cpu:.1f} s) ===")
    return timings


def summary_table(timings, failed, threads: int, total: float, cpu_total: float,
                  judged: str) -> Table:
    summary = Table(f"The main job: {len(timings) - len(failed)} of {len(timings)} scripts ran",
                    columns=[("script", ""), ("status", ""), ("wall s", ".1f"),
                             ("CPU s", ".1f")], chapter=False)
    summary.header(f"BLAS threads {threads}; the CPU time is what a script takes on a "
                   "quiet machine (wall time on a shared one includes waiting for a core)")
    for row in timings:
        summary.row(*row)
    summary.note(f"total: {total:.0f} s wall ({total / 60:.1f} min), {cpu_total:.0f} s CPU"
                 + (f"; failed: {', '.join(failed)}" if failed else ""),
                 f"machine: {os.cpu_count()} CPU cores; {judged}")
    return summary


if __name__ == "__main__":
    from _common import run
    run(main)
