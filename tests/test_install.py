"""The package as `pip install .` installs it (issue 48): a wheel with one top-level name,
minitransformer (the repository's quant/ and sim/ inside it, their imports spelled so), that
imports and runs in a fresh virtual environment, from no checkout, keeping its models in the
user's cache folder, never in site-packages; and a weights folder that cannot be written is one
line naming it and MT_WEIGHTS_DIR. The checkout keeps its weights/ (the README's commands)."""
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from minitransformer.checkpoints import synth

ROOT = Path(__file__).resolve().parents[1]
BUILT_FROM = ["setup.cfg", "setup.py", "pyproject.toml", "README.md", "minitransformer", "quant",
              "sim"]


def sources(folder: Path) -> Path:
    """A copy of what pip builds from (a build leaves build/ and *.egg-info behind it: not in
    the checkout) -> its folder."""
    folder.mkdir()
    for name in BUILT_FROM:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, folder / name,
                            ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(ROOT / name, folder / name)
    (folder / "weights").mkdir()
    shutil.copy(ROOT / "weights" / "README.md", folder / "weights")
    return folder


def venv(folder: Path) -> Path:
    """A fresh virtual environment that sees this one's packages (numpy and the rest, and
    pip) -> its python."""
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip",
                    str(folder)], check=True, timeout=120)
    return folder / "bin" / "python"


