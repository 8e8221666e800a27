"""Mutation testing of the modules that carry the claims, with mutmut 3 (the 'mutation' extra).

A test suite earns trust when breaking the code makes it fail. mutmut breaks one thing at a time
(a comparison flipped, a constant off by one, an argument dropped, a statement made a no-op),
runs the tests that reach the broken function, and records whether they failed ("killed") or
passed ("survived"). A survivor is a property no test checks, or an equivalent mutant: a change
that cannot alter any result (each is listed in the ledgers, with the reason).

Each module runs on its own: a scratch copy of the tree in out/mutation/<module>/, mutmut's
shared settings from setup.cfg's [mutmut] section plus the module to mutate and the test files
that cover it (the ledgers, below; each mutant runs only the tests that reach it, stopping at the
first failure), then the outcome read from mutmut's records. Prints one row per module on
stdout (mutants, killed, survived, equivalent, no tests, timeout) with the equivalent mutants and
their reasons under the table; every survivor that is not listed as equivalent goes to stderr
with its diff, and to out/mutation/<module>/survivors.txt. Not in CI and not in the default test
run: a minute or more per module on one core. On a shared machine:

    nice -n 10 python3 scripts/dev/mutation.py sampling speculative --markdown out/mutation.md

The exit status is 1 when a survivor is neither killed nor listed as equivalent.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from configparser import ConfigParser
from fnmatch import fnmatch
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: _common, _table

from _common import run, say
from _table import Table

ROOT = Path(__file__).resolve().parents[2]
# what the tests read of the checkout (test_install builds the wheel from setup.py and copies
# weights/README.md, the one tracked file of the weights folder)
COPIED = ("minitransformer", "quant", "sim", "tests", "scripts", "setup.cfg", "setup.py",
          "pyproject.toml", "README.md", "weights/README.md")

# The ledgers, kept as data beside the tests they describe: each room's mutants.json (LEDGERS, in
# this order) holds the modules mutated there (module -> its file, the test files that cover it,
# pytest's -k filter or "", and why, where the choice needs a word), each module's equivalent
# mutants (mutant name -> why no test can tell it from the original; a name is mutmut's: the
# module, the function (x_NAME, or xǁCLASSǁNAME for a method) and the mutant's number in that
# function), and the second corpus, "planted": bugs planted by hand, one line each, of the kinds a
# reviewer plants in the newest features (a block boundary off by one, a wrong sign, a dropped
# term, a check skipped), each with the tests that must fail. `--planted` applies them one at a
# time to a scratch copy and runs those tests (and the file's doctests): every one must fail. A
# line no longer in its file is "stale".
LEDGERS = ("tests/mutants.json", "tests/formats/mutants.json", "tests/drafts/mutants.json",
           "tests/serve/mutants.json", "tests/scripts/mutants.json")


def read_ledgers() -> tuple:
    """-> MODULES {module: (file, tests, filter)}, EQUIVALENT {mutant: why} and PLANTED [(feature,
    bug, file, line as it is, line broken, tests)], read from LEDGERS in order."""
    modules, equivalent, planted = {}, {}, []
    for ledger in LEDGERS:
        held = json.loads((ROOT / ledger).read_text(encoding="utf-8"))
        for name, module in held.get("modules", {}).items():
            modules[name] = (module["file"], module["tests"], module["filter"])
            equivalent.update(module["equivalent"])
        planted += [(bug["feature"], bug["bug"], bug["file"], bug["line"], bug["broken"],
                     bug["tests"]) for bug in held.get("planted", [])]
    return modules, equivalent, planted


MODULES, EQUIVALENT, PLANTED = read_ledgers()


# mutmut's exit codes -> outcome (mutmut/stats.py, status_by_exit_code)
OUTCOMES = {1: "killed", 3: "killed", 0: "survived", 5: "no tests", 33: "no tests",
            34: "skipped", 36: "timeout", 24: "timeout", -24: "timeout", 152: "timeout",
            255: "timeout", 37: "killed", None: "not checked"}


def prepare(name, scratch: Path, mode: str) -> Path:
    """The scratch copy for one module -> the path of mutmut's records of it.

    mode "fresh": a new copy of the tree; "resume": keep an earlier run's copy and records and
    go on where it stopped; "recheck": keep the records, but bring in the current tree (library
    and tests alike, as the current tests may need the current library) and judge the survivors
    again. mutmut keeps each function's record only while the function's code is unchanged (it
    stores a hash of each), so a function changed since the run has its mutants run again and
    a function removed has its mutants dropped."""
    path = MODULES[name][0]
    meta = scratch / "mutants" / (path + ".meta")
    if mode != "fresh" and not meta.is_file():
        raise ValueError(f"{name}: no earlier run in {scratch} to {mode}")
    if mode == "resume":
        return meta
    if mode == "fresh":
        if scratch.exists():
            shutil.rmtree(scratch)
        scratch.mkdir(parents=True)
        for item in COPIED:
            copy(ROOT / item, scratch / item)
        # mutmut copies the tree into scratch/mutants/ and runs from there; it must exist
        # before Python starts, or the import system remembers it as missing
        (scratch / "mutants").mkdir()
        link_shared(scratch)                          # ../shared of scratch/mutants/
    else:
        refresh(scratch, path)
        records = json.loads(meta.read_text())
        codes = records["exit_code_by_key"]
        again = {0, 5, 33}                           # survived, or reached by no test yet
        records["exit_code_by_key"] = {m: None if c in again else c for m, c in codes.items()}
        meta.write_text(json.dumps(records, indent=4))
    configure(name, scratch)
    return meta


def refresh(scratch: Path, path: str) -> None:
    """The current tree brought into an earlier run's scratch copy, keeping mutmut's records.

    mutmut copies the tree into scratch/mutants/ only where a file is missing there, and makes
    the mutants of a module again only when its source is newer than its mutants: so everything
    in mutants/ but the records (.meta, .spans) goes, and the module is copied with a new time.
    The stale copies would otherwise be what the tests import (a test of a name the tree gained
    since the run failing on import, and every mutant with it)."""
    for item in COPIED:
        copy(ROOT / item, scratch / item)
    shutil.copy(ROOT / path, scratch / path)            # a new modification time
    for item in (scratch / "mutants").iterdir():
        if item.is_dir():
            for file in [f for f in item.rglob("*") if f.is_file()]:
                if file.suffix not in (".meta", ".spans"):
                    file.unlink()
        else:
            item.unlink()


def link_shared(folder: Path) -> None:
    """The checkout's ../shared (the tiny real model the tests load, when it is there) made
    visible from `folder` as folder/shared: a copy's tests look for it two folders above
    their conftest.py, as the checkout's do (tests/conftest.py's STORIES). Without it, every
    test of the real model skips in the copy, and a bug only they catch passes."""
    shared, link = ROOT.parent / "shared", folder / "shared"
    if shared.is_dir() and not link.exists():
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(shared.resolve(), target_is_directory=True)


def copy(source: Path, target: Path) -> None:
    if target.is_dir():
        shutil.rmtree(target)
    if source.is_dir():
        shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    elif source.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target)


def configure(name, scratch: Path) -> None:
    """scratch/setup.cfg's [mutmut] section told what to mutate and which tests to run."""
    path, tests, keyword = MODULES[name]
    missing = [t for t in tests if not (ROOT / t).is_file()]
    tests = [t for t in tests if t not in missing] + [path]  # + the module's own doctests
    if missing:
        say(f"{name}: no {', '.join(missing)} here; running without")
    config = ConfigParser()
    config.read(scratch / "setup.cfg")
    if not config.has_section("mutmut"):
        raise ValueError("setup.cfg has no [mutmut] section")
    config["mutmut"]["only_mutate"] = path
    config["mutmut"]["pytest_add_cli_args_test_selection"] = "\n" + "\n".join(
        tests + (["-k", keyword] if keyword else []))
    with open(scratch / "setup.cfg", "w") as f:
        config.write(f)


