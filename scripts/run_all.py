"""The main job: every experiment of the chapter, in order.

Runs each script of MAIN_JOB in turn (a fresh process each, so one experiment's memory and
timings do not leak into the next). Tables go to stdout, progress and timing to stderr. Every
script runs on its own default model (the embedded one, or the real one where the script says
so) unless --model is given, which is passed to every script that loads a model. Experiment 12
measures the batched step costs that experiment 13's simulation then uses; experiments 9 and 10
run twice, on the model and on the chapter's Qwen2.5-0.5B shape.

First use, apart: before the experiments, what the selected scripts fetch or make once per
machine (SmolLM2's fetch and import, experiment 21's text, the distilled drafts of experiments
22 and 23: about 3 CPU minutes of training, the k-quant copies of experiments 15, 16 and 21:
about 70 CPU seconds of quantizing, a matrix per core at a time) is made here, each timed on its own, so the
experiments' times are what a second run costs and the first run's extra is said apart. Every
script runs with the BLAS threads the summary names, set in its environment
(OPENBLAS_NUM_THREADS and its kin): --threads N for the timing scripts (their --threads too),
every core for the others, whose tables hold no timings.

The HTML report is written by default (out/report/index.html in the checkout, git-ignored:
one self-contained page, every table, the chapter's figures beside ours, plots; plots need
matplotlib, the 'report' extra) with every table as JSON (tables.json); --report DIR puts it
elsewhere, --no-report leaves it out. Per script the wall time and the CPU time are printed: on
a machine shared with other work the CPU time is what the script would take alone. The job
ends with what it cost: the total, the first use apart, the load average seen between scripts,
and a verdict: a machine is named busy when the job waited for a core (wall time above 1.2x the
CPU time) or other work kept the load average a whole core above the job's own threads.
--summary FILE also writes that summary as Markdown (docs/main-job.md is written so: what the
documentation says the job costs).
"""
import argparse
import os
import platform
import re
import resource
import shlex
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from types import SimpleNamespace

from _common import add_model_argument, model_name, model_path, say
from _table import RECORD_ENV, Table

from minitransformer.kernels import threads
from minitransformer.measure.timing import load_average

HERE = Path(__file__).resolve().parent
REPORT = HERE.parent / "out" / "report"   # the default report's folder: git-ignored (/out/)
MODEL, THREADS = "model", "threads"      # what a script takes: --model PATH, --threads N
# The environment variables that set a BLAS's threads when it loads (OpenBLAS, OpenMP, MKL)
THREAD_VARIABLES = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
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
    ("exp11_sliding_window.py", {MODEL}, []),
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
    # The slow ones, lightened to keep the main job under 10 minutes on 2 cores: experiment
    # 21 scores 1,024 tokens in one window (half its 2,048; each scheme's perplexity ratio to
    # fp32's is printed with its paired 95% interval, which says what 1,024 tokens decide),
    # and the speculative run compares prompt lookup with the best quantized draft only.
    ("exp21_quantized_quality.py", {MODEL}, ["--tokens", "1024"]),
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


# What scripts of the job fetch or make once per machine, made before the job (first_use).
USES_SMOLLM2 = {  # by default (--model not given), or as experiment 4's long prefill's model
    "exp04_cache_memory.py", "exp16_quant_error.py", "exp17_weight_outliers.py",
    "exp18_activation_outliers.py", "exp19_int8_activation_levels.py",
    "exp20_outlier_techniques.py", "exp21_quantized_quality.py", "exp21_kv_cache_quality.py",
    "exp22_speculative.py", "exp23_soft_labels.py"}
