"""The main job: every experiment of the chapter, in order, on one model.

Runs each scripts/expNN_*.py in turn (a fresh process each, so one experiment's memory and
timings do not leak into the next), passing --model through. Tables go to stdout, progress and
timing to stderr. Experiment 12 measures the batched step costs that experiment 13's
simulation then uses.
"""
import argparse
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import add_model_argument, default_model, say

HERE = Path(__file__).resolve().parent


def experiments():
    """scripts/expNN_*.py sorted by number (then name)."""
    return sorted(p for p in HERE.glob("exp[0-9][0-9]_*.py"))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_argument(parser)
    parser.add_argument("--only", default=None, metavar="REGEX",
                        help="run only the scripts whose name matches (e.g. 'exp0[1-8]')")
    args = parser.parse_args(argv)
    model = str(args.model or default_model())
    scripts = [p for p in experiments() if not args.only or re.search(args.only, p.name)]
    step_costs = Path(tempfile.mkdtemp()) / "step_costs.json"
    extra = {  # experiment 13's simulation runs at the step costs experiment 12 measured
        "exp12_batched_decode.py": ["--save-step-costs", str(step_costs)],
        "exp13_batching_sim.py": ["--step-costs", str(step_costs)],
    }
    failed, start = [], time.perf_counter()
    for i, script in enumerate(scripts, 1):
        say(f"=== [{i}/{len(scripts)}] {script.name} ===")
        args_for = extra.get(script.name, [])
        if script.name == "exp13_batching_sim.py" and not step_costs.is_file():
            args_for = []  # experiment 12 did not run: the simulation's default cost model
        t = time.perf_counter()
        print(f"\n{'=' * 78}\n{script.stem}\n{'=' * 78}", flush=True)
        # Formula-only experiments (7B-class tables, the speculative formula) take no model.
        takes_model = "add_model_argument" in script.read_text()
        command = [sys.executable, str(script), *(["--model", model] if takes_model else []),
                   *args_for]
        result = subprocess.run(command)
        say(f"=== {script.name}: {'ok' if result.returncode == 0 else 'FAILED'} "
            f"in {time.perf_counter() - t:.1f} s ===")
        if result.returncode != 0:
            failed.append(script.name)
    failures = f"; failed: {', '.join(failed)}" if failed else ""
    say(f"{len(scripts) - len(failed)} of {len(scripts)} experiments ran in "
        f"{time.perf_counter() - start:.0f} s{failures}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
