"""The model's shape, defined once from its ModelConfig: the tensors it holds, how many
parameters that is, and the weight bytes one decode step reads. The loader checks checkpoints
against ``tensor_shapes``; sim/ counts parameters, and the benchmarks and experiments divide by
``decode_read_bytes``, all from here. The KV-cache bytes one token adds depend on the cache's
format too: ``kvquant.cache_bytes_per_token``.

Worked on the chapter's Qwen2.5-0.5B (24 layers, D = 896, 14 q heads and 2 kv heads of 64,
F = 4864, V = 151,936, tied head, q/k/v biases):
>>> from minitransformer.config import ModelConfig
>>> from minitransformer.checkpoints.synth import qwen25_05b_config
>>> qwen = ModelConfig.from_dict(qwen25_05b_config())
>>> tensor_shapes(qwen)["model.layers.0.self_attn.k_proj.weight"]          # (Hkv*d, D)
(128, 896)
>>> parameter_count(qwen)                                   # as its model card counts them
494032768
>>> decode_read_bytes(qwen) - 4 * parameter_count(qwen)    # float32; the tied head reads the
3584
>>> # embedding matrix in full, and the lookup one row more (896 floats)

Leaves out: activations, the cache a step reads (experiment 7 prints it beside), the bytes a
quantized scheme adds (pass the model's ``weights``).
"""
from math import prod

EMBEDDING = "model.embed_tokens.weight"


def ceil_div(a: int, b: int) -> int:
    """The integer ceiling of a / b, exact for any size (no float): ceil_div(17, 16) == 2."""
    return -(-a // b)


def tensor_shapes(c) -> dict[str, tuple[int, ...]]:
    """Every tensor name the config implies -> its shape (HF layout: a Linear is (out, in))."""
    D, F, d = c.hidden_size, c.intermediate_size, c.head_dim
    H, Hkv = c.num_attention_heads, c.num_key_value_heads
    shapes = {EMBEDDING: (c.vocab_size, D), "model.norm.weight": (D,)}
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
        if c.qk_norm:
            shapes |= {p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)}
    return shapes


def parameter_count(c) -> int:
    """Every weight the model holds; a tied head is the embedding, counted once."""
    return sum(prod(shape) for shape in tensor_shapes(c).values())


def decode_read_bytes(c, weights: dict | None = None) -> int:
    """Weight bytes one decode step reads at batch 1: the floor on its time is this divided
    by the memory bandwidth.

    Every tensor is read once, except the embedding, of which the step looks up one row; a
    tied head then reads the embedding matrix in full, as the head. weights: a model's weights
    dict (arrays or quantized weights: each counts its .nbytes); without it, float32, which
    is what the model computes in. Tensors the config does not name are not read.
    """
    shapes = tensor_shapes(c)
    held = ({name: int(weights[name].nbytes) for name in shapes} if weights is not None else
            {name: 4 * prod(shape) for name, shape in shapes.items()})
    embedding = held[EMBEDDING]
    total = sum(held[name] for name in shapes) - embedding + embedding // c.vocab_size
    return total + (embedding if c.tie_word_embeddings else 0)