USES_TEXT = {"exp21_quantized_quality.py", "exp21_kv_cache_quality.py"}
USES_DRAFTS = {"exp22_speculative.py", "exp23_soft_labels.py"}
# The k-quant copies a script makes by default (its model when --model is not given, the
# schemes): quantized once per machine and kept under weights/quantized/ (quant/gguf_weight.py)
KQUANTS = ("q2_k", "q3_k", "q4_k", "q5_k", "q6_k")
USES_KQUANTS = {"exp15_weight_memory.py": ("default", KQUANTS),
                "exp16_quant_error.py": ("smollm2", KQUANTS),
                "exp21_quantized_quality.py": ("smollm2", ("q4_k", "q5_k", "q6_k"))}


def command(script, takes, extra, args, step_costs):
    """-> the argv that runs one entry of the main job."""
    argv = [sys.executable, str(HERE / script)]
    if MODEL in takes and args.model:
        argv += ["--model", args.model]
    if THREADS in takes:
        argv += ["--threads", str(threads_of(takes, args))]
    return argv + [a.format(step_costs=step_costs) for a in extra]


def threads_of(takes, args) -> int:
    """The BLAS threads a script of the job runs with: --threads for the timing scripts (0:
    every core, the library's own choice), every core for the others (no timings in their
    tables: the cores only shorten the wait). Every core is the library's one count
    (kernels/threads.py: $MT_THREADS, else the cores this process may use)."""
    return args.threads if THREADS in takes and args.threads > 0 else threads.count()


def with_threads(env, threads: int) -> dict:
    """env with the BLAS's thread count set, read when the script's NumPy loads its BLAS."""
    return env | dict.fromkeys(THREAD_VARIABLES, str(threads))


def cpu_seconds() -> float:
    """CPU time (user + system) of this process and its finished children so far."""
    usage = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    return sum(u.ru_utime + u.ru_stime for u in usage)


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


def markdown(summary, argv, total, cpu_total, judged, firsts) -> str:
    """The summary as the Markdown page docs/main-job.md is."""
    rows = "\n".join(f"| {s} | {status} | {threads} | {wall:.1f} | {cpu:.1f} |"
                      for s, status, threads, wall, cpu in summary.rows)
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return (f"# The main job: what it cost where it ran\n\n"
            f"Written by `python scripts/run_all.py {shlex.join(argv)}` on {when}; "
            "do not edit by hand, run it again.\n\n"
            f"- machine: {os.cpu_count()} CPU cores, {platform.machine()}, "
            f"{platform.python_implementation()} {platform.python_version()}\n"
            f"- total: **{total:.0f} s wall ({total / 60:.1f} min)**, {cpu_total:.0f} s CPU\n"
            f"- first use, apart (once per machine): {first_use_line(firsts)}\n"
            f"- {judged}\n\n"
            "On a busy machine the wall time includes waiting for a core; the CPU time is what "
            "the job takes alone. BLAS threads: what the script ran with (set in its "
            "environment; the timing scripts' --threads too).\n\n"
            "| script | status | BLAS threads | wall s | CPU s |\n|---|---|---:|---:|---:|\n"
            + rows + "\n")


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
                        help="BLAS threads of every timing script (default: 1; 0: every core); "
                             "the others run on every core ($MT_THREADS, else the cores this "
                             "process may use)")
    parser.add_argument("--report", default=str(REPORT), metavar="DIR",
                        help="where the HTML report (DIR/index.html) and every table as JSON "
                             "go (default: out/report in the checkout, ignored by git)")
    parser.add_argument("--no-report", action="store_true", help="write no report")
    parser.add_argument("--summary", default=None, metavar="FILE",
                        help="also write the summary (times, load, verdict) as Markdown, e.g. "
                             "docs/main-job.md")
    args = parser.parse_args(argv)
    shown_argv = sys.argv[1:] if argv is None else list(argv)
    report = None if args.no_report else Path(args.report).resolve()
    job = [entry for entry in MAIN_JOB if not args.only or args.only.search(entry[0])]
    if not job:
        names = ", ".join(dict.fromkeys(script for script, _, _ in MAIN_JOB))
        parser.error(f"--only {args.only.pattern!r} matches none of the main job's scripts: "
                     f"{names}")
    env = dict(os.environ)
    if report:
        env[RECORD_ENV] = str(report / "tables")
        for old in Path(env[RECORD_ENV]).glob("*.json"):
            old.unlink()
    firsts = first_use(job, args, env)
    start, cpu_start, loads = time.perf_counter(), cpu_seconds(), [load_average()]
    timings = run_job(job, args, env, loads)
    failed = [script for (script, _, _), (_, status, *_) in zip(job, timings, strict=True)
              if status != "ok"]
    total, cpu_total = time.perf_counter() - start, cpu_seconds() - cpu_start
    judged = verdict(total, cpu_total, loads, max((t[2] for t in timings), default=1))
    summary = summary_table(timings, failed, total, cpu_total, judged, firsts)
    os.environ.update({k: v for k, v in env.items() if k == RECORD_ENV})
    summary.show()
    if args.summary:
        Path(args.summary).parent.mkdir(parents=True, exist_ok=True)
        Path(args.summary).write_text(markdown(summary, shown_argv, total, cpu_total, judged,
                                               firsts))
        say(f"summary: {args.summary}")
    if report:
        from _report import write_report
        page = write_report(report, title="minitransformer: the chapter's tables")
        say(f"report: {page} (open it in a browser; --no-report leaves it out)")
    say(f"the job cost {total:.0f} s wall ({total / 60:.1f} min), {cpu_total:.0f} s CPU; "
        f"first use, apart: {first_use_line(firsts)}")
    return 1 if failed else 0


