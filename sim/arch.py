"""The architecture the cost models read, from any kind of config.

sim/ has to work with whatever describes a model: the core's `ModelConfig` (its attribute
names are the HF config.json names), a plain dict, any object with those attribute names, or
the path of a config.json (or of the checkpoint directory that holds one). `arch(config)` turns
any of them into the core's own ModelConfig, so the HF fallbacks (`config.hf_fallbacks`), the
bias rule (`ModelConfig.qkv_bias`, `.o_bias`) and the parameter count (`shape.py`) are the
ones the model itself uses. `kv_dims(config)` reads only the three numbers the KV-cache formula
needs, so a hypothetical model can be described by just those.

Describing a model for its costs refuses nothing that costs nothing: rope scaling, sliding
windows, the activation and the dtypes are not read (loading a model for real refuses what it
does not implement). Serves experiments 3, 8-11 and 24.
"""
import json
from pathlib import Path
from typing import Any

from minitransformer import shape
from minitransformer.config import ModelConfig, hf_fallbacks
from minitransformer.kvquant import KVDims

SHAPE_FIELDS = ("num_hidden_layers", "num_key_value_heads", "head_dim", "num_attention_heads",
                "hidden_size", "intermediate_size", "vocab_size")  # checked in this order
FIELDS = SHAPE_FIELDS + ("model_type", "attention_bias", "tie_word_embeddings",
                         "max_position_embeddings")


def read_config_json(path):
    """A config.json path, or a checkpoint directory holding one -> dict."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"no model config at {str(path)!r}: give a config.json or its directory")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{str(path)!r} is not valid JSON: {e}") from None


def _as_dict(config) -> dict:
    """Path-like -> its JSON; dict -> itself; any other object -> its HF-named attributes."""
    if isinstance(config, (str, Path)):
        return read_config_json(config)
    if isinstance(config, dict):
        return config
    return {name: getattr(config, name, None) for name in FIELDS}


def _positive_int(cfg: dict, name: str) -> int:
    value = cfg.get(name)
    if value is None:
        raise ValueError(f"model config has no {name!r}")
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not is_number or not float(value).is_integer() or value < 1:
        raise ValueError(f"model config {name}={value!r}: expected a positive integer")
    return int(value)


def query_heads(config) -> int:
    """config -> num_attention_heads (H), needed where MHA is the comparison."""
    return _positive_int(_as_dict(config), "num_attention_heads")


def kv_dims(config) -> KVDims:
    """config -> (layers, kv_heads, head_dim), the only shapes the KV cache depends on."""
    cfg = hf_fallbacks(_as_dict(config))
    return KVDims(*(_positive_int(cfg, name) for name in KVDims._fields))


def arch(config) -> ModelConfig:
    """A config object, dict, or config.json path -> the core's ModelConfig, its shapes
    checked (positive integers, whole query groups; an odd head_dim is fine for counting)."""
    if isinstance(config, ModelConfig):
        return config
    cfg = hf_fallbacks(_as_dict(config))
    shapes: dict[str, Any] = {name: _positive_int(cfg, name) for name in SHAPE_FIELDS}  # ints
    model = ModelConfig(
        # Qwen2's config.json has no attention_bias key: its q/k/v bias comes with the type.
        model_type="qwen2" if cfg.get("model_type") == "qwen2" else "llama",
        **shapes,
        max_position_embeddings=cfg.get("max_position_embeddings") or 1,  # costs nothing
        attention_bias=bool(cfg.get("attention_bias")),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings")))
    if model.num_attention_heads % model.num_key_value_heads:
        raise ValueError(f"num_attention_heads={model.num_attention_heads} is not a multiple of "
                         f"num_key_value_heads={model.num_key_value_heads}")
    return model


def parameter_count(config) -> int:
    """Number of parameters: embeddings, L blocks (attention, MLP, 2 norms), final norm, head."""
    return shape.parameter_count(arch(config))