def mutate(name, scratch: Path, children: int, mode: str, only=()) -> dict:
    """Run mutmut on one module (only the mutants whose names match a pattern of `only`, if
    any: the others stay as recorded) -> {mutant name: outcome}."""
    meta = prepare(name, scratch, mode)
    env = dict(os.environ, PYTHONPATH=str(scratch / "mutants"))  # subprocesses see the mutants
    with open(scratch / "mutmut.log", "w" if mode == "fresh" else "a") as log:
        done = subprocess.run(["mutmut", "run", "--max-children", str(children), *only],
                              cwd=scratch,
                              env=env, stdout=log, stderr=subprocess.STDOUT)
    if not meta.is_file():
        raise ValueError(f"{name}: mutmut made no records (exit status {done.returncode}); "
                         f"see {scratch / 'mutmut.log'}")
    return recorded(name, scratch)


def recorded(name, scratch: Path) -> dict:
    """{mutant name: outcome} from mutmut's records of a run in scratch/."""
    meta = scratch / "mutants" / (MODULES[name][0] + ".meta")
    if not meta.is_file():
        raise ValueError(f"{name}: no run recorded in {scratch}")
    codes = json.loads(meta.read_text())["exit_code_by_key"]
    return {mutant: OUTCOMES.get(code, "suspicious") for mutant, code in codes.items()}