def first_use(job, args, env) -> list:
    """Fetch or make what the job's scripts need once per machine and lack, each timed on its
    own from its start -> [(what, wall s, CPU s)], empty when everything was there. The model a
    script is given (--model, else SmolLM2 for the scripts that default to it) and the drafts
    trained on it. Each need is asked after the one before is made: asking whether SmolLM2's
    drafts or k-quant copies are there needs SmolLM2, so it is fetched first, in its own time
    (asked before, the fetch fell outside every step's time: its line said 0 s)."""
    from minitransformer.checkpoints.real_model import NAME, is_imported
    from minitransformer.checkpoints.synth import weights_dir
    from minitransformer.measure.text import cache_path
    names = {script for script, _, _ in job}
    model = args.model or "smollm2"
    firsts = []

    def make(what, action):
        say(f"=== first use: {what} ... ===")
        t, cpu = time.perf_counter(), cpu_seconds()
        action()
        firsts.append((what, time.perf_counter() - t, cpu_seconds() - cpu))
        say(f"=== first use: {what} in {firsts[-1][1]:.1f} s (CPU {firsts[-1][2]:.1f} s) ===")

    if names & USES_SMOLLM2 and model == "smollm2" and not is_imported(weights_dir() / NAME):
        make(f"{NAME}: fetched and imported", lambda: model_path("smollm2"))
    if names & USES_TEXT and not cache_path().is_file():
        make("experiment 21's text: fetched", fetch_text)
    if names & USES_DRAFTS and not drafts_there(model):
        make("the distilled drafts: trained", lambda: train_drafts(model, args, env))
    for name, schemes in kquants_of(names, args.model).items():
        schemes = [s for s in schemes if keeps_kquants(name) and not kquants_there(name, s)]
        if schemes:
            make(f"the k-quant copies of {model_name(name)} ({', '.join(schemes)}): quantized",
                 lambda name=name, schemes=schemes: quantize_kquants(
                     name, schemes, threads_of(set(), args)))
    return firsts


def fetch_text():
    """Experiment 21's text, fetched; offline, its scripts say so and what to do."""
    from minitransformer.measure.text import evaluation_text
    try:
        evaluation_text()
    except ValueError as e:
        say(f"note: {e}")


