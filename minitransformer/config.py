"""The model's shape, read from a Hugging Face ``config.json``.

Field names are the config.json names, so a learner can put the file beside this class and read
them across. Loading keeps the fields the forward pass uses, drops the rest (dropout, init
ranges, ...), fills the documented Hugging Face defaults, and refuses what this implementation
does not do (rope scaling, sliding-window attention, activations other than SiLU, MLP biases)
instead of computing something else silently.

Two families are supported: Qwen2 (q/k/v projections always carry a bias) and Llama (biases on
q/k/v/o only when ``attention_bias`` is true).
"""
import json
from dataclasses import dataclass
from pathlib import Path

from minitransformer.errors import CheckpointError

ARCHITECTURES = {"Qwen2ForCausalLM": "qwen2", "LlamaForCausalLM": "llama"}


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

    @property
    def group_size(self) -> int:
        """Query heads that share one key/value head (H / Hkv)."""
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_dict(cls, cfg: dict, source: str = "config.json") -> "ModelConfig":
        def field(name, kind, default=None):
            value = cfg.get(name)
            value = default if value is None else value  # null means "the default", as in HF
            if value is None:
                raise CheckpointError(f"{source}: required field {name!r} is missing")
            if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
                raise CheckpointError(f"{source}: field {name!r} must be an integer, "
                                      f"got {value!r}")
            if kind is float and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise CheckpointError(f"{source}: field {name!r} must be a number, got {value!r}")
            if kind is bool and not isinstance(value, bool):
                raise CheckpointError(f"{source}: field {name!r} must be true or false, "
                                      f"got {value!r}")
            return kind(value)

        archs = cfg.get("architectures") or []
        known = [ARCHITECTURES[a] for a in archs if a in ARCHITECTURES]
        model_type = known[0] if known else cfg.get("model_type")
        if model_type not in ARCHITECTURES.values():
            raise CheckpointError(
                f"{source}: unsupported architecture {archs or model_type!r}; "
                f"supported: {', '.join(ARCHITECTURES)}")
        if cfg.get("rope_scaling") not in (None, {}):
            raise CheckpointError(f"{source}: rope_scaling={cfg['rope_scaling']!r} "
                                  "is not supported")
        if cfg.get("hidden_act", "silu") != "silu":
            raise CheckpointError(f"{source}: hidden_act={cfg['hidden_act']!r} is not supported "
                                  "(only silu, the SwiGLU MLP)")
        if cfg.get("use_sliding_window", False):
            raise CheckpointError(f"{source}: sliding-window attention is not supported")
        if cfg.get("mlp_bias", False):
            raise CheckpointError(f"{source}: mlp_bias=true is not supported")

        heads = field("num_attention_heads", int)
        hidden = field("hidden_size", int)
        rope = cfg.get("rope_parameters")
        if isinstance(rope, dict):  # newer transformers nest RoPE settings here
            if rope.get("rope_type", "default") != "default":
                raise CheckpointError(f"{source}: rope_parameters.rope_type="
                                      f"{rope['rope_type']!r} (rope scaling) is not supported")
            if "rope_theta" not in cfg:
                cfg = {**cfg, "rope_theta": rope.get("rope_theta", 10000.0)}
        config = cls(
            model_type=model_type,
            vocab_size=field("vocab_size", int),
            hidden_size=hidden,
            intermediate_size=field("intermediate_size", int),
            num_hidden_layers=field("num_hidden_layers", int),
            num_attention_heads=heads,
            # Absent means plain multi-head attention: one kv head per query head.
            num_key_value_heads=field("num_key_value_heads", int, heads),
            head_dim=field("head_dim", int, hidden // heads if heads > 0 else 0),
            max_position_embeddings=field("max_position_embeddings", int),
            rms_norm_eps=field("rms_norm_eps", float, 1e-6),
            rope_theta=field("rope_theta", float, 10000.0),
            attention_bias=field("attention_bias", bool, False),
            tie_word_embeddings=field("tie_word_embeddings", bool, False),
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
        )
        config.validate(source)
        return config

    def validate(self, source: str = "config.json") -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim",
                     "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise CheckpointError(f"{source}: {name} must be positive, "
                                      f"got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise CheckpointError(
                f"{source}: num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}")
        if self.head_dim % 2:
            raise CheckpointError(f"{source}: head_dim={self.head_dim} must be even for RoPE")
        if self.rms_norm_eps <= 0 or self.rope_theta <= 0:
            raise CheckpointError(f"{source}: rms_norm_eps and rope_theta must be positive")


def load_config(path) -> ModelConfig:
    """A checkpoint directory (or its config.json) -> ModelConfig, with errors naming the file."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise CheckpointError(f"{file}: config.json not found")
    try:
        cfg = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file}: not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{file}: expected a JSON object")
    return ModelConfig.from_dict(cfg, source=str(file))