def diff(mutant, scratch: Path) -> str:
    shown = subprocess.run(["mutmut", "show", mutant], cwd=scratch, capture_output=True,
                           text=True, env=dict(os.environ, PYTHONPATH=str(scratch / "mutants")))
    return shown.stdout.strip()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("modules", nargs="*", default=list(MODULES), metavar="MODULE",
                        help=f"modules to mutate (default: all of {', '.join(MODULES)})")
    parser.add_argument("--children", type=int, default=1,
                        help="mutants tested at once (default: 1, for a shared machine)")
    parser.add_argument("--out", default=str(ROOT / "out" / "mutation"),
                        help="scratch folder, one copy of the tree per module "
                             "(default: %(default)s)")
    parser.add_argument("--resume", dest="mode", action="store_const", const="resume",
                        default="fresh",
                        help="go on where a stopped run left off (its copy and records in "
                             "--out) instead of starting afresh")
    parser.add_argument("--recheck", dest="mode", action="store_const", const="recheck",
                        help="judge an earlier run's survivors (and the mutants no test "
                             "reached) again against the current tree (the killed stay "
                             "killed where their function is unchanged; a changed function's "
                             "mutants run again)")
    parser.add_argument("--only", action="append", default=[], metavar="PATTERN",
                        help="run only the mutants whose names match PATTERN (fnmatch, as "
                             "mutmut's own: '*x_speculative_generate__*'), the rest left as "
                             "recorded or not run; with --planted, only the bugs whose "
                             "'feature: bug' matches ('prefix cache: *'); may be given again")
    parser.add_argument("--table", dest="mode", action="store_const", const="table",
                        help="run nothing: the table of the runs recorded in --out")
    parser.add_argument("--planted", action="store_true",
                        help="run no mutmut: apply each bug the ledgers plant (hand-made, "
                             "one line each) to a scratch copy in --out/planted and run its "
                             "tests")
    parser.add_argument("--markdown", metavar="FILE", help="also write the table as Markdown")
    args = parser.parse_args(argv)
    if args.planted:
        return planted(Path(args.out) / "planted", args.markdown, args.only)
    unknown = [m for m in args.modules if m not in MODULES]
    if unknown:
        parser.error(f"unknown module {', '.join(unknown)}; choose from {', '.join(MODULES)}")
    if args.children < 1:
        parser.error("--children must be >= 1")
    if shutil.which("mutmut") is None:
        parser.error("mutmut is not installed: python3 -m pip install -e '.[mutation]'")
    table = Table("Mutation testing: mutmut's mutants of each module, against its tests",
                  columns=[("module", ""), ("mutants", "d"), ("killed", "d"),
                           ("survived", "d"), ("equivalent", "d"), ("no tests", "d"),
                           ("timeout", "d"), ("not run yet", "d"), ("seconds", ".0f")],
                  chapter=False)
    version = subprocess.run(["mutmut", "--version"], capture_output=True, text=True).stdout
    table.header(f"{version.strip()}; each mutant runs the listed tests that reach it "
                 "(the ledgers, tests/**/mutants.json)")
    unexplained, equivalents = 0, []
    for name in args.modules:
        scratch = Path(args.out) / name
        if args.mode != "table":
            say(f"{name}: mutating {MODULES[name][0]} (log: {scratch / 'mutmut.log'})")
        start = time.perf_counter()
        outcomes = recorded(name, scratch) if args.mode == "table" else \
            mutate(name, scratch, args.children, args.mode, args.only)
        count = {o: sum(1 for v in outcomes.values() if v == o)
                 for o in ("killed", "survived", "no tests", "timeout", "not checked")}
        survivors = [m for m, o in outcomes.items() if o == "survived"]
        equivalent = [m for m in survivors if m in EQUIVALENT]
        alive = [m for m in survivors if m not in EQUIVALENT]
        stale = stale_equivalents(name, outcomes)
        table.row(MODULES[name][0], len(outcomes), count["killed"], len(alive),
                  len(equivalent), count["no tests"], count["timeout"], count["not checked"],
                  None if args.mode == "table" else time.perf_counter() - start)
        equivalents += [f"{m}: {EQUIVALENT[m]}" for m in equivalent]
        shown = [diff(m, scratch) for m in alive]
        if args.mode != "table":
            (scratch / "survivors.txt").write_text("\n\n".join(shown) + "\n")
        for text in shown:
            say(text)
        for m in stale:
            say(f"{m}: listed as equivalent but {outcomes.get(m, 'not made')}: "
                "update EQUIVALENT")
        unexplained += len(alive) + len(stale)
    if equivalents:
        table.note("Survivors that no test can kill, each with its reason:", *equivalents)
    table.show()
    if args.markdown:
        Path(args.markdown).write_text(table.markdown())
    return 1 if unexplained else 0