def drafts_there(model) -> bool:
    """Whether the distilled drafts of this model (with the scripts' default settings) are
    already trained and cached, or no drafts would be trained on it (too few layers)."""
    from minitransformer.config import load_config
    from minitransformer.drafts.students import Settings, students_file
    path = Path(model_path(model))
    if not (path / "config.json").is_file():
        return True    # a .gguf file or no checkpoint at all: the scripts themselves say
    settings = Settings()
    return (load_config(path).num_hidden_layers <= settings.layers
            or students_file(SimpleNamespace(path=str(path)), settings).is_file())


def kquants_of(names, model) -> dict:
    """{model: the k-quant schemes the job's scripts quantize it to}, in MAIN_JOB's order;
    empty where nothing is kept (MT_QUANT_CACHE=off: each script quantizes in its own time)."""
    if os.environ.get("MT_QUANT_CACHE") == "off":
        return {}
    wanted = {}
    for script, (own, schemes) in USES_KQUANTS.items():
        if script in names:
            wanted.setdefault(model or own, []).extend(
                s for s in schemes if s not in wanted.get(model or own, []))
    return wanted


def kquants_stamp(model, scheme) -> Path:
    """The note run_all leaves once it has made this k-quant copy of this model: named by
    the quantizers' source, the scheme and the model's files (name, size, time). Only the
    first-use line reads it; the scripts read or make each matrix's blocks themselves, so a
    stale note costs the quantizing inside their times, never a wrong number."""
    import hashlib

    from minitransformer.checkpoints.synth import weights_dir
    from quant.gguf_weight import quantizers_digest
    path = Path(model_path(model))
    files = sorted(p for p in ([path] if path.is_file() else path.glob("*")) if p.is_file())
    key = repr((quantizers_digest(), scheme,
                [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files]))
    return weights_dir() / "quantized" / f"made-{hashlib.sha1(key.encode()).hexdigest()[:20]}"


def keeps_kquants(model) -> bool:
    """Whether any projection matrix of the model is large enough to be kept once quantized
    (a tiny test model's are not: each script quantizes them in no time, nothing to note)."""
    from minitransformer.config import load_config
    from quant.gguf_weight import KEPT_WEIGHTS
    path = Path(model_path(model))
    if not (path / "config.json").is_file():
        return True    # a .gguf file: its matrices are not known before it loads
    c = load_config(path)
    return c.intermediate_size * c.hidden_size >= KEPT_WEIGHTS


def kquants_there(model, scheme) -> bool:
    return kquants_stamp(model, scheme).is_file()


def quantize_kquants(model, schemes, threads: int):
    """Every projection matrix of the model under each k-quant scheme, kept under
    weights/quantized/ (what experiments 15, 16 and 21 would otherwise quantize in their own
    time on first use), each scheme's note left once it is done; `threads` matrices at a time
    (quantize_scheme)."""
    from minitransformer.loader import load
    loaded = load(model_path(model))
    for i, scheme in enumerate(schemes, 1):
        say(f"[{i}/{len(schemes)}] {model_name(model)}: {scheme} ...")
        quantize_scheme(loaded.weights, scheme, threads)
        stamp = kquants_stamp(model, scheme)
        stamp.parent.mkdir(parents=True, exist_ok=True)
        stamp.write_text(f"{model_name(model)}: {scheme}\n")


def quantize_scheme(weights, scheme: str, threads: int) -> None:
    """The blocks of every projection matrix under one k-quant scheme, made and kept
    (gguf_weight.kept_blocks: the very bytes a script's quantize_model then reads back), the
    matrices shared among `threads` threads: NumPy lets go of the interpreter's lock inside
    its loops over a matrix's blocks, so each thread quantizes a matrix of its own on a core
    of its own. Each matrix is the same calls on the same floats as one thread would make."""
    from concurrent.futures import ThreadPoolExecutor

    from quant.gguf_weight import kept_blocks, stored_type
    from quant.qmodel import projection_names
    from quant.scales import check_weight
    from quant.schemes import check_scheme
    kind = check_scheme(scheme).gguf

    def quantize(name):
        w = check_weight(weights[name])                      # float32 (out, in), on the host
        kept_blocks(w, stored_type(kind, w.shape[1]))

    with ThreadPoolExecutor(max(1, threads)) as pool:
        list(pool.map(quantize, projection_names(weights)))  # list(): a failure is raised