def pip_install(python: Path, *what: str) -> None:
    done = subprocess.run([str(python), "-m", "pip", "install", "--no-deps", "--no-index",
                           "--no-build-isolation", "--disable-pip-version-check", "-q",
                           "--force-reinstall", *what], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel pip builds from the repository's sources, with the setuptools and wheel
    installed here (the test extra): no download."""
    tmp = tmp_path_factory.mktemp("wheel")
    sources(tmp / "src")
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                           "--no-build-isolation", "--disable-pip-version-check", "-q",
                           "-w", str(tmp / "dist"), str(tmp / "src")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    (built,) = (tmp / "dist").glob("minitransformer-*.whl")
    return built


def test_the_wheel_installs_one_top_level_name_with_quant_and_sim_inside(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names}
    assert tops == {"minitransformer", wheel.name.split("-py3")[0] + ".dist-info"}
    top_level = next(n for n in names if n.endswith(".dist-info/top_level.txt"))
    assert zipfile.ZipFile(wheel).read(top_level).decode().split() == ["minitransformer"]
    ours = [f"minitransformer/{p.relative_to(ROOT / 'minitransformer')}"
            for p in (ROOT / "minitransformer").rglob("*.py")]
    for folder in ("quant", "sim"):                      # inside: every module of each
        ours += [f"minitransformer/{folder}/{p.name}" for p in (ROOT / folder).glob("*.py")]
    assert sorted(n for n in names if n.endswith(".py")) == sorted(ours)
    assert not [n for n in names if "weights" in n.split("/")[:-1] or n.endswith(".safetensors")]
    # every import of the chapter's packages spelled where the wheel puts them
    sources = {n: zipfile.ZipFile(wheel).read(n).decode() for n in names if n.endswith(".py")}
    left = [(n, m.group()) for n, text in sources.items()
            for m in re.finditer(r"^\s*(?:>>> )?(?:from|import) (?:quant|sim)\b.*", text, re.M)]
    assert left == []
    assert "from minitransformer.sim.speculative import" in \
        sources["minitransformer/serve/drafting.py"]


RUN_INSTALLED = """
import os, sys, sysconfig
from pathlib import Path
# the wheel alone: the checkout's editable install, in the site-packages this venv sees, set aside
sys.meta_path = [f for f in sys.meta_path if not f.__module__.startswith("__editable__")]
import minitransformer as mt
from minitransformer.checkpoints.synth import weights_dir, default_model
import minitransformer.serve.drafting, minitransformer.quant.schemes, minitransformer.sim.speculative
from minitransformer.quant.schemes import SCHEMES
site = Path(sysconfig.get_paths()["purelib"]).resolve()
assert Path(mt.__file__).resolve().is_relative_to(site), mt.__file__
assert Path(minitransformer.quant.schemes.__file__).resolve().is_relative_to(site)
model = mt.load(default_model())
print("weights", weights_dir())
print("tokens", len(mt.generate(model, [1, 2, 3], max_new_tokens=2)))
print("schemes", len(SCHEMES) > 0)
assert "quant" not in sys.modules and "sim" not in sys.modules
"""


def test_an_installed_wheel_runs_from_no_checkout_and_keeps_models_in_the_user_cache(
        wheel, tmp_path):
    """Installed into a fresh venv (its numpy etc. the system's), run from another folder:
    imports quant and sim as minitransformer.quant / .sim, makes the default model under
    $XDG_CACHE_HOME/minitransformer/weights, and writes nothing into site-packages."""
    python = venv(tmp_path / "venv")
    pip_install(python, str(wheel))
    env = {k: v for k, v in os.environ.items()
           if k not in ("MT_WEIGHTS_DIR", "PYTHONPATH", "MT_TUNING_CACHE")}
    env |= {"XDG_CACHE_HOME": str(tmp_path / "cache"), "HOME": str(tmp_path / "home"),
            "MT_PRODUCTS": "flat", "MT_LAYOUT": "row-major"}
    (tmp_path / "elsewhere").mkdir()
    site = subprocess.run([str(python), "-c", "import sysconfig; "
                           "print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    before = sorted(p.name for p in Path(site).iterdir())
    run = subprocess.run([str(python), "-c", RUN_INSTALLED], cwd=tmp_path / "elsewhere",
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split("\n")[:3] == [
        f"weights {tmp_path / 'cache' / 'minitransformer' / 'weights'}", "tokens 2",
        "schemes True"]
    assert synth.is_written(tmp_path / "cache" / "minitransformer" / "weights" / "default",
                            "GENERATED", synth.GENERATOR_VERSION)
    assert sorted(p.name for p in Path(site).iterdir()) == before


EDITABLE = """
import sys
from pathlib import Path
sys.meta_path = [f for f in sys.meta_path   # only this venv's editable install: the copy's
                 if not f.__module__.startswith("__editable__") or f.__module__ in sys.argv[1]]
import minitransformer.serve.drafting, quant.schemes, sim.speculative
from minitransformer.checkpoints.synth import weights_dir
print(Path(quant.schemes.__file__).parent.parent, weights_dir())
"""


def test_an_editable_install_imports_quant_and_sim_as_the_chapter_does_from_anywhere(
        tmp_path):
    """pip install -e (the README's, CI's): the checkout's quant and sim are top-level names,
    imported as the chapter writes them from any folder (the library's drafting.py among the
    importers), and the models stay in the checkout's weights/."""
    src = sources(tmp_path / "src")
    python = venv(tmp_path / "venv")
    pip_install(python, "-e", str(src))
    (finder,) = (tmp_path / "venv").glob("lib/python*/site-packages/__editable___*finder.py")
    env = {k: v for k, v in os.environ.items() if k not in ("MT_WEIGHTS_DIR", "PYTHONPATH")}
    run = subprocess.run([str(python), "-c", EDITABLE, finder.stem], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == [str(src), str(src / "weights")]


def test_the_checkout_keeps_its_weights_folder(monkeypatch, tmp_path):
    """Run from the repository (as the README, CI and run_all do), the models live in its
    weights/; MT_WEIGHTS_DIR moves them (an empty one is unset); XDG_CACHE_HOME does not."""
    monkeypatch.delenv("MT_WEIGHTS_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert synth.weights_dir() == ROOT / "weights"
    monkeypatch.setenv("MT_WEIGHTS_DIR", "")
    assert synth.weights_dir() == ROOT / "weights"
    monkeypatch.setenv("MT_WEIGHTS_DIR", str(tmp_path / "w"))
    assert synth.weights_dir() == tmp_path / "w"


def read_only_folder(tmp_path) -> tuple:
    """A folder this process cannot write, and the command prefix that runs a command where
    it cannot: permissions where this user is not root; a read-only bind mount in a user
    namespace (unshare) where it is."""
    folder = tmp_path / "read-only"
    folder.mkdir()
    if os.geteuid() != 0:
        folder.chmod(0o555)
        return folder, []
    if shutil.which("unshare") is None:
        pytest.skip("root, and no unshare to mount a read-only folder")
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", f"mount --bind {folder} {folder} && "
                            f"mount -o remount,bind,ro {folder} && ! touch {folder}/x"],
                           capture_output=True, text=True, timeout=60)
    if probe.returncode != 0:
        pytest.skip(f"root, and unshare cannot mount a read-only folder: {probe.stderr[-200:]}")
    return folder, ["unshare", "-rm", "sh", "-c", f'mount --bind {folder} {folder} && '
                    f'mount -o remount,bind,ro {folder} && exec "$@"', "sh"]


@pytest.mark.parametrize("model", ["default", "smollm2"])
def test_a_weights_folder_that_cannot_be_written_is_one_line_naming_it(tmp_path, model):
    """The default model made, or SmolLM2 fetched, into a read-only folder: one line naming the
    folder and MT_WEIGHTS_DIR, exit 2 (it was a raw '[Errno 30] Read-only file system' about a
    .partial folder)."""
    folder, prefix = read_only_folder(tmp_path)
    env = dict(os.environ, MT_WEIGHTS_DIR=str(folder), PYTHONPATH=str(ROOT))
    done = subprocess.run([*prefix, sys.executable, "-m", "minitransformer", "generate",
                           "--model", model, "Hi", "--max-new-tokens", "1"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    why = "Read-only file system" if prefix else "Permission denied"
    assert done.stderr.splitlines()[-1] == (
        f"error: cannot write to the weights folder {folder} ({why}): MT_WEIGHTS_DIR=FOLDER "
        f"puts the models in another")
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("call", [
    "from minitransformer.drafts.students import save_npz; save_npz(FOLDER / 'drafts' / 'd.npz', {})",
    "from minitransformer.measure.text import fetch; fetch(FOLDER / 'text' / 'britannica.txt')"])
def test_the_drafts_and_the_text_say_the_same_of_a_folder_they_cannot_write(tmp_path, call):
    """The distilled drafts' cache and the evaluation text's fetch (before it downloads) give
    the same line as the models."""
    folder, prefix = read_only_folder(tmp_path)
    code = f"from pathlib import Path; FOLDER = Path({str(folder)!r})\n{call}"
    done = subprocess.run([*prefix, sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    why = "Read-only file system" if prefix else "Permission denied"
    assert done.stderr.splitlines()[-1].endswith(
        f"WeightsFolderError: cannot write to the weights folder {folder / call.split(chr(39))[1]}"
        f" ({why}): MT_WEIGHTS_DIR=FOLDER puts the models in another")
