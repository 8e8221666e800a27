"""The model's shape, read from a Hugging Face ``config.json``.

Field names are the config.json names, so a learner can put the file beside this class and read
them across. Loading keeps the fields the forward pass uses, drops the rest (dropout, init
ranges, ...), fills the documented Hugging Face defaults, and refuses what this implementation
does not do (sliding-window attention, rope scaling other than Llama 3's, linear and dynamic,
activations other than SiLU, MLP biases) instead of computing something else silently.

Three families are supported: Qwen2 (q/k/v projections always carry a bias), Llama (biases on
q/k/v/o only when ``attention_bias`` is true; Llama 3.x stretches RoPE for long contexts,
``RopeScaling``) and Qwen3 (Llama's projections, plus an RMSNorm of each head's query and key
before RoPE, and a head_dim of its own).
"""
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from minitransformer.checks import (
    flag_field,
    integer_field,
    is_integer,
    positive_number_field,
    read_json_object,
    token_ids_field,
)
from minitransformer.errors import CheckpointError

ARCHITECTURES = {"Qwen2ForCausalLM": "qwen2", "LlamaForCausalLM": "llama",
                 "Qwen3ForCausalLM": "qwen3", "MistralForCausalLM": "mistral"}

# Sanity bounds on the sizes, 8x or more beyond the largest published models (vocab 256k,
# hidden 16k, MLP 53k, 126 layers, 128 heads, head_dim 256, 10M positions), checked before
# anything is listed or allocated: `num_hidden_layers: 1000000000` fails here, at once.
SIZE_LIMITS = {"vocab_size": 2 ** 22, "hidden_size": 2 ** 17, "intermediate_size": 2 ** 19,
               "num_hidden_layers": 2 ** 10, "num_attention_heads": 2 ** 12,
               "num_key_value_heads": 2 ** 12, "head_dim": 2 ** 12,
               "max_position_embeddings": 2 ** 28}


@dataclass(frozen=True)
class RopeScaling:
    """How a long-context checkpoint stretches RoPE's angles (config.json's ``rope_scaling``,
    ``rope_parameters`` in newer transformers); model.rope_frequencies applies it.

        linear   every pair turns factor times slower: position p turns as p / factor did
        llama3   (Llama 3.1-3.3) a pair whose wavelength 2 pi / frequency is longer than the
                 trained context / low_freq_factor turns factor times slower; one shorter than
                 the context / high_freq_factor is kept; those between are blended
        dynamic  (NTK) the angles of a model without scaling up to the trained context; past
                 it, transformers raises theta with the sequence's length, which would turn
                 every key already cached: not done here, the model is run within the trained
                 context (max_position_embeddings is that context)

    The trained context is ``original_max_position_embeddings``. A GGUF file stores Llama 3's
    rule worked out: the number each pair's frequency is divided by (``divisors``).
    """
    rope_type: str                         # "linear", "llama3" or "dynamic"
    factor: float
    original_max_position_embeddings: int = 0   # llama3, dynamic: the trained context
    low_freq_factor: float = 1.0           # llama3
    high_freq_factor: float = 4.0          # llama3
    divisors: tuple = ()                   # llama3 from GGUF: (d/2,) frequency divisors