def train_drafts(model, args, env):
    """scripts/train_draft.py, in a process of its own, at the timing scripts' threads."""
    threads = threads_of({THREADS}, args)
    subprocess.run([sys.executable, str(HERE / "train_draft.py"), "--model", model,
                    "--threads", str(threads)], env=with_threads(env, threads))


def first_use_line(firsts) -> str:
    """'none (everything was there)' or each thing made, its wall and CPU time."""
    if not firsts:
        return "none (everything was there)"
    return "; ".join(f"{what} in {wall:.0f} s ({cpu:.0f} s CPU)" for what, wall, cpu in firsts)


def run_job(job, args, env, loads) -> list:
    """Each script of the job in its own process, in order; the load average after each
    appended to loads -> (what ran, "ok" or "FAILED (code)", BLAS threads, wall s, CPU s) per
    script."""
    step_costs = Path(tempfile.mkdtemp(prefix="run_all_")) / "step_costs.json"
    timings = []
    for i, (script, takes, extra) in enumerate(job, 1):
        if script == "exp13_batching_sim.py" and not step_costs.is_file():
            extra = []  # experiment 12 did not run: the simulation's default cost model
        argv = command(script, takes, extra, args, step_costs)
        threads = threads_of(takes, args)
        shown = shown_command(script, argv, args, step_costs)
        say(f"=== [{i}/{len(job)}] {shown} ===")
        print(f"\n{'=' * 78}\n{shown}\n{'=' * 78}", flush=True)
        t, cpu = time.perf_counter(), cpu_seconds()
        code = subprocess.run(argv, env=with_threads(env, threads)).returncode
        wall, cpu = time.perf_counter() - t, cpu_seconds() - cpu
        loads.append(load_average())
        timings.append((shown, "ok" if code == 0 else f"FAILED ({code})", threads, wall, cpu))
        say(f"=== {script}: {timings[-1][1]} in {wall:.1f} s (CPU {cpu:.1f} s, "
            f"{threads} BLAS thread{'s' if threads != 1 else ''}) ===")
    return timings


def shown_command(script, argv, args, step_costs) -> str:
    """How the summary names what ran: no path of this machine. The step-cost file (in a
    temporary folder) by its role, a --model path by its folder's name, as tables name it."""
    shown = " ".join([script, *argv[2:]]).replace(str(step_costs), "STEP_COSTS.json")
    if args.model and args.model in argv:
        shown = shown.replace(f"--model {args.model}", f"--model {model_name(args.model)}")
    return shown


def summary_table(timings, failed, total: float, cpu_total: float, judged: str,
                  firsts) -> Table:
    summary = Table(f"The main job: {len(timings) - len(failed)} of {len(timings)} scripts ran",
                    columns=[("script", ""), ("status", ""), ("BLAS threads", "d"),
                             ("wall s", ".1f"), ("CPU s", ".1f")], chapter=False)
    summary.header("BLAS threads: what each script ran with; the CPU time is what a script "
                   "takes on a quiet machine (wall time on a shared one includes waiting for a "
                   "core)")
    for row in timings:
        summary.row(*row)
    summary.note(f"total: {total:.0f} s wall ({total / 60:.1f} min), {cpu_total:.0f} s CPU"
                 + (f"; failed: {', '.join(failed)}" if failed else ""),
                 f"first use, apart (once per machine): {first_use_line(firsts)}",
                 f"machine: {os.cpu_count()} CPU cores; {judged}")
    return summary


if __name__ == "__main__":
    from _common import run
    run(main)
