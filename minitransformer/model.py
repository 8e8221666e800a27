"""The decoder-only transformer of the chapter, as functions over arrays (Qwen2 and Llama).

    ids -> embed -> L x [ h += attention(rms_norm(h)) ; h += mlp(rms_norm(h)) ] -> rms_norm -> head

One forward function serves every way of running the model: with no cache it recomputes the
whole sequence (the slow path of experiment 1); with a cache it appends the new tokens' keys and
values and attends over everything held (prefill is a call with the whole prompt, decode a call
with one token per sequence). The cache can be the contiguous KVCache or the paged one: the
forward pass only asks it where the new tokens go and for the keys/values to attend over.

Shape alphabet: B batch, T new tokens, S cached + new positions, D hidden, H query heads,
Hkv key/value heads, G = H / Hkv queries per kv head, d head dim, F MLP width, V vocab.

All math is float32. Follows Hugging Face's Qwen2/Llama modelling (half-split RoPE, repeat_kv
head order); leaves out training, dropout, rope scaling and sliding windows.
"""
from dataclasses import dataclass

import numpy as np  # host-side bookkeeping only (positions); the math goes through xp

from minitransformer.backend import to_device, xp
from minitransformer.config import ModelConfig


@dataclass(frozen=True)
class Model:
    config: ModelConfig
    weights: dict            # HF tensor name -> float32 array (or a quantized weight)
    tokenizer: object = None  # minitransformer.tokenizer.Tokenizer, or None
    eos_token_ids: tuple = ()
    path: str = ""


def linear(x, w, b=None):
    """x (..., in) @ w (out, in).T + b -> (..., out). A quantized weight multiplies itself."""
    y = w.matmul(x) if hasattr(w, "matmul") else x @ w.T
    return y if b is None else y + b


def rms_norm(x, weight, eps):
    """(..., D) -> (..., D): scale each vector to unit root-mean-square, then by a learned gain."""
    variance = xp.mean(x * x, axis=-1, keepdims=True)  # (..., 1)
    return weight * (x / xp.sqrt(variance + eps))


