"""Load a Hugging Face checkpoint directory into a Model: config, weights, tokenizer, and
from generation_config.json the eos ids and the sampling defaults.

What is checked, and named in the error when wrong:
- config.json exists, is JSON, describes a supported architecture (see config.py);
- the weights: one ``model.safetensors`` or a sharded ``model.safetensors.index.json``; every
  file exists and is well formed and complete (see safetensors_io.py);
- every tensor the config implies is present, with exactly the shape the config implies and a
  float dtype (F32, F16 or BF16); no unexpected tensor is present.

Weights are converted to float32 once, here; all the math of the model runs in float32. A
float32 matrix is handed on as the file holds it (a read-only view of the mapped file): the
Model copies it once, into the layout its products run fastest in (kernels/fused.py), so its
bytes land once, where they are kept; a vector is copied here.
A tied checkpoint that still carries ``lm_head.weight`` keeps only the embedding (they are the
same matrix by definition), and stored RoPE ``inv_freq`` buffers from old exports are ignored:
RoPE is recomputed from ``rope_theta``.
"""
from dataclasses import fields
from pathlib import Path, PurePosixPath

from minitransformer.backend import to_device
from minitransformer.checks import check_finite, check_missing, read_json_object, token_ids_field
from minitransformer.config import ModelConfig, load_config
from minitransformer.errors import CheckpointError
from minitransformer.formats.gguf import load_gguf
from minitransformer.formats.safetensors_io import read_tensors, to_float32
from minitransformer.model import Model
from minitransformer.progress import tell
from minitransformer.sampling import SamplingSettings
from minitransformer.shape import tensor_shapes
from minitransformer.tokenizer import load_tokenizer

FLOAT_DTYPES = ("F32", "F16", "BF16")


def weight_files(path: Path) -> dict[Path, set | None]:
    """The safetensors files of a checkpoint -> {file: the tensor names the index puts there
    (None for a single unsharded file)}. An index beside a ``model.safetensors`` it does not
    name is an error: which of the two is meant? Shard names must stay inside the checkpoint
    directory: an index is data, and ``../../elsewhere`` or an absolute path in it must not be
    followed.
    (Checked on the name, not the resolved path: the Hugging Face cache links each file to a
    blob outside the snapshot directory, legitimately.)"""
    index, single = path / "model.safetensors.index.json", path / "model.safetensors"
    if index.is_file():
        weight_map = read_json_object(index, "a shard index (an object)").get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: 'weight_map' must be a non-empty object "
                                  f"{{tensor name: shard file}}, got {weight_map!r:.100}")
        shards: dict[Path, set[str]] = {}  # shard file -> the tensor names it holds
        for name, shard in weight_map.items():
            relative = PurePosixPath(shard) if isinstance(shard, str) else None
            if relative is None or not shard or relative.is_absolute() or ".." in relative.parts \
                    or "\\" in shard:
                raise CheckpointError(f"{index}: weight_map[{name!r}] must name a file inside "
                                      f"the checkpoint directory, got {shard!r:.100}")
            shards.setdefault(path / relative, set()).add(name)
        for file in shards:
            if not file.is_file():
                raise CheckpointError(f"{file}: shard not found (named in {index.name})")
        if single.is_file() and single not in shards:
            raise CheckpointError(f"{index}: the folder also holds {single.name}, which the "
                                  "index does not name: which weights are meant is unclear")
        return dict(sorted(shards.items()))
    if not single.is_file():
        raise CheckpointError(f"{path}: no model.safetensors or model.safetensors.index.json")
    return {single: None}


def read_checkpoint_tensors(path: Path) -> dict:
    """Every stored tensor of the checkpoint -> (file, dtype, stored array), headers only.

    A tensor stored twice (in two shards) is an error, not "the later one wins"; so is one the
    index places in another shard than the one holding it."""
    found: dict = {}
    for file, listed in weight_files(path).items():
        for name, (dtype, stored) in read_tensors(file).items():
            if name in found:
                raise CheckpointError(f"{file}: tensor {name!r} is also stored in "
                                      f"{found[name][0]}")
            if listed is not None and name not in listed:
                raise CheckpointError(f"{file}: holds tensor {name!r}, which the shard index "
                                      "does not place in this file")
            found[name] = (file, dtype, stored)
    return found


