"""Small GGUF files written by the tests with the gguf package's own writer and quantizers.

Everything here goes the way llama.cpp's converter goes (Hugging Face -> GGUF), written
independently of minitransformer/formats/gguf.py, which goes back: names by a literal table, the q/k
rows of a llama file put in Meta's interleaved order by an explicit index formula, values
quantized by ``gguf.quants.quantize`` (by quant/'s llama.cpp quantizers for the types that
package cannot quantize), the weights a reader must give back always ``gguf.quants.dequantize``'s.
"""
import json

import numpy as np

from minitransformer.checkpoints.synth import qwen2_config

GGUF_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
              "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
              "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
              "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
              "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
GGUF_TOP = {"model.embed_tokens.weight": "token_embd.weight",
            "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
MATRIX_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL")


def gguf_name(hf: str) -> str:
    if hf in GGUF_TOP:
        return GGUF_TOP[hf]
    _, _, layer, rest = hf.split(".", 3)          # model.layers.N.<module>.<weight|bias>
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{GGUF_LAYER[module]}.{kind}"


def interleave_rows(w, heads):
    """HF's half-split q/k rows -> Meta's interleaved order: GGUF row h*d + 2i + j holds
    HF row h*d + j*d/2 + i."""
    d = w.shape[0] // heads
    order = [h * d + j * (d // 2) + i for h in range(heads) for i in range(d // 2)
             for j in range(2)]
    return w[order]


def llama3_rope_freqs(config: dict) -> np.ndarray:
    """What llama.cpp's converter stores for Llama 3's rope scaling: per RoPE pair, the number
    its frequency is divided by (1 for the fast pairs, factor for the slow, between them the
    inverse of the blended frequency's ratio), float32 (d/2,)."""
    s, d = config["rope_scaling"], config["head_dim"]
    freqs = 1.0 / (config["rope_theta"] ** (np.arange(0, d, 2, dtype=np.float32) / d))
    context, low, high = s["original_max_position_embeddings"], s["low_freq_factor"], \
        s["high_freq_factor"]
    out = []
    for f in freqs:
        wavelength = 2 * np.pi / f
        if wavelength < context / high:
            out.append(1.0)
        elif wavelength > context / low:
            out.append(s["factor"])
        else:
            smooth = (context / wavelength - low) / (high - low)
            out.append(1 / ((1 - smooth) / s["factor"] + smooth))
    return np.array(out, dtype=np.float32)


def store(w, type_name):
    """float32 array -> (array to write, its GGML type, what a correct reader gives back).

    Quantized by the gguf package where it can (F32..Q8_0, Q4_0..Q5_1); the k-quants and IQ4_NL,
    which it cannot, by quant/'s llama.cpp quantizers. Either way what a reader must give back
    is the gguf package's own dequantization of the bytes."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    from quant.gguf_weight import QUANTIZERS

    qtype = GGMLQuantizationType[type_name]
    w = np.ascontiguousarray(w, dtype=np.float32)
    if type_name in QUANTIZERS and type_name not in ("Q8_0", "Q5_0", "Q5_1", "F16"):
        stored = QUANTIZERS[type_name](w.reshape(-1, w.shape[-1]))
    else:
        stored = quantize(w, qtype)
    return stored, qtype, dequantize(stored, qtype).reshape(w.shape).astype(np.float32)


def write_gguf(path, config: dict, weights: dict, types=None, tokenizer=None, pre="gpt2",
               drop_keys=(), extra_tensors=None):
    """Write a GGUF of an HF config + float32 weights; -> the HF weights a reader must give.

    types: HF name -> GGML type name; matrices not named cycle through MATRIX_TYPES, vectors
    are F32. drop_keys: metadata keys to leave out (to test the errors)."""
    from gguf import GGUFWriter, TokenType

    arch = config["model_type"]
    writer = GGUFWriter(str(path), arch)
    keys = {
        "context_length": config["max_position_embeddings"],
        "embedding_length": config["hidden_size"],
        "block_count": config["num_hidden_layers"],
        "feed_forward_length": config["intermediate_size"],
        "attention.head_count": config["num_attention_heads"],
        "attention.head_count_kv": config["num_key_value_heads"],
        "rope.dimension_count": config.get("head_dim") or
        config["hidden_size"] // config["num_attention_heads"],
    }
    if config.get("head_dim"):
        keys["attention.key_length"] = keys["attention.value_length"] = config["head_dim"]
    for key, value in keys.items():
        if f"{arch}.{key}" not in drop_keys:
            writer.add_uint32(f"{arch}.{key}", value)
    if f"{arch}.attention.layer_norm_rms_epsilon" not in drop_keys:
        writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", config["rms_norm_eps"])
    writer.add_float32(f"{arch}.rope.freq_base", config["rope_theta"])
    writer.add_uint32(f"{arch}.vocab_size", config["vocab_size"])
    scaling = config.get("rope_scaling") or {}
    if scaling.get("rope_type") == "linear":
        writer.add_string(f"{arch}.rope.scaling.type", "linear")
        writer.add_float32(f"{arch}.rope.scaling.factor", scaling["factor"])
    elif scaling.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_freqs(config))
    if tokenizer is not None:
        add_tokenizer(writer, tokenizer, pre, TokenType)
    expected, types = {}, dict(types or {})
    for i, (name, w) in enumerate(sorted(weights.items())):
        kind = types.get(name, "F32" if w.ndim == 1 else MATRIX_TYPES[i % len(MATRIX_TYPES)])
        rows = w
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            heads = config["num_attention_heads" if ".q_proj." in name else
                           "num_key_value_heads"]
            rows = interleave_rows(w, heads)
        stored, qtype, _ = store(rows, kind)
        _, _, expected[name] = store(w, kind)  # blocks lie along rows: order does not matter
        writer.add_tensor(gguf_name(name), stored, raw_dtype=qtype)
    for name, (stored, qtype) in (extra_tensors or {}).items():
        writer.add_tensor(name, stored, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


def add_tokenizer(writer, tokenizer, pre, TokenType):
    """A `tokenizers` byte-level BPE -> tokenizer.ggml.* keys, as llama.cpp writes them."""
    model = json.loads(tokenizer.to_str())["model"]
    vocab = model["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    specials = {t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special}
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([TokenType.CONTROL if t in specials else TokenType.NORMAL
                            for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(0)
    writer.add_add_bos_token(False)
    writer.add_chat_template("{% for m in messages %}<|endoftext|>{{ m['role'] }}: "
                             "{{ m['content'] }}\n{% endfor %}"
                             "{% if add_generation_prompt %}assistant:{% endif %}")


# --- GGUF files spelled byte by byte, to break them -----------------------------------------
# A second writer, by hand from the format's description, so that a test can write what no
# correct writer would: a key twice, an offset off the alignment, two tensors on the same bytes.
SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q",
                  11: "q", 12: "d"}
UINT8, INT32, UINT32, FLOAT32, BOOL, STRING, ARRAY = 0, 5, 4, 6, 7, 8, 9   # value types


def gguf_parts(path):
    """A GGUF file -> (metadata entries [key, type, value, element type], tensors [name, dims
    innermost first, GGML type id, bytes]), read with the gguf package's own reader."""
    from gguf import GGUFReader, GGUFValueType

    reader = GGUFReader(path)
    entries = []
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        kind = int(field.types[0])
        item = int(field.types[1]) if field.types[0] == GGUFValueType.ARRAY else None
        entries.append([key, kind, field.contents(), item])
    tensors = [[t.name, [int(n) for n in t.shape], int(t.tensor_type),
                bytes(np.ascontiguousarray(t.data).view(np.uint8).reshape(-1))]
               for t in reader.tensors]
    return entries, tensors


def encode_value(kind, value, item=None) -> bytes:
    import struct

    if kind in SCALAR_FORMATS:
        return struct.pack("<" + SCALAR_FORMATS[kind], value)
    if kind == STRING:
        raw = value.encode("utf-8", "surrogatepass") if isinstance(value, str) else value
        return struct.pack("<Q", len(raw)) + raw
    if kind != ARRAY:           # no GGUF type: four bytes of something
        return struct.pack("<I", value)
    return struct.pack("<IQ", item, len(value)) + b"".join(encode_value(item, v)
                                                           for v in value)


def gguf_bytes(entries, tensors, alignment=32, version=3, offsets=None, magic=b"GGUF",
               counts=None) -> bytes:
    """Spell a GGUF file. offsets: tensor index -> data offset to write instead of the true
    one; counts: (tensors, entries) to claim instead of the true ones."""
    import struct

    n_tensors, n_entries = counts or (len(tensors), len(entries))
    out = magic + struct.pack("<IQQ", version, n_tensors, n_entries)
    for key, kind, value, item in entries:
        out += encode_value(STRING, key) + struct.pack("<I", kind) + encode_value(kind, value,
                                                                                  item)
    data, placed = b"", []
    for name, dims, type_id, raw in tensors:
        data += b"\0" * (-len(data) % alignment)
        placed.append(len(data))
        data += raw
    for i, (name, dims, type_id, raw) in enumerate(tensors):
        offset = (offsets or {}).get(i, placed[i])
        out += encode_value(STRING, name) + struct.pack("<I", len(dims))
        out += struct.pack(f"<{len(dims)}Q", *dims) + struct.pack("<IQ", type_id, offset)
    out += b"\0" * (-len(out) % alignment)
    return out + data


# A small qwen2 for the files that are broken or re-laid-out one thing at a time.
CONFIG = qwen2_config(vocab_size=320, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)


# The same with the matrices in k-quants (rows of 256: whole super-blocks), for the broken
# k-quant files; no tokenizer (a weights-only file loads as well).
K_CONFIG = qwen2_config(vocab_size=320, hidden_size=256, intermediate_size=256,
                        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
K_TYPES = {"mlp.up_proj": "Q4_K", "mlp.down_proj": "Q5_K", "mlp.gate_proj": "Q6_K",
           "self_attn.q_proj": "Q3_K", "self_attn.k_proj": "Q2_K"}
