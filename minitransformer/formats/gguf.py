"""Read a GGUF file (llama.cpp's model format) into a Model: config, float32 weights, tokenizer.

GGUF is how llama.cpp, Ollama and LM Studio users hold their models: one file with a metadata
table (the config and the tokenizer, under llama.cpp's key names) and the tensors, most of
them in block formats (gguf_types.py lists those read). The container is read and checked by
gguf_file.py; everything after that is done here:

1. metadata -> ModelConfig, naming the GGUF key that is missing or wrong;
2. tensor names -> Hugging Face names (``blk.3.attn_q.weight`` ->
   ``model.layers.3.self_attn.q_proj.weight``), each dequantized to float32 and checked
   against the shape the config implies;
3. for the llama architecture, llama.cpp's q/k row permutation undone (see ``unpermute``);
4. the byte-level BPE tokenizer rebuilt from the vocabulary and merges, plus the chat template
   (gguf_tokenizer.py). A file with no tokenizer metadata at all loads weights-only (a model
   that takes token ids); one with part of it is an error.

Supports the llama, qwen2 and qwen3 architectures and byte-level BPE vocabularies (``gpt2``,
as SmolLM2, Qwen2, Qwen3 and Llama 3 have), with rope scaling as llama.cpp's converter writes
it: linear as ``rope.scaling.type``, Llama 3's as the tensor ``rope_freqs.weight``, the number
each pair's frequency is divided by. Leaves out: SentencePiece vocabularies, other rope
scalings, and the tensor types gguf_types.py does not decode; each is an error that says which.
"""
import dataclasses
import math

import numpy as np

from minitransformer.backend import to_device
from minitransformer.checks import check_finite, check_missing, is_integer, is_real
from minitransformer.config import SIZE_LIMITS, ModelConfig, RopeScaling
from minitransformer.errors import CheckpointError
from minitransformer.formats.gguf_file import GGUFFile
from minitransformer.formats.gguf_tokenizer import tokenizer_from_metadata
from minitransformer.formats.gguf_types import dequantize
from minitransformer.model import Model
from minitransformer.shape import tensor_shapes
from minitransformer.tokenizer import Tokenizer

ARCHITECTURES = ("llama", "qwen2", "qwen3")
ROPE_FREQS = "rope_freqs.weight"   # Llama 3's rope scaling: each pair's frequency divisor

# GGUF tensor name (after "blk.N.") -> Hugging Face name (after "model.layers.N.")
LAYER_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
               "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
               "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
               "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
               "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
             "output": "lm_head"}
# GGUF metadata key (after "<arch>.") -> the config.json field it fills, for the size limits
HF_FIELDS = {"embedding_length": "hidden_size", "feed_forward_length": "intermediate_size",
             "block_count": "num_hidden_layers", "attention.head_count": "num_attention_heads",
             "attention.head_count_kv": "num_key_value_heads",
             "attention.key_length": "head_dim", "vocab_size": "vocab_size",
             "context_length": "max_position_embeddings"}