def load_weights(path: Path, config: ModelConfig) -> dict:
    """Read, check against the config, convert to float32 and move to the backend."""
    found = read_checkpoint_tensors(path)
    for name in [n for n in found if n.endswith("rotary_emb.inv_freq")]:
        del found[name]
    if config.tie_word_embeddings:
        found.pop("lm_head.weight", None)  # tied: the head *is* the embedding
    expected = tensor_shapes(config)
    check_missing(path, expected, found)
    extra = sorted(set(found) - set(expected))
    if extra:
        raise CheckpointError(f"{found[extra[0]][0]}: unexpected tensor(s) {', '.join(extra[:5])} "
                              f"for a {config.model_type} config")
    weights = {}
    for name, shape in expected.items():
        file, dtype, stored = found[name]
        if dtype not in FLOAT_DTYPES:
            raise CheckpointError(f"{file}: tensor {name!r} has dtype {dtype}; "
                                  f"expected one of {', '.join(FLOAT_DTYPES)}")
        if tuple(stored.shape) != shape:
            raise CheckpointError(f"{file}: tensor {name!r} has shape {tuple(stored.shape)} "
                                  f"but config.json implies {shape}")
        matrix = to_float32(dtype, stored, copy=len(shape) != 2)      # see the docstring
        weights[name] = to_device(check_finite(file, name, matrix))
    return weights


def generation_config(path: Path, vocab_size: int) -> tuple[tuple[int, ...], dict]:
    """generation_config.json, read once here -> (eos ids, the sampling defaults it gives).

    The eos ids are its eos_token_id, else config.json's. The sampling defaults are the
    SamplingSettings fields it sets (null ones left out), as written: whoever samples with them
    checks them (__main__.py, naming the file when one is bad)."""
    file = path / "generation_config.json"
    given = read_json_object(file) if file.is_file() else {}
    sampling = {f.name: given[f.name] for f in fields(SamplingSettings)
                if given.get(f.name) is not None}
    if given.get("eos_token_id") is None:
        file = path / "config.json"
        given = read_json_object(file) if file.is_file() else {}
    return check_eos_ids(file, given.get("eos_token_id"), vocab_size), sampling


def check_eos_ids(file: Path, eos, vocab_size: int) -> tuple[int, ...]:
    """The eos_token_id field of file (None: none) -> its ids; each must be a token the model
    can produce (below vocab_size), or generation never stops."""
    if eos is None:
        return ()
    ids = token_ids_field(file, "eos_token_id", eos)
    outside = [i for i in ids if i >= vocab_size]
    if outside:
        raise CheckpointError(f"{file}: field 'eos_token_id' holds {outside[0]}, "
                              f"outside the vocabulary [0, {vocab_size})")
    return ids


def load(path) -> Model:
    """A Hugging Face checkpoint directory, or a llama.cpp .gguf file (see gguf.py) -> Model
    (float32 weights on the active backend). Says on stderr what it loads (and, where this
    machine has not yet measured the model's products, that it measures them: kernels/blas.py).
    """
    path = Path(path)
    if path.suffix == ".gguf":
        if path.is_file():
            tell(f"loading {path}")
        return load_gguf(path)
    if path.is_file():
        raise CheckpointError(f"{path}: is a file; load takes a checkpoint directory "
                              "(config.json + model.safetensors + tokenizer.json) or a .gguf file")
    if not path.is_dir():
        raise CheckpointError(f"{path}: checkpoint directory not found")
    tell(f"loading {path}")
    config = load_config(path)
    eos, sampling = generation_config(path, config.vocab_size)
    return Model(config=config, weights=load_weights(path, config),
                 tokenizer=load_tokenizer(path), eos_token_ids=eos, sampling_defaults=sampling,
                 path=str(path))
