"""Bad script invocations end as argparse ends them: one 'error:' line on stderr, exit status 2,
no traceback, and no table printed for work that was not done."""
import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
# the learner's scripts and the maintainers' tools (scripts/dev/), by their path under scripts/
EVERY_SCRIPT = sorted(str(p.relative_to(SCRIPTS)) for p in [*SCRIPTS.glob("*.py"),
                                                            *SCRIPTS.glob("dev/*.py")]
                      if not p.name.startswith("_"))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from minitransformer.checkpoints.synth import make_checkpoint, qwen2_config, train_tokenizer
    tokenizer = train_tokenizer()
    config = qwen2_config(vocab_size=tokenizer.get_vocab_size(), max_position_embeddings=128)
    return str(make_checkpoint(tmp_path_factory.mktemp("tiny"), config, tokenizer=tokenizer))


def fails(run_script, name, argv) -> str:
    """Run scripts/<name>.py, which must exit with status 2 -> its one error line."""
    out, err = run_script(name, *argv, status=2)
    errors = [line for line in err.splitlines() if "error: " in line]
    assert len(errors) == 1 and "Traceback" not in err, err
    assert out == "", f"a table was printed: {out}"
    return errors[0]


@pytest.mark.parametrize("name, argv, words", [
    ("exp01_kv_cache", ["--model", "{missing}"], "checkpoint directory not found"),
    ("exp01_kv_cache", ["--model", "{file}"], "is a file"),
    ("exp03_macs", ["--model", "{missing}"], "checkpoint directory not found"),
    ("exp01_kv_cache", ["--model", "{tiny}", "--max-new-tokens", "-5"], "--max-new-tokens"),
    ("exp01_kv_cache", ["--model", "{tiny}", "--max-new-tokens", "0"], "--max-new-tokens"),
    ("exp01_kv_cache", ["--model", "{tiny}", "--prompt", ""], "the prompt must be a non-empty"),
    ("exp13_engine", ["--model", "{tiny}", "--num-blocks", "0"],
     "num_gpu_blocks_override=0"),
    ("exp14_paged_cache", ["--model", "{tiny}", "--block-sizes", "0,4"], "--block-sizes"),
    ("exp12_batched_decode", ["--model", "{tiny}", "--batch-sizes", "1,x"], "--batch-sizes"),
    ("exp13_batching_sim", ["--loads", "1,nan"], "--loads"),
    ("exp13_batching_sim", ["--seeds", "0"], "argument --seeds: expected an integer >= 1, got 0"),
    ("exp13_engine", ["--model", "{tiny}", "--requests", "0"], "--requests"),
    ("exp13_engine", ["--model", "{tiny}", "--median", "500"], "median"),
    ("exp12_batched_decode", ["--model", "{tiny}", "--context", "100000",
                              "--batch-sizes", "1"], "beyond the model's 128 positions"),
    ("bench_engine", ["--model", "{tiny}", "--block-size", "0"], "--block-size"),
    ("bench_parallel_samples", ["--model", "{tiny}", "--n", "0"], "--n"),
    ("bench_parallel_samples", ["--model", "{tiny}", "--prompt-len", "100000"],
     "exceed the model's"),
    ("exp17_weight_outliers", ["--model", "{tiny}", "--matrix", "nope"], "not a tensor"),
    ("exp06_prefill_cost", ["--model", "{tiny}", "--repeat", "0"],
     "argument --repeat: expected an integer >= 1, got 0"),
    ("exp07_decode_cost", ["--model", "{tiny}", "--warmup", "-1"],
     "argument --warmup: expected an integer >= 0, got -1"),
    ("exp02_attention_scaling", ["--model", "{tiny}", "--lengths", "8", "0"],
     "argument --lengths: expected an integer >= 1, got 0"),
    ("exp13_engine", ["--model", "{tiny}", "--seed", "-3"],
     "argument --seed: expected an integer >= 0, got -3"),
    ("bench_engine", ["--model", "{tiny}", "--prompt-len", "8-4"],
     "argument --prompt-len: expected LO-HI with 1 <= LO <= HI, got '8-4'"),
    ("run_all", ["--only", "["], "argument --only: '[' is not a regular expression"),
    ("run_all", ["--only", "exp99"], "--only 'exp99' matches none of the main job's scripts: "
                                     "exp01_kv_cache.py, exp02_attention_scaling.py"),
])
def test_bad_invocation_is_one_error_line_and_status_2(tiny, tmp_path, run_script, name, argv,
                                                       words):
    paths = {"missing": str(tmp_path / "missing"), "file": __file__, "tiny": tiny}
    line = fails(run_script, name, [a.format(**paths) for a in argv])
    assert words in line, line


def test_a_library_error_names_the_checkpoint_file(tiny, tmp_path, run_script):
    import shutil
    path = tmp_path / "broken"
    shutil.copytree(tiny, path)
    (path / "config.json").write_text('{"architectures": 5}')
    line = fails(run_script, "exp01_kv_cache", ["--model", str(path)])
    assert "config.json" in line and "architectures" in line


@pytest.mark.parametrize("script", EVERY_SCRIPT)
def test_every_script_enters_through_run(script):
    source = (SCRIPTS / script).read_text()
    main_block = source[source.index('if __name__ == "__main__":'):]
    assert "run(main)" in main_block, f"{script} does not enter through _common.run"


def test_the_real_entry_point(tmp_path):
    """One real process: the status and stderr a shell sees."""
    done = subprocess.run([sys.executable, str(SCRIPTS / "exp08_cache_bytes.py"), "--model",
                           str(tmp_path / "missing")], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().splitlines() == [
        f"exp08_cache_bytes.py: error: {tmp_path / 'missing'}: checkpoint directory not found"]


# An MT_* environment value the library refuses at import (errors.SettingError), as one line.
BAD_SETTINGS = [
    ("MT_BACKEND", "MT_BACKEND='tensorflow' is not a backend: use one of numpy, cupy, strict, "
                   "or leave it unset for numpy"),
    ("MT_PRODUCTS", "MT_PRODUCTS='tensorflow' is not a BLAS route: use one of flat, rows, "
                    "slices, dots, or leave it unset to measure"),
    ("MT_LAYOUT", "MT_LAYOUT='tensorflow' is not a layout: use one of row-major, column-major, "
                  "or leave it unset to measure"),
    ("MT_TUNING", "MT_TUNING='tensorflow' is not a tuning mode: use one of remember, remeasure, "
                  "off, or leave it unset to remember")]


@pytest.mark.parametrize("variable, message", BAD_SETTINGS)
def test_an_unknown_setting_is_one_error_line(variable, message):
    done = subprocess.run([sys.executable, str(SCRIPTS / "exp08_cache_bytes.py")],
                          capture_output=True, text=True, timeout=60,
                          env=os.environ | {variable: "tensorflow"})
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == f"exp08_cache_bytes.py: error: {message}\n"


PROJECT = ("minitransformer", "quant", "sim", "drafts")


@pytest.mark.parametrize("script", EVERY_SCRIPT)
def test_every_script_imports_common_before_the_library(script):
    """_common says a bad setting the library's import raises: only if it comes first."""
    tree = ast.parse((SCRIPTS / script).read_text())
    first = next(node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))
                 and (node.names[0].name if isinstance(node, ast.Import) else node.module)
                 .split(".")[0] in PROJECT + ("_common",) + tuple(
                     p.stem for p in [*SCRIPTS.glob("*.py"), *SCRIPTS.glob("dev/*.py")]))
    module = first.names[0].name if isinstance(first, ast.Import) else first.module
    assert module == "_common", f"{script} imports {module} before _common"