@dataclass(frozen=True)
class ModelConfig:
    model_type: str                 # "qwen2", "llama", "qwen3" or "mistral" (Llama's layers)
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
    rope_scaling: RopeScaling | None = None   # None: RoPE's plain angles
    layer_windows: tuple = ()       # per layer: how many positions back a query sees (its
                                    # own included), None for all; () for none windowed

    def __post_init__(self):
        """A config built in Python (or by ``dataclasses.replace``, as a draft of the first
        layers is) is held to from_dict's rules, under the same messages with the source
        "ModelConfig": a ModelConfig that exists is one the forward pass can run.

        >>> ModelConfig("qwen2", 100, 64, 128, 2.5, 4, 2, 16, 64)
        Traceback (most recent call last):
        ...
        minitransformer.errors.CheckpointError: ModelConfig: field 'num_hidden_layers' must be an integer, got 2.5
        """
        source = "ModelConfig"
        if self.model_type not in ARCHITECTURES.values():
            raise CheckpointError(f"{source}: model_type={self.model_type!r:.100} is not one "
                                  f"of {', '.join(map(repr, ARCHITECTURES.values()))}")
        for name, high in SIZE_LIMITS.items():
            integer_field(source, name, getattr(self, name), 1, high)
        for name in ("rms_norm_eps", "rope_theta"):
            positive_number_field(source, name, getattr(self, name))
        for name in ("attention_bias", "tie_word_embeddings"):
            flag_field(source, name, getattr(self, name))
        if not isinstance(self.torch_dtype, str):
            raise CheckpointError(f"{source}: field 'torch_dtype' must be a name, "
                                  f"got {self.torch_dtype!r:.100}")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise CheckpointError(f"{source}: field 'rope_scaling' must be a RopeScaling or "
                                  f"None, got {self.rope_scaling!r:.100}")
        check_heads(source, self.num_attention_heads, self.num_key_value_heads, self.head_dim)

    @property
    def qkv_bias(self) -> bool:
        """Qwen2 always has q/k/v biases; Llama and Qwen3 have them (and an o_proj bias) on
        request."""
        return self.model_type == "qwen2" or self.attention_bias

    @property
    def o_bias(self) -> bool:
        return self.model_type != "qwen2" and self.attention_bias

    def window(self, layer: int) -> int | None:
        """Layer's sliding window W: a query at position p sees p - W + 1 .. p (None: 0 .. p)."""
        return self.layer_windows[layer] if self.layer_windows else None

    @property
    def sliding_window(self) -> int | None:
        """The window W of the layers that slide (one W per model), None where none does."""
        return max(filter(None, self.layer_windows), default=None)

    @property
    def cache_window(self) -> int | None:
        """How far back any layer looks when every layer slides (the widest W): a sequence's
        keys older than that are read by no later query, so the paged engine frees their
        blocks. None where a layer attends fully: its queries read back to position 0."""
        windows = self.layer_windows
        return self.sliding_window if windows and all(windows) else None

    @property
    def qk_norm(self) -> bool:
        """Qwen3 RMS-normalizes each head's query and key (a gain of d per layer) before RoPE."""
        return self.model_type == "qwen3"

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
        scaling = rope_scaling(cfg, source)
        cfg = nested_rope_theta(cfg)
        for name in ("bos_token_id", "eos_token_id"):  # not kept here, but read elsewhere
            if cfg.get(name) is not None:
                token_ids_field(source, name, cfg[name])
        dtype = torch_dtype(cfg, source)
        heads, hidden = size("num_attention_heads"), size("hidden_size")   # before the fallbacks
        cfg = hf_fallbacks(cfg)                                             # that read them
        layers = size("num_hidden_layers")
        positions = size("max_position_embeddings")
        if scaling is not None and scaling.rope_type == "dynamic":  # run within the trained
            positions = min(positions, scaling.original_max_position_embeddings)   # context
        check_heads(source, heads, size("num_key_value_heads"), size("head_dim"))
        return cls(
            model_type=model_type,
            vocab_size=size("vocab_size"),
            hidden_size=hidden,
            intermediate_size=size("intermediate_size"),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=size("num_key_value_heads"),
            head_dim=size("head_dim"),
            max_position_embeddings=positions,
            rms_norm_eps=positive_number_field(source, "rms_norm_eps",
                                               field(cfg, source, "rms_norm_eps", 1e-6)),
            rope_theta=positive_number_field(source, "rope_theta",
                                             field(cfg, source, "rope_theta", 10000.0)),
            attention_bias=flag("attention_bias"),
            tie_word_embeddings=flag("tie_word_embeddings"),
            torch_dtype=dtype,
            rope_scaling=scaling,
            layer_windows=sliding_windows(cfg, source, model_type, layers),
        )