def rope(x, positions, theta):
    """Rotary position embedding, Hugging Face's half-split convention.

    x (B, T, h, d), positions (B, T) -> (B, T, h, d). Pair i of each head is (x[i], x[i + d/2]),
    rotated by the angle position * theta^(-2i/d). (llama2.c rotates adjacent pairs (2i, 2i+1)
    instead; HF checkpoints permute q/k rows so that this split is right for them.)
    """
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (xp.arange(0, d, 2, dtype=xp.float32) / d))  # (d/2,)
    angles = positions[..., None].astype(xp.float32) * inv_freq               # (B, T, d/2)
    angles = xp.concatenate([angles, angles], axis=-1)[:, :, None, :]          # (B, T, 1, d)
    rotated = xp.concatenate([-x[..., d // 2:], x[..., : d // 2]], axis=-1)    # rotate_half
    return x * xp.cos(angles) + rotated * xp.sin(angles)


def softmax(x):
    """Along the last axis; subtracting the max keeps exp from overflowing."""
    e = xp.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def attention(q, k, v, positions):
    """Grouped-query attention with a causal mask given by positions.

    q (B, T, H, d); k, v (B, Hkv, S, d) where slot j holds position j; positions (B, T).
    -> (B, T, H*d). Query head h reads kv head h // G: the queries are grouped, the keys are
    never repeated, so the cache holds Hkv heads and no more.
    """
    B, T, H, d = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    G = H // Hkv
    q = q.reshape(B, T, Hkv, G, d).transpose(0, 2, 3, 1, 4).reshape(B, Hkv, G * T, d)
    scores = (q @ k.transpose(0, 1, 3, 2)) * (1.0 / d ** 0.5)       # (B, Hkv, G*T, S)
    # Causal: the query at position p sees slots 0..p. Slots past a row's length (other rows of
    # a batch, rolled-back drafts) are hidden by the same rule.
    visible = xp.arange(S)[None, None, :] <= positions[:, :, None]  # (B, T, S)
    scores = xp.where(visible[:, None, None], scores.reshape(B, Hkv, G, T, S), -xp.inf)
    weights = softmax(scores).reshape(B, Hkv, G * T, S)
    out = weights @ v                                                # (B, Hkv, G*T, d)
    return out.reshape(B, Hkv, G, T, d).transpose(0, 3, 1, 2, 4).reshape(B, T, H * d)


def attention_block(model, i, x, positions, cache):
    """Layer i's self-attention on normed input x (B, T, D) -> (B, T, D).

    positions (B, T) on the host. Rows of a batch may hold different lengths (sequences decoding
    side by side); each group of rows of equal length attends over exactly its own slots.
    Padding short rows with masked slots would be exact in real arithmetic but not in floats
    (softmax's pairwise sum groups its terms by count, BLAS picks its kernel by size), and a
    batched request must get the very bits it gets alone.
    """
    c, w, p = model.config, model.weights, f"model.layers.{i}.self_attn."
    B, T, _ = x.shape
    where = to_device(positions)
    q = linear(x, w[p + "q_proj.weight"], w.get(p + "q_proj.bias"))  # (B, T, H*d)
    k = linear(x, w[p + "k_proj.weight"], w.get(p + "k_proj.bias"))  # (B, T, Hkv*d)
    v = linear(x, w[p + "v_proj.weight"], w.get(p + "v_proj.bias"))  # (B, T, Hkv*d)
    q = rope(q.reshape(B, T, c.num_attention_heads, c.head_dim), where, c.rope_theta)
    k = rope(k.reshape(B, T, c.num_key_value_heads, c.head_dim), where, c.rope_theta)
    v = v.reshape(B, T, c.num_key_value_heads, c.head_dim)
    if cache is None:  # recompute: this call's tokens are the whole sequence
        k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)     # (B, Hkv, T, d)
    else:              # store the new keys/values, attend over everything held
        k, v = cache.update(i, k, v)                                 # (B, Hkv, S, d)
    lengths = positions[:, -1] + 1                                   # (B,) slots each row sees
    if (lengths == lengths[0]).all():                                # the usual case: one group
        out = attention(q, k[:, :, :lengths[0]], v[:, :, :lengths[0]], where)
    else:
        out = xp.empty((B, T, c.num_attention_heads * c.head_dim), dtype=q.dtype)
        for S in np.unique(lengths):
            rows = to_device(np.flatnonzero(lengths == S))
            out[rows] = attention(q[rows], k[rows, :, :S], v[rows, :, :S], where[rows])
    return linear(out, w[p + "o_proj.weight"], w.get(p + "o_proj.bias"))      # (B, T, D)


def mlp(model, i, x):
    """SwiGLU: down(silu(gate(x)) * up(x)), (B, T, D) -> (B, T, D)."""
    w, p = model.weights, f"model.layers.{i}.mlp."
    gate = linear(x, w[p + "gate_proj.weight"])                      # (B, T, F)
    up = linear(x, w[p + "up_proj.weight"])                          # (B, T, F)
    silu = gate * (0.5 * (1.0 + xp.tanh(0.5 * gate)))  # x*sigmoid(x), written not to overflow
    return linear(silu * up, w[p + "down_proj.weight"])              # (B, T, D)


def forward(model: Model, ids, cache=None, residuals=None):
    """Token ids (B, T) -> final hidden states (B, T, D), after the last RMSNorm.

    Without a cache the T tokens are the whole sequence (positions 0..T-1). With one they are
    appended to what it holds: positions continue from each row's length, and the cache has
    grown by T when this returns. ``residuals``, if a list, receives h (B, T, D) after each layer.
    """
    c, w = model.config, model.weights
    ids = np.asarray(ids)  # host token ids, checked here: on CuPy a bad id would wrap around
    if ids.ndim != 2 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"ids must be a non-empty integer array (B, T), got shape {ids.shape} "
                         f"of {ids.dtype}")
    B, T = ids.shape
    if ids.min() < 0 or ids.max() >= c.vocab_size:
        raise ValueError(f"token ids must be in [0, {c.vocab_size}), got {ids.min()}..{ids.max()}")
    if cache is None:
        positions = np.broadcast_to(np.arange(T), (B, T))            # (B, T)
    else:
        positions = cache.positions(T)                               # (B, T), checked on host
    if positions.max() >= c.max_position_embeddings:
        raise ValueError(f"position {positions.max()} is beyond the model's "
                         f"{c.max_position_embeddings} positions")
    h = w["model.embed_tokens.weight"][to_device(ids)]               # (B, T, D)
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        h = h + attention_block(model, i, rms_norm(h, w[p + "input_layernorm.weight"],
                                                   c.rms_norm_eps), positions, cache)
        h = h + mlp(model, i, rms_norm(h, w[p + "post_attention_layernorm.weight"],
                                       c.rms_norm_eps))
        if residuals is not None:
            residuals.append(h)
    if cache is not None:
        cache.advance(T)
    return rms_norm(h, w["model.norm.weight"], c.rms_norm_eps)


def head(model: Model, hidden):
    """Hidden states (B, T, D) -> logits (B, T, V). A tied model reuses the embedding matrix."""
    tied = model.config.tie_word_embeddings
    return linear(hidden, model.weights["model.embed_tokens.weight" if tied else "lm_head.weight"])
