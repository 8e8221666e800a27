"""Read a GGUF file (llama.cpp's model format) into a Model: config, float32 weights, tokenizer.

GGUF is how llama.cpp, Ollama and LM Studio users hold their models: one file with a metadata
table (the config and the tokenizer, under llama.cpp's key names) and the tensors, most of
them in block formats (gguf_blocks.py). The container is read with the ``gguf`` package, the
llama.cpp project's own numpy reader; everything after that is done here:

1. metadata -> ModelConfig, naming the GGUF key that is missing or wrong;
2. tensor names -> Hugging Face names (``blk.3.attn_q.weight`` ->
   ``model.layers.3.self_attn.q_proj.weight``), each dequantized to float32 and checked
   against the shape the config implies;
3. for the llama architecture, llama.cpp's q/k row permutation undone (see ``unpermute``);
4. the byte-level BPE tokenizer rebuilt from the vocabulary and merges, plus the chat template.

Supports the llama and qwen2 architectures and byte-level BPE vocabularies (``gpt2``, as
SmolLM2, Qwen2 and Llama 3 have). Leaves out: SentencePiece vocabularies, rope scaling,
and the block formats gguf_blocks.py does not decode; each is an error that says which.
"""
from pathlib import Path

import numpy as np

from minitransformer.backend import to_device
from minitransformer.checks import check_finite, check_missing, is_real
from minitransformer.config import ModelConfig
from minitransformer.errors import CheckpointError
from minitransformer.formats.gguf_blocks import dequantize
from minitransformer.formats.gguf_tokenizer import tokenizer_from_metadata
from minitransformer.model import Model
from minitransformer.shape import tensor_shapes
from minitransformer.tokenizer import Tokenizer

ARCHITECTURES = ("llama", "qwen2")

# GGUF tensor name (after "blk.N.") -> Hugging Face name (after "model.layers.N.")
LAYER_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
               "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
               "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
               "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
             "output": "lm_head"}


def read(path):
    """-> gguf.GGUFReader over the file (memory-mapped), or a CheckpointError naming it."""
    from gguf import GGUFReader  # imported here: the rest of the library runs without it

    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: GGUF file not found")
    try:
        return GGUFReader(path)
    except (ValueError, OSError, IndexError) as e:  # bad magic, truncated, unknown version
        raise CheckpointError(f"{path}: not a readable GGUF file ({e})") from None


def metadata(reader) -> dict:
    """Every metadata field -> its Python value (strings, numbers, lists)."""
    return {name: field.contents() for name, field in reader.fields.items()
            if not name.startswith("GGUF.")}


def config_from_metadata(meta: dict, tensor_names, source: str) -> ModelConfig:
    """GGUF metadata -> ModelConfig, with errors that name the GGUF key."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise CheckpointError(f"{source}: general.architecture={arch!r} is not supported "
                              f"(supported: {', '.join(ARCHITECTURES)})")

    def number(key, kind=int, default=None):
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise CheckpointError(f"{source}: GGUF metadata {arch}.{key} is missing")
        if not is_real(value) or (kind is int and value != int(value)):
            raise CheckpointError(f"{source}: GGUF metadata {arch}.{key} must be "
                                  f"{'an integer' if kind is int else 'a number'}, "
                                  f"got {value!r}")
        if kind is float:  # GGUF keeps float32: 1e-5 reads 9.99999974e-06; take the shortest
            return float(str(np.float32(value)))  # decimal that gives the same float32 back
        return int(value)

    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling != "none" or "rope_freqs.weight" in tensor_names:
        raise CheckpointError(f"{source}: rope scaling ({arch}.rope.scaling.type={scaling!r}) "
                              "is not supported")
    heads, hidden = number("attention.head_count"), number("embedding_length")
    head_dim = number("attention.key_length", int, hidden // heads if heads > 0 else 0)
    rotated = number("rope.dimension_count", int, head_dim)
    if rotated != head_dim:
        raise CheckpointError(f"{source}: {arch}.rope.dimension_count={rotated} but the head "
                              f"dimension is {head_dim}: partial RoPE is not supported")
    vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens") or ())
    cfg = {
        "model_type": arch, "vocab_size": vocab, "hidden_size": hidden,
        "intermediate_size": number("feed_forward_length"),
        "num_hidden_layers": number("block_count"), "num_attention_heads": heads,
        "num_key_value_heads": number("attention.head_count_kv", int, heads),
        "head_dim": head_dim, "max_position_embeddings": number("context_length"),
        "rms_norm_eps": number("attention.layer_norm_rms_epsilon", float),
        "rope_theta": number("rope.freq_base", float, 10000.0),
        # Llama's optional attention biases are visible only as tensors; the output head is
        # tied to the embedding exactly when the file stores no separate output.weight.
        "attention_bias": arch == "llama" and "blk.0.attn_q.bias" in tensor_names,
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "torch_dtype": "float32",
    }
    return ModelConfig.from_dict(cfg, source=f"{source} (GGUF metadata)")


def hf_name(name: str) -> str | None:
    """GGUF tensor name -> Hugging Face name, None when the name is not one we know."""
    parts = name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in LAYER_NAMES:
        return f"model.layers.{parts[1]}.{LAYER_NAMES[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in TOP_NAMES:
        return f"{TOP_NAMES[parts[0]]}.{parts[1]}"
    return None


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


def read_weights(reader, config: ModelConfig, source: str) -> dict:
    """Every tensor of the file, dequantized to float32 and renamed; checked against config."""
    expected = tensor_shapes(config)
    weights = {}
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None or name not in expected:
            raise CheckpointError(f"{source}: unexpected tensor {t.name!r} "
                                  f"for a {config.model_type} model of this config")
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))  # GGUF lists (in, out)
        if shape != expected[name]:
            raise CheckpointError(f"{source}: tensor {t.name!r} has shape {shape} but the "
                                  f"metadata implies {expected[name]} for {name}")
        try:
            w = dequantize(t.data, t.tensor_type.name, shape)
        except ValueError as e:
            raise CheckpointError(f"{source}: tensor {t.name!r}: {e}") from None
        if config.model_type == "llama" and name.split(".")[-2] in ("q_proj", "k_proj"):
            heads = (config.num_attention_heads if "q_proj" in name
                     else config.num_key_value_heads)
            w = unpermute(w, heads)
        weights[name] = check_finite(source, t.name, w)
    check_missing(source, expected, weights)
    return weights


def read_model(path) -> tuple[Model, dict, dict]:
    """A .gguf file -> (Model, its metadata, GGUF type name -> number of tensors stored so)."""
    reader = read(path)
    meta = metadata(reader)
    config = config_from_metadata(meta, {t.name for t in reader.tensors}, str(path))
    weights = {n: to_device(w) for n, w in read_weights(reader, config, str(path)).items()}
    tokenizer: Tokenizer | None = tokenizer_from_metadata(meta, str(path))
    eos = meta.get("tokenizer.ggml.eos_token_id")
    model = Model(config=config, weights=weights, tokenizer=tokenizer,
                  eos_token_ids=() if eos is None else (int(eos),), path=str(path))
    types = {}
    for t in reader.tensors:
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
    return model, meta, types


def load_gguf(path) -> Model:
    """A .gguf file -> Model (float32 weights on the active backend, tokenizer, eos ids)."""
    return read_model(path)[0]
