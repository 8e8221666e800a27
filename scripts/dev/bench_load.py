"""Benchmark: what a model's load costs with the layouts and routes measured, remembered, or not.

Building a model lays out each weight as its products run fastest on this machine and times
the routes to multiply it (minitransformer/kernels/blas.py), and keeps the answers in a file per
machine (kernels/tuning.py). Each load here runs in a fresh process, as a command's does, with
its own file, in four settings side by side (each round loads once in each, so a burst of load
elsewhere hits them alike); the fastest and the median of --repeat rounds are printed, wall and
CPU seconds of `mt.load` alone (not Python's start nor the import), and each setting against
row-major in the same round (the median over rounds: on a busy machine the steadier figure):

  row-major    MT_LAYOUT=row-major: the checkpoint's layout, nothing measured (the baseline)
  remembered   the file already holds every shape: read, nothing measured
  first        an empty file, as on a new machine: every shape measured, then kept
  unkept       MT_TUNING=off: every shape measured at every load (the library before the file)

Targets: remembered within 1.5x of row-major; first at most 3 s over row-major. --max-num-seqs N
loads as `serve --max-num-seqs N` does (its decode step's N rows measured too). The threads are
the library's own by default, as the command line loads (--threads N to fix them).
This is a benchmark, never a test: its targets are printed, not asserted.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: _common, _table

from _common import Progress, add_model_argument, add_timing_arguments, model_path, say
from _table import Table

from minitransformer.measure.timing import (
    Timing,
    limit_threads,
    load_average,
    machine,
    where_it_ran,
)

ROOT = Path(__file__).resolve().parents[2]
SETTINGS = {"row-major": "MT_LAYOUT=row-major: the checkpoint's layout, nothing measured",
            "remembered": "the file holds every shape: read, nothing measured",
            "first": "an empty file (a new machine): every shape measured, then kept",
            "unkept": "MT_TUNING=off: measured at every load (before the file)"}
# One load in a fresh process: wall and CPU seconds of mt.load alone, as JSON on stdout.
LOAD = """
import json, sys, time
from minitransformer.measure.timing import limit_threads
from minitransformer.kernels.blas import expect_rows
import minitransformer as mt
path, threads, rows = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
limit_threads(threads or None)
if rows:
    expect_rows(rows)
wall, cpu = time.perf_counter(), time.process_time()
mt.load(path)
print(json.dumps({"wall": time.perf_counter() - wall, "cpu": time.process_time() - cpu}))
"""


def environment(setting: str, folder: Path, round_: int) -> dict:
    """The child's environment for one setting: its own tuning file in `folder` (an empty one per
    round for 'first'), and nothing of the caller's that would fix a layout or a route."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("MT_LAYOUT", "MT_PRODUCTS", "MT_TUNING", "MT_TUNING_CACHE")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    name = f"first-{round_}.json" if setting == "first" else "tuning.json"
    env["MT_TUNING_CACHE"] = str(folder / name)
    if setting == "row-major":
        env["MT_LAYOUT"] = "row-major"
    if setting == "unkept":
        env["MT_TUNING"] = "off"
    return env


def load_once(path: str, args, env: dict) -> dict:
    """{"wall": s, "cpu": s} of one load in a fresh process."""
    done = subprocess.run([sys.executable, "-c", LOAD, path, str(args.threads),
                           str(args.max_num_seqs or 0)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise ValueError(f"a load failed: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_argument(parser, default="smollm2")
    add_timing_arguments(parser, repeat=3, runs="rounds of the four loads")
    parser.add_argument("--threads", type=int, default=0, metavar="N",
                        help="BLAS threads in each load (default: 0, the library's own, as "
                             "the command line loads)")
    parser.add_argument("--max-num-seqs", type=int, default=None, metavar="N",
                        help="load as `serve --max-num-seqs N` does (default: as generate)")
    args = parser.parse_args(argv)
    if args.threads < 0 or (args.max_num_seqs is not None and args.max_num_seqs < 1):
        parser.error("--threads must be >= 0 and --max-num-seqs >= 1")
    path = model_path(args.model)
    samples, ran_on = {setting: [] for setting in SETTINGS}, machine()
    with tempfile.TemporaryDirectory(prefix="bench-load-") as folder:
        say("filling the 'remembered' setting's file (one load, not timed) ...")
        load_once(path, args, environment("remembered", Path(folder), 0))
        progress = Progress(args.repeat * len(SETTINGS), "loads")
        for round_ in range(args.repeat):
            for setting in SETTINGS:
                child = environment(setting, Path(folder), round_)
                samples[setting].append(load_once(path, args, child))
                progress(setting)
    show(args, path, samples, ran_on)


def show(args, path, samples, ran_on):
    wall = {setting: Timing(tuple(s["wall"] for s in runs)) for setting, runs in samples.items()}
    cpu = {setting: Timing(tuple(s["cpu"] for s in runs)) for setting, runs in samples.items()}
    base = wall["row-major"].best
    ratio, more = per_round(samples)
    table = Table(f"Benchmark: loading {Path(path).name}, layouts and routes measured, "
                  "remembered or not", columns=[
                      ("load", ""), ("best s", ".2f"), ("median s", ".2f"),
                      ("CPU s", ".2f"), ("x row-major", lambda v: f"{v:.2f}x"),
                      ("+ s", "+.2f"), ("x per round", lambda v: f"{v:.2f}x"),
                      ("+ s per round", "+.2f")], chapter=False)
    rows = f", measured for {args.max_num_seqs} rows too (serve)" if args.max_num_seqs else ""
    threads = limit_threads(None) if not args.threads else f"BLAS threads: {args.threads} (set)"
    table.header(f"mt.load in a fresh process per load, four settings side by side, the fastest "
                 f"and the median of {args.repeat} rounds (wall), CPU the fastest{rows}",
                 f"machine: {ran_on}, {load_average():.1f} at end; {threads} "
                 f"in the loads", where_it_ran())
    for setting, text in SETTINGS.items():
        best = wall[setting].best
        table.row(f"{setting}: {text}", best, wall[setting].median, cpu[setting].best,
                  best / base, best - base, ratio[setting], more[setting])
    table.note("x row-major, + s: the fastest load against row-major's fastest; per round: "
               "against row-major's load of the same round, the median over rounds",
               f"targets: remembered <= 1.5x row-major (here {wall['remembered'].best / base:.2f}"
               f"x, {ratio['remembered']:.2f}x per round); first <= row-major + 3 s (here "
               f"{wall['first'].best - base:+.2f} s, {more['first']:+.2f} s per round)")
    table.show()


def per_round(samples: dict) -> tuple:
    """Each setting's wall seconds against row-major's of the same round -> ({setting: the median
    ratio}, {setting: the median difference in seconds}).

    >>> per_round({"row-major": [{"wall": 1.0}, {"wall": 2.0}, {"wall": 1.0}],
    ...            "first": [{"wall": 3.0}, {"wall": 3.0}, {"wall": 2.5}]})
    ({'row-major': 1.0, 'first': 2.5}, {'row-major': 0.0, 'first': 1.5})
    """
    base = [s["wall"] for s in samples["row-major"]]
    ratio = {setting: statistics.median(s["wall"] / b for s, b in zip(runs, base, strict=True))
             for setting, runs in samples.items()}
    more = {setting: statistics.median(s["wall"] - b for s, b in zip(runs, base, strict=True))
            for setting, runs in samples.items()}
    return ratio, more


if __name__ == "__main__":
    from _common import run
    run(main)
