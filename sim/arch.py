"""The handful of architecture numbers the cost models read, from any kind of config.

sim/ has to work with whatever describes a model: the core's `ModelConfig` (its attribute
names are the HF config.json names), a plain dict, or the path of a config.json (or of the
checkpoint directory that holds one). `arch(config)` turns any of them into one frozen `Arch`;
`kv_dims(config)` reads only the three numbers the KV-cache formula needs, so a hypothetical
model can be described by just those.

Two HF conventions are honoured because real config.json files rely on them:
- `head_dim` absent (Qwen2, older Llama): head_dim = hidden_size // num_attention_heads;
- `num_key_value_heads` absent (plain multi-head configs): it equals num_attention_heads.

Serves experiments 3, 8-11 and 24. Leaves out everything that costs no bytes or MACs worth
counting here (norm eps, RoPE, dtypes).
"""
import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Arch:
    """Shapes of a decoder-only transformer (Qwen2/Llama layout), HF field names."""
    hidden_size: int            # D
    intermediate_size: int      # F
    num_hidden_layers: int      # L
    num_attention_heads: int    # H
    num_key_value_heads: int    # Hkv
    head_dim: int               # d
    vocab_size: int             # V
    tie_word_embeddings: bool = False
    qkv_bias: bool = False      # q/k/v projections carry a bias (Qwen2 always does)
    o_bias: bool = False        # so does o_proj (Llama with attention_bias)


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


def _as_source(config):
    """Path-like -> dict; dicts and config objects pass through."""
    if isinstance(config, (str, Path)):
        return read_config_json(config)
    return config


def _get(config, name):
    """A field of a dict or an attribute of an object; None when absent."""
    if isinstance(config, dict):
        return config.get(name)
    return getattr(config, name, None)


def _positive_int(config, name, fallback=None):
    value = _get(config, name)
    if value is None:
        value = fallback
    if value is None:
        raise ValueError(f"model config has no {name!r}")
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not is_number or not float(value).is_integer() or value < 1:
        raise ValueError(f"model config {name}={value!r}: expected a positive integer")
    return int(value)


def query_heads(config):
    """config -> num_attention_heads (H), needed where MHA is the comparison."""
    return _positive_int(_as_source(config), "num_attention_heads")


def kv_dims(config):
    """config -> (layers, kv_heads, head_dim), the only shapes the KV cache depends on."""
    config = _as_source(config)
    heads = _get(config, "num_attention_heads")
    hidden = _get(config, "hidden_size")
    derived_head_dim = hidden // heads if hidden and heads else None
    layers = _positive_int(config, "num_hidden_layers")
    kv_heads = _positive_int(config, "num_key_value_heads", fallback=heads)
    head_dim = _positive_int(config, "head_dim", fallback=derived_head_dim)
    return layers, kv_heads, head_dim


def arch(config):
    """A config object, dict, or config.json path -> Arch, validated."""
    if isinstance(config, Arch):
        return config
    config = _as_source(config)
    layers, kv_heads, head_dim = kv_dims(config)
    heads = query_heads(config)
    if heads % kv_heads:
        raise ValueError(f"num_attention_heads={heads} is not a multiple of "
                         f"num_key_value_heads={kv_heads}")
    # Qwen2's config.json has no attention_bias key: its q/k/v bias is part of the type.
    qwen2 = _get(config, "model_type") == "qwen2"
    bias = bool(_get(config, "attention_bias"))
    return Arch(
        hidden_size=_positive_int(config, "hidden_size"),
        intermediate_size=_positive_int(config, "intermediate_size"),
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=head_dim, vocab_size=_positive_int(config, "vocab_size"),
        tie_word_embeddings=bool(_get(config, "tie_word_embeddings")),
        qkv_bias=qwen2 or bias, o_bias=bias and not qwen2,
    )


def parameter_count(config):
    """Number of parameters: embeddings, L blocks (attention, MLP, 2 norms), final norm, head."""
    a = arch(config)
    D, F, H, Hkv, d = (a.hidden_size, a.intermediate_size, a.num_attention_heads,
                       a.num_key_value_heads, a.head_dim)
    attention = D * H * d + 2 * D * Hkv * d + H * d * D  # q, k, v, o
    attention += (H * d + 2 * Hkv * d) * a.qkv_bias + D * a.o_bias
    block = attention + 3 * D * F + 2 * D  # + gate/up/down + two RMSNorm weights
    embeddings = a.vocab_size * D * (1 if a.tie_word_embeddings else 2)
    return a.num_hidden_layers * block + D + embeddings