def config_from_metadata(meta: dict, tensor_names, source: str, rope_freqs=None) -> ModelConfig:
    """GGUF metadata -> ModelConfig, with errors that name the GGUF key. rope_freqs: the
    file's rope_freqs.weight, as float32 (d/2,), when it has one."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise CheckpointError(f"{source}: general.architecture={arch!r} is not supported "
                              f"(supported: {', '.join(ARCHITECTURES)})")

    def number(key, kind=int, default=None):
        """A count (an integer >= 1, within config.py's SIZE_LIMITS for the field it fills)
        or a finite number > 0, named by its GGUF key when wrong."""
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise CheckpointError(f"{source}: GGUF metadata {arch}.{key} is missing")
        ok = is_integer(value) if kind is int else is_real(value) and math.isfinite(value)
        if not ok or value <= 0:
            raise CheckpointError(f"{source}: GGUF metadata {arch}.{key} must be "
                                  f"{'an integer >= 1' if kind is int else 'a number > 0'}, "
                                  f"got {value!r:.100}")
        high = SIZE_LIMITS.get(HF_FIELDS[key]) if key in HF_FIELDS else None
        if high is not None and value > high:
            raise CheckpointError(f"{source}: GGUF metadata {arch}.{key}={value} is more "
                                  f"than {high}, beyond any model this reads")
        if kind is float:  # GGUF keeps float32: 1e-5 reads 9.99999974e-06; take the shortest
            return float(str(np.float32(value)))  # decimal that gives the same float32 back
        return int(value)

    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", "linear"):
        raise CheckpointError(f"{source}: rope scaling {arch}.rope.scaling.type={scaling!r:.100} "
                              "is not supported (supported: none, linear)")
    heads, hidden = number("attention.head_count"), number("embedding_length")
    if f"{arch}.attention.key_length" not in meta and hidden % heads:
        raise CheckpointError(f"{source}: {arch}.embedding_length={hidden} is not a multiple "
                              f"of {arch}.attention.head_count={heads}")
    head_dim = number("attention.key_length", int, hidden // heads)
    rotated = number("rope.dimension_count", int, head_dim)
    if rotated != head_dim:
        raise CheckpointError(f"{source}: {arch}.rope.dimension_count={rotated} but the head "
                              f"dimension is {head_dim}: partial RoPE is not supported")
    kv_heads = number("attention.head_count_kv", int, heads)
    if heads % kv_heads:
        raise CheckpointError(f"{source}: {arch}.attention.head_count={heads} is not a "
                              f"multiple of {arch}.attention.head_count_kv={kv_heads}")
    if head_dim % 2:
        raise CheckpointError(f"{source}: the head dimension {head_dim} "
                              f"({arch}.attention.key_length, else embedding_length / "
                              "head_count) must be even for RoPE")
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = number("vocab_size", int, len(tokens) if isinstance(tokens, list) and tokens
                   else None)
    cfg = {
        "model_type": arch, "vocab_size": vocab, "hidden_size": hidden,
        "intermediate_size": number("feed_forward_length"),
        "num_hidden_layers": number("block_count"), "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim, "max_position_embeddings": number("context_length"),
        "rms_norm_eps": number("attention.layer_norm_rms_epsilon", float),
        "rope_theta": number("rope.freq_base", float, 10000.0),
        # Llama's and Qwen3's optional attention biases are visible only as tensors; the output
        # head is tied to the embedding exactly when the file stores no separate output.weight.
        "attention_bias": arch != "qwen2" and "blk.0.attn_q.bias" in tensor_names,
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "torch_dtype": "float32",
    }
    if scaling == "linear":
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": number("rope.scaling.factor",
                                                                       float)}
    config = ModelConfig.from_dict(cfg, source=f"{source} (GGUF metadata)")
    if rope_freqs is None:
        return config
    if scaling != "none" or rope_freqs.shape != (head_dim // 2,) or \
            not np.all(np.isfinite(rope_freqs) & (rope_freqs > 0)):
        raise CheckpointError(f"{source}: tensor {ROPE_FREQS!r} must hold {head_dim // 2} "
                              "finite numbers > 0 (one per RoPE pair) and come without "
                              f"{arch}.rope.scaling.type; got shape {rope_freqs.shape}")
    return dataclasses.replace(config, rope_scaling=RopeScaling(
        rope_type="llama3", factor=float(rope_freqs.max()),
        divisors=tuple(float(f) for f in rope_freqs)))


def hf_name(name: str) -> str | None:
    """GGUF tensor name -> Hugging Face name, None when the name is not one we know."""
    parts = name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in LAYER_NAMES:
        return f"model.layers.{parts[1]}.{LAYER_NAMES[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in TOP_NAMES:
        return f"{TOP_NAMES[parts[0]]}.{parts[1]}"
    return None


def gguf_name(name: str) -> str:
    """Hugging Face name -> the GGUF tensor name hf_name reads as it (the inverse).

    >>> gguf_name("model.layers.3.self_attn.q_proj.weight"), gguf_name("lm_head.weight")
    ('blk.3.attn_q.weight', 'output.weight')
    """
    for short, long in LAYER_NAMES.items():
        head, dot, kind = name.rpartition(".")
        if head.startswith("model.layers.") and head.endswith("." + long):
            layer = head[len("model.layers."):-len(long) - 1]
            return f"blk.{layer}.{short}.{kind}"
    for short, long in TOP_NAMES.items():
        if name.rpartition(".")[0] == long:
            return f"{short}.{name.rpartition('.')[2]}"
    return name


def unpermute(w, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation: (heads * d, ...) -> (heads * d, ...).

    Meta's original Llama rotates *adjacent* pairs (x[2i], x[2i+1]) with RoPE; Hugging Face's
    checkpoints permute the rows of q_proj and k_proj so that the half-split rotation of
    model.py (pairs (x[i], x[i + d/2])) gives the same attention. llama.cpp's converter puts
    the rows back in Meta's interleaved order, because its llama kernel rotates adjacent
    pairs: GGUF keeps Meta's interleaved RoPE pairs. Within each head, GGUF row 2i + j is
    HF row j * d/2 + i; this undoes it. (qwen2 files are stored in HF's order: llama.cpp
    rotates them the half-split way, so they need nothing.)

    >>> unpermute(np.arange(8), heads=2)   # two heads of d = 4: rows (0 1 2 3)(4 5 6 7)
    array([0, 2, 1, 3, 4, 6, 5, 7])
    """
    rows = w.shape[0]
    w = w.reshape(heads, rows // heads // 2, 2, *w.shape[1:])    # (heads, d/2, 2, ...)
    return w.swapaxes(1, 2).reshape(rows, *w.shape[3:])          # (heads, 2, d/2, ...)


def read_weights(file: GGUFFile, config: ModelConfig) -> dict:
    """Every tensor of the file, dequantized to float32 and renamed; checked against config."""
    expected, source = tensor_shapes(config), file.path
    weights = {}
    for t in file.tensors:
        if t.name == ROPE_FREQS:            # read into the config (read_model)
            continue
        name = hf_name(t.name)
        if name is None or name not in expected:
            raise CheckpointError(f"{source}: unexpected tensor {t.name!r} "
                                  f"for a {config.model_type} model of this config")
        if t.shape != expected[name]:
            raise CheckpointError(f"{source}: tensor {t.name!r} has shape {t.shape} but the "
                                  f"metadata implies {expected[name]} for {name}")
        w = decoded(file, t, t.shape)
        if config.model_type == "llama" and name.split(".")[-2] in ("q_proj", "k_proj"):
            heads = (config.num_attention_heads if "q_proj" in name
                     else config.num_key_value_heads)
            w = unpermute(w, heads)
        weights[name] = check_finite(source, t.name, w)
    check_missing(source, map(gguf_name, expected), map(gguf_name, weights))  # the file's names
    return weights


def decoded(file: GGUFFile, t, shape) -> np.ndarray:
    """Tensor t of the file, dequantized to float32 (sizes were checked by GGUFFile; the
    scales not: a bad one is an error naming the tensor)."""
    try:
        return dequantize(file.raw(t), t.type_name, shape)
    except ValueError as e:
        raise CheckpointError(f"{file.path}: tensor {t.name!r}: {e}") from None


def read_model(path) -> tuple[Model, dict, dict]:
    """A .gguf file -> (Model, its metadata, GGUF type name -> number of tensors stored so)."""
    file = GGUFFile.open(path)
    meta, source = file.metadata, file.path
    freqs = [t for t in file.tensors if t.name == ROPE_FREQS]
    rope_freqs = None if not freqs else check_finite(
        source, ROPE_FREQS, decoded(file, freqs[0], freqs[0].shape))
    config = config_from_metadata(meta, {t.name for t in file.tensors}, source, rope_freqs)
    tokenizer: Tokenizer | None = tokenizer_from_metadata(meta, config.vocab_size, source)
    weights = {n: to_device(w) for n, w in read_weights(file, config).items()}
    eos = meta.get("tokenizer.ggml.eos_token_id")
    model = Model(config=config, weights=weights, tokenizer=tokenizer,
                  eos_token_ids=() if eos is None else (eos,), path=source)
    types: dict[str, int] = {}
    for t in file.tensors:
        types[t.type_name] = types.get(t.type_name, 0) + 1
    return model, meta, types


def load_gguf(path) -> Model:
    """A .gguf file -> Model (float32 weights on the active backend, tokenizer, eos ids)."""
    return read_model(path)[0]
