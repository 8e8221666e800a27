"""The model's shape, read from a Hugging Face ``config.json``.

Field names are the config.json names, so a learner can put the file beside this class and read
them across. Loading keeps the fields the forward pass uses, drops the rest (dropout, init
ranges, ...), fills the documented Hugging Face defaults, and refuses what this implementation
does not do (rope scaling, sliding-window attention, activations other than SiLU, MLP biases)
instead of computing something else silently.

Two families are supported: Qwen2 (q/k/v projections always carry a bias) and Llama (biases on
q/k/v/o only when ``attention_bias`` is true).
"""
from dataclasses import dataclass
from pathlib import Path

from minitransformer.checks import (flag_field, integer_field, is_integer,
                                    positive_number_field, read_json_object, token_ids_field)
from minitransformer.errors import CheckpointError

ARCHITECTURES = {"Qwen2ForCausalLM": "qwen2", "LlamaForCausalLM": "llama"}

# Sanity bounds on the sizes, 8x or more beyond the largest published models (vocab 256k,
# hidden 16k, MLP 53k, 126 layers, 128 heads, head_dim 256, 10M positions), checked before
# anything is listed or allocated: `num_hidden_layers: 1000000000` fails here, at once.
SIZE_LIMITS = {"vocab_size": 2 ** 22, "hidden_size": 2 ** 17, "intermediate_size": 2 ** 19,
               "num_hidden_layers": 2 ** 10, "num_attention_heads": 2 ** 12,
               "num_key_value_heads": 2 ** 12, "head_dim": 2 ** 12,
               "max_position_embeddings": 2 ** 28}


@dataclass(frozen=True)
class ModelConfig:
    model_type: str                 # "qwen2" or "llama"
    vocab_size: int                 # V
    hidden_size: int                # D
    intermediate_size: int          # F, the SwiGLU width
    num_hidden_layers: int          # L
    num_attention_heads: int        # H, query heads
    num_key_value_heads: int        # Hkv, key/value heads (H for MHA, 1 for MQA)
    head_dim: int                   # d
    max_position_embeddings: int    # longest sequence the model was built for
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    attention_bias: bool = False    # bias on q/k/v (and o for Llama)
    tie_word_embeddings: bool = False
    torch_dtype: str = "float32"    # how the checkpoint stores its weights (information only)

    @property
    def qkv_bias(self) -> bool:
        """Qwen2 always has q/k/v biases; Llama has them (and an o_proj bias) on request."""
        return self.model_type == "qwen2" or self.attention_bias

    @property
    def o_bias(self) -> bool:
        return self.model_type == "llama" and self.attention_bias

    @classmethod
    def from_dict(cls, cfg: dict, source: str = "config.json") -> "ModelConfig":
        """One validation pass: types, finiteness, ranges, sizes within SIZE_LIMITS."""
        def size(name):
            return integer_field(source, name, field(cfg, source, name), 1, SIZE_LIMITS[name])

        def flag(name):
            return flag_field(source, name, field(cfg, source, name, False))

        if not isinstance(cfg, dict):
            raise CheckpointError(f"{source}: expected a JSON object")
        model_type = architecture(cfg, source)
        refuse_unsupported(cfg, source)
        cfg = nested_rope_theta(cfg)
        for name in ("bos_token_id", "eos_token_id"):  # not kept here, but read elsewhere
            if cfg.get(name) is not None:
                token_ids_field(source, name, cfg[name])
        dtype = torch_dtype(cfg, source)
        heads, hidden = size("num_attention_heads"), size("hidden_size")   # before the fallbacks
        cfg = hf_fallbacks(cfg)                                             # that read them
        config = cls(
            model_type=model_type,
            vocab_size=size("vocab_size"),
            hidden_size=hidden,
            intermediate_size=size("intermediate_size"),
            num_hidden_layers=size("num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=size("num_key_value_heads"),
            head_dim=size("head_dim"),
            max_position_embeddings=size("max_position_embeddings"),
            rms_norm_eps=positive_number_field(source, "rms_norm_eps",
                                               field(cfg, source, "rms_norm_eps", 1e-6)),
            rope_theta=positive_number_field(source, "rope_theta",
                                             field(cfg, source, "rope_theta", 10000.0)),
            attention_bias=flag("attention_bias"),
            tie_word_embeddings=flag("tie_word_embeddings"),
            torch_dtype=dtype,
        )
        config.validate(source)
        return config

    def validate(self, source: str = "config.json") -> None:
        """The relations between fields (each field alone was checked when read)."""
        if self.num_attention_heads % self.num_key_value_heads:
            raise CheckpointError(
                f"{source}: num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}")
        if self.head_dim % 2:
            raise CheckpointError(f"{source}: head_dim={self.head_dim} must be even for RoPE")


def architecture(cfg: dict, source) -> str:
    """``architectures`` (a list of class names) or ``model_type`` -> "qwen2" or "llama"."""
    archs = cfg.get("architectures") or []
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise CheckpointError(f"{source}: field 'architectures' must be a list of class names, "
                              f"got {archs!r:.100}")
    known = [ARCHITECTURES[a] for a in archs if a in ARCHITECTURES]
    model_type = known[0] if known else cfg.get("model_type")
    if not isinstance(model_type, str) or model_type not in ARCHITECTURES.values():
        raise CheckpointError(f"{source}: unsupported architecture {archs or model_type!r:.100}; "
                              f"supported: {', '.join(ARCHITECTURES)}")
    return model_type


def field(cfg: dict, source, name: str, default=None):
    """cfg[name], where a missing field or a null means the default (as in HF); no default: an
    error naming the field."""
    value = cfg.get(name)
    value = default if value is None else value
    if value is None:
        raise CheckpointError(f"{source}: required field {name!r} is missing")
    return value


def refuse_unsupported(cfg: dict, source) -> None:
    """Refuse, by name, what this implementation does not do rather than compute something
    else: rope scaling (in either place a config puts it), activations other than SiLU,
    sliding-window attention, MLP biases."""
    if cfg.get("rope_scaling") not in (None, {}):
        raise CheckpointError(f"{source}: rope_scaling={cfg['rope_scaling']!r:.100} "
                              "is not supported")
    if cfg.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{source}: hidden_act={cfg['hidden_act']!r:.100} is not "
                              "supported (only silu, the SwiGLU MLP)")
    if flag_field(source, "use_sliding_window", field(cfg, source, "use_sliding_window", False)):
        raise CheckpointError(f"{source}: sliding-window attention is not supported")
    if flag_field(source, "mlp_bias", field(cfg, source, "mlp_bias", False)):
        raise CheckpointError(f"{source}: mlp_bias=true is not supported")
    rope = cfg.get("rope_parameters")
    if rope is not None and not isinstance(rope, dict):
        raise CheckpointError(f"{source}: field 'rope_parameters' must be an object, "
                              f"got {rope!r:.100}")
    if rope and rope.get("rope_type", "default") != "default":
        raise CheckpointError(f"{source}: rope_parameters.rope_type={rope['rope_type']!r:.100} "
                              "(rope scaling) is not supported")