def check_heads(source, heads: int, kv_heads: int, head_dim: int) -> None:
    """The relations between the heads' fields (each field alone was checked when read)."""
    if heads % kv_heads:
        raise CheckpointError(f"{source}: num_attention_heads={heads} is not a multiple of "
                              f"num_key_value_heads={kv_heads}")
    if head_dim % 2:
        raise CheckpointError(f"{source}: head_dim={head_dim} must be even for RoPE")


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
    else: activations other than SiLU, MLP biases, partial RoPE (rope scaling: rope_scaling;
    sliding windows: sliding_windows)."""
    if cfg.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{source}: hidden_act={cfg['hidden_act']!r:.100} is not "
                              "supported (only silu, the SwiGLU MLP)")
    if flag_field(source, "mlp_bias", field(cfg, source, "mlp_bias", False)):
        raise CheckpointError(f"{source}: mlp_bias=true is not supported")
    if cfg.get("partial_rotary_factor", 1.0) != 1.0:
        raise CheckpointError(f"{source}: partial_rotary_factor="
                              f"{cfg['partial_rotary_factor']!r:.100} (RoPE on part of each head) "
                              "is not supported")


# What each kind of rope scaling reads besides its name ("type" in old configs, "rope_type"),
# and rope_parameters' own rope_theta; any other key is refused by name, never ignored.
ROPE_FIELDS = {"default": (), "linear": ("factor",),
               "dynamic": ("factor", "original_max_position_embeddings"),
               "llama3": ("factor", "original_max_position_embeddings", "low_freq_factor",
                          "high_freq_factor")}


def rope_scaling(cfg: dict, source) -> RopeScaling | None:
    """``rope_scaling`` (or newer transformers' ``rope_parameters``) -> RopeScaling, None for
    RoPE's plain angles; a kind not in ROPE_FIELDS (yarn, longrope, ...) is refused by name.

    Llama-3.2-1B's, as its config.json gives it:
    >>> s = rope_scaling({"rope_scaling": {"rope_type": "llama3", "factor": 32.0,
    ...     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    ...     "original_max_position_embeddings": 8192}}, "config.json")
    >>> s.rope_type, s.factor, s.original_max_position_embeddings
    ('llama3', 32.0, 8192)
    """
    key = "rope_scaling" if cfg.get("rope_scaling") not in (None, {}) else "rope_parameters"
    given = cfg.get(key)
    if given in (None, {}):
        return None
    if not isinstance(given, dict):
        raise CheckpointError(f"{source}: field {key!r} must be an object, got {given!r:.100}")
    kind = given.get("rope_type", given.get("type", "default"))
    if not isinstance(kind, str) or kind not in ROPE_FIELDS:
        raise CheckpointError(f"{source}: {key}.rope_type={kind!r:.100} is not supported "
                              f"(supported: {', '.join(ROPE_FIELDS)})")
    extra = sorted(set(given) - {"rope_type", "type", "rope_theta", *ROPE_FIELDS[kind]})
    if extra:
        raise CheckpointError(f"{source}: {key} field(s) {', '.join(map(repr, extra))} are not "
                              f"supported for rope_type {kind!r}")
    if kind == "default":
        return None
    read: dict[str, Any] = {}  # field -> its value (an int or a float, as the field is)
    for f in ROPE_FIELDS[kind]:
        value = given.get(f)
        if value is None and f == "original_max_position_embeddings" and kind == "dynamic":
            value = cfg.get("max_position_embeddings")      # transformers' fallback
        if value is None:
            raise CheckpointError(f"{source}: {key}.{f} is missing (rope_type {kind!r})")
        read[f] = (integer_field(source, f"{key}.{f}", value, 1,
                                 SIZE_LIMITS["max_position_embeddings"])
                   if f == "original_max_position_embeddings"
                   else positive_number_field(source, f"{key}.{f}", value))
    scaling = RopeScaling(rope_type=kind, **read)
    if kind == "llama3" and not scaling.high_freq_factor > scaling.low_freq_factor:
        raise CheckpointError(f"{source}: {key}.high_freq_factor={scaling.high_freq_factor} "
                              f"must be greater than low_freq_factor={scaling.low_freq_factor}")
    return scaling


LAYER_TYPES = ("full_attention", "sliding_attention")


def sliding_windows(cfg: dict, source, model_type: str, layers: int) -> tuple:
    """-> each layer's window (None: full attention), () when no layer slides.

    Mistral slides every layer by ``sliding_window`` (null: none). Qwen2 and Qwen3 slide only
    with ``use_sliding_window``, the layers ``layer_types`` names "sliding_attention" (older
    configs: layers from ``max_window_layers`` on). Llama has no window.

    >>> sliding_windows({"use_sliding_window": True, "sliding_window": 4096,
    ...                  "max_window_layers": 2}, "config.json", "qwen2", 4)
    (None, None, 4096, 4096)
    """
    if model_type == "llama":
        return ()
    if model_type == "mistral":
        slides = [cfg.get("sliding_window") is not None] * layers
    elif not flag_field(source, "use_sliding_window", cfg.get("use_sliding_window") or False):
        slides = [False] * layers
    elif cfg.get("layer_types") is not None:
        types = cfg["layer_types"]
        if not isinstance(types, list) or len(types) != layers or \
                any(t not in LAYER_TYPES for t in types):
            raise CheckpointError(f"{source}: layer_types must list {layers} of "
                                  f"{', '.join(LAYER_TYPES)}, got {types!r:.100}")
        slides = [t == "sliding_attention" for t in types]
    else:
        first = integer_field(source, "max_window_layers", field(cfg, source, "max_window_layers"),
                              0, layers)
        slides = [i >= first for i in range(layers)]
    if not any(slides):
        return ()
    window = integer_field(source, "sliding_window", field(cfg, source, "sliding_window"), 1,
                           SIZE_LIMITS["max_position_embeddings"])
    return tuple(window if s else None for s in slides)


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
    if filled.get("head_dim") is None and is_integer(heads) and is_integer(hidden) and heads > 0:
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
