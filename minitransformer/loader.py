"""Load a Hugging Face checkpoint directory into a Model: config, weights, tokenizer, eos ids.

What is checked, and named in the error when wrong:
- config.json exists, is JSON, describes a supported architecture (see config.py);
- the weights: one ``model.safetensors`` or a sharded ``model.safetensors.index.json``; every
  file exists and is well formed and complete (see safetensors_io.py);
- every tensor the config implies is present, with exactly the shape the config implies and a
  float dtype (F32, F16 or BF16); no unexpected tensor is present.

Weights are converted to float32 once, here; all the math of the model runs in float32.
A tied checkpoint that still carries ``lm_head.weight`` keeps only the embedding (they are the
same matrix by definition), and stored RoPE ``inv_freq`` buffers from old exports are ignored:
RoPE is recomputed from ``rope_theta``.
"""
import json
from pathlib import Path

from minitransformer.backend import to_device
from minitransformer.config import ModelConfig, load_config
from minitransformer.errors import CheckpointError
from minitransformer.model import Model
from minitransformer.safetensors_io import read_tensors, to_float32
from minitransformer.tokenizer import load_tokenizer

FLOAT_DTYPES = ("F32", "F16", "BF16")


def expected_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name the config implies -> its shape (HF layout: a Linear is (out, in))."""
    D, F, d = c.hidden_size, c.intermediate_size, c.head_dim
    H, Hkv = c.num_attention_heads, c.num_key_value_heads
    shapes = {"model.embed_tokens.weight": (c.vocab_size, D), "model.norm.weight": (D,)}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, D)
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (D,),
            p + "self_attn.q_proj.weight": (H * d, D),
            p + "self_attn.k_proj.weight": (Hkv * d, D),
            p + "self_attn.v_proj.weight": (Hkv * d, D),
            p + "self_attn.o_proj.weight": (D, H * d),
            p + "post_attention_layernorm.weight": (D,),
            p + "mlp.gate_proj.weight": (F, D),
            p + "mlp.up_proj.weight": (F, D),
            p + "mlp.down_proj.weight": (D, F),
        }
        if c.qkv_bias:
            shapes |= {p + "self_attn.q_proj.bias": (H * d,),
                       p + "self_attn.k_proj.bias": (Hkv * d,),
                       p + "self_attn.v_proj.bias": (Hkv * d,)}
        if c.o_bias:
            shapes[p + "self_attn.o_proj.bias"] = (D,)
    return shapes


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint: a single file or the shards of an index."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: malformed shard index ({e!r})") from None
        return [path / name for name in sorted(set(weight_map.values()))]
    single = path / "model.safetensors"
    if not single.is_file():
        raise CheckpointError(f"{path}: no model.safetensors or model.safetensors.index.json")
    return [single]


def load_weights(path: Path, config: ModelConfig) -> dict:
    """Read, check against the config, convert to float32 and move to the backend."""
    expected = expected_shapes(config)
    found = {}  # name -> (file, dtype, stored array)
    for file in weight_files(path):
        for name, (dtype, stored) in read_tensors(file).items():
            if name.endswith("rotary_emb.inv_freq"):
                continue
            if name == "lm_head.weight" and config.tie_word_embeddings:
                continue  # tied: the head *is* the embedding
            found[name] = (file, dtype, stored)
    missing = sorted(set(expected) - set(found))
    if missing:
        raise CheckpointError(f"{path}: missing tensor(s) {', '.join(missing[:5])}"
                              + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
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
        weights[name] = to_device(to_float32(dtype, stored))
    return weights


def eos_ids(path: Path) -> tuple[int, ...]:
    """End-of-sequence ids: generation_config.json first, config.json as the fallback."""
    for name in ("generation_config.json", "config.json"):
        file = path / name
        if file.is_file():
            try:
                eos = json.loads(file.read_text()).get("eos_token_id")
            except json.JSONDecodeError as e:
                raise CheckpointError(f"{file}: not valid JSON ({e})") from None
            if eos is not None:
                return tuple(eos) if isinstance(eos, list) else (int(eos),)
    return ()


def load(path) -> Model:
    """A Hugging Face checkpoint directory, or a llama.cpp .gguf file (see gguf.py) -> Model
    (float32 weights on the active backend)."""
    path = Path(path)
    if path.suffix == ".gguf":
        from minitransformer.gguf import load_gguf
        return load_gguf(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: checkpoint directory not found")
    config = load_config(path)
    return Model(config=config, weights=load_weights(path, config),
                 tokenizer=load_tokenizer(path), eos_token_ids=eos_ids(path), path=str(path))