def nested_rope_theta(cfg: dict) -> dict:
    """Newer transformers nest RoPE settings in ``rope_parameters``: its rope_theta, when the
    config has none of its own, brought up (a copy)."""
    rope = cfg.get("rope_parameters")
    if rope and cfg.get("rope_theta") is None:
        return {**cfg, "rope_theta": rope.get("rope_theta", 10000.0)}
    return cfg


def torch_dtype(cfg: dict, source) -> str:
    """How the checkpoint stores its weights (``torch_dtype``, newer ``dtype``): a name."""
    dtype = cfg.get("torch_dtype") or cfg.get("dtype") or "float32"
    if not isinstance(dtype, str):
        raise CheckpointError(f"{source}: field 'torch_dtype' must be a string, "
                              f"got {dtype!r:.100}")
    return dtype


def hf_fallbacks(cfg: dict) -> dict:
    """The two Hugging Face conventions real config.json files rely on, filled in (a copy):
    no num_key_value_heads means plain multi-head attention, one kv head per query head; no
    head_dim (Qwen2, older Llama) means hidden_size // num_attention_heads.

    >>> hf_fallbacks({"hidden_size": 896, "num_attention_heads": 14})
    {'hidden_size': 896, 'num_attention_heads': 14, 'num_key_value_heads': 14, 'head_dim': 64}
    """
    heads, hidden, filled = cfg.get("num_attention_heads"), cfg.get("hidden_size"), dict(cfg)
    if filled.get("num_key_value_heads") is None:
        filled["num_key_value_heads"] = heads
    numbers = all(is_integer(n) for n in (heads, hidden))
    if filled.get("head_dim") is None and numbers and heads > 0:
        filled["head_dim"] = max(hidden // heads, 1)
    return filled


def load_config(path) -> ModelConfig:
    """A checkpoint directory (or its config.json) -> ModelConfig, with errors naming the file."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: checkpoint directory not found")
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise CheckpointError(f"{file}: config.json not found")
    return ModelConfig.from_dict(read_json_object(file), source=str(file))