def stale_equivalents(name: str, outcomes: dict) -> list:
    """The module's EQUIVALENT entries a run contradicts: killed (or timed out, or reached by
    no test) where the entry says no test can kill it, or not made at all (the code moved). One
    left unchecked by an --only run is not judged.
    """
    return [m for m in EQUIVALENT if m.startswith(module_prefix(name))
            and outcomes.get(m) not in ("survived", "not checked")]


def planted(scratch: Path, markdown=None, only=()) -> int:
    """Apply each of PLANTED (those whose "feature: bug" matches a pattern of `only`, if any)
    to a scratch copy of the tree, one at a time, and run its tests (stopping at the first
    failure) -> 1 if a bug passed them or its line is gone, else 0."""
    chosen = [bug for bug in PLANTED
              if not only or any(fnmatch(f"{bug[0]}: {bug[1]}", p) for p in only)]
    if not chosen:
        raise ValueError(f"no planted bug matches {' or '.join(only)}")
    if scratch.exists():
        shutil.rmtree(scratch)
    scratch.mkdir(parents=True)
    for item in COPIED:
        copy(ROOT / item, scratch / item)
    link_shared(scratch.parent)                       # ../shared of the copy
    table = Table("Planted bugs: one line of a feature broken, against the feature's tests",
                  columns=[("feature", ""), ("bug", ""), ("tests", ""), ("outcome", ""),
                           ("seconds", ".0f")], chapter=False)
    chose = "".join(f" --only '{p}'" for p in only)
    table.header(f"scripts/dev/mutation.py --planted{chose}; each bug alone, its tests stop at the "
                 "first failure (python3 -m pytest -x -n 0: one process)", ran_on())
    env = dict(os.environ, PYTHONPATH=str(scratch))
    bad, total = 0, 0.0
    for i, (feature, bug, path, line, broken, tests) in enumerate(chosen, 1):
        target = scratch / path
        original = target.read_text()
        start = time.perf_counter()
        if original.count(line) != 1:
            outcome = "stale: the line is not in the file once"
        else:
            target.write_text(original.replace(line, broken))
            try:
                # the broken file's doctests too; not setup.py's (importing it runs setup())
                doctests = [path] if path != "setup.py" else []
                done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-n", "0",
                                       "-p", "no:cacheprovider", *tests, *doctests],
                                      cwd=scratch, env=env, capture_output=True, text=True)
            finally:
                target.write_text(original)
            outcome = {0: "PASSED: not caught", 1: "caught"}.get(
                done.returncode, f"error (pytest exit status {done.returncode})")
            caught = [ln for ln in done.stdout.splitlines() if ln.startswith("FAILED ")]
            if caught:
                test = caught[0][len("FAILED "):].split(" - ", 1)[0]   # an id may hold spaces
                outcome += f" by {test.split('::', 1)[-1]}"
            elif done.returncode == 1:  # a test's setup broke, none failed: not caught by it
                errors = [ln for ln in done.stdout.splitlines() if ln.startswith("ERROR ")]
                outcome = f"error (no test failed; {errors[0] if errors else 'no line'})"
        bad += not outcome.startswith("caught")
        seconds = time.perf_counter() - start
        say(f"[{i}/{len(chosen)}] {feature}: {bug}: {outcome} ({seconds:.0f} s)")
        table.row(feature, bug, ", ".join(Path(t).stem for t in tests), outcome, seconds)
        total += seconds
    table.note(f"{len(chosen)} bugs: {len(chosen) - bad} caught, {bad} not; "
               f"{total:.0f} s in all")
    table.show()
    if markdown:
        Path(markdown).write_text(table.markdown())
    return 1 if bad else 0


def ran_on() -> str:
    """When, on which commit and on what machine a run ran, for its table's header: the UTC
    date, the tree's commit (marked where the copied files differ from it), the CPU and BLAS
    kernel, the load."""
    from datetime import datetime, timezone

    from minitransformer.kernels.tuning import machine

    def git(*a):
        return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    commit = git("rev-parse", "--short", "HEAD") or "no git"
    if git("status", "--porcelain", "--", *COPIED):
        commit += " with uncommitted changes"
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return (f"run {when} on commit {commit}; {machine()}; load average "
            f"{os.getloadavg()[0]:.1f} at start")


def module_prefix(name) -> str:
    """'minitransformer.serve.paged.' for paged: the start of its mutants' names."""
    return MODULES[name][0][:-len(".py")].replace("/", ".") + "."


if __name__ == "__main__":
    run(main)
