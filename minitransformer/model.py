"""The decoder-only transformer of the chapter, as functions over arrays (Qwen2 and Llama).

    ids -> embed -> L x [ h += attention(rms_norm(h)) ; h += mlp(rms_norm(h)) ] -> rms_norm -> head

One forward function serves every way of running the model: with no cache it recomputes the
whole sequence (the slow path of experiment 1); with a cache it appends the new tokens' keys and
values and attends over everything held (prefill is a call with the whole prompt, decode a call
with one token per sequence). The cache says where the new tokens go, makes the mask and
attends over what it holds, its own way (kvcache.py). A pass first prepares what all its layers
share (``prepare``), then runs them one after the other (``block``; experiment 18 calls them
itself). Each layer makes two big multiplies instead of five (fused.py).

Shape alphabet: B batch, T new tokens, S cached + new positions, D hidden, H query heads,
Hkv key/value heads, G = H / Hkv queries per kv head, d head dim, F MLP width, V vocab.

The families differ in four places only: Qwen2 adds a bias to q/k/v (fused.py stacks it),
Qwen3 RMS-normalizes each head's query and key before RoPE (attention_block), Llama 3.x
stretches the slow RoPE frequencies for long contexts (rope_frequencies), and a sliding-window
layer (Mistral, some Qwen2) sees only the last W positions (its mask: Batch.windowed).

All math is float32. Follows Hugging Face's Qwen2/Llama/Qwen3/Mistral modelling (half-split
RoPE, repeat_kv head order); leaves out training and dropout.
"""
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np  # host-side bookkeeping only (positions); the math goes through xp

from minitransformer.backend import Array, to_device, xp
from minitransformer.config import ModelConfig
from minitransformer.kernels.attention import on_threads
from minitransformer.kernels.fused import Fused, fuse
from minitransformer.kernels.threads import on_one_blas_thread
from minitransformer.linear import linear
from minitransformer.tokenizer import Tokenizer


@dataclass(frozen=True)
class Model:
    config: ModelConfig
    weights: dict            # HF tensor name -> float32 array (or a quantized weight)
    tokenizer: Tokenizer | None = None
    eos_token_ids: tuple = ()
    sampling_defaults: dict = field(default_factory=dict)  # generation_config.json's (loader)
    path: str = ""
    fused: Fused = field(  # type: ignore[assignment]  # None only until made here (fused.py)
        default=None, repr=False, compare=False)

    def __post_init__(self):
        # once per weights dict: every Model (loaded, quantized, replaced) multiplies what its
        # dict holds, and the dict's q/k/v and gate/up become views into the fused matrices
        if self.fused is None or self.fused.weights is not self.weights:
            object.__setattr__(self, "fused", fuse(self.config, self.weights))
            object.__setattr__(self, "weights", self.fused.weights)

    @property
    def layers(self) -> tuple:
        """Layer per layer: the weights as the forward pass multiplies them (fused.py); a draft
        of the first layers has as many as its config says."""
        return self.fused.layers[:self.config.num_hidden_layers]


def rms_norm(x, weight, eps):
    """(..., D) -> (..., D): scale each vector to unit root-mean-square, then by a learned gain."""
    variance = (x * x).sum(axis=-1, keepdims=True) / x.shape[-1]  # (..., 1), the mean square
    return weight * (x / xp.sqrt(variance + eps))


def rope_frequencies(c: ModelConfig):
    """-> (d/2,): pair i of a head turns by position * theta^(-2i/d) radians.

    A long-context checkpoint stretches them (config.RopeScaling): linear slows every pair by
    the factor; Llama 3's slows only the pairs whose wavelength outgrows the trained context
    (they never saw a full turn in training), keeps the fast ones, and blends those between.
    """
    d = c.head_dim
    freq = 1.0 / (c.rope_theta ** (xp.arange(0, d, 2, dtype=xp.float32) / d))  # (d/2,)
    s = c.rope_scaling
    if s is None or s.rope_type == "dynamic":   # dynamic: plain within the trained context
        return freq
    if s.rope_type == "linear":
        return freq / s.factor
    if s.divisors:                           # llama3 as a GGUF file stores it, worked out
        return freq / xp.asarray(s.divisors, dtype=xp.float32)
    context = s.original_max_position_embeddings                 # llama3
    wavelength = 2 * math.pi / freq                              # positions per full turn
    blend = (context / wavelength - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    between = (1 - blend) * freq / s.factor + blend * freq       # 0: slowed .. 1: kept
    slow = wavelength > context / s.low_freq_factor
    fast = wavelength < context / s.high_freq_factor
    return xp.where(slow, freq / s.factor, xp.where(fast, freq, between))


def rope_angles(positions, freq):
    """Positions (B, T) on the device, frequencies (d/2,) -> cos, sin (B, T, 1, d) of RoPE's
    rotation angles, the first half of sin negated (see rope). The angles depend on the
    positions only, so every layer's q and k reuse them."""
    angles = positions[..., None].astype(xp.float32) * freq                   # (B, T, d/2)
    angles = xp.concatenate([angles, angles], axis=-1)[:, :, None, :]          # (B, T, 1, d)
    sin = xp.sin(angles)
    sin[..., : len(freq)] *= -1
    return xp.cos(angles), sin


def rope(x, cos, sin):
    """Rotary position embedding, Hugging Face's half-split convention.

    x (B, T, h, d), cos/sin (B, T, 1, d) from rope_angles -> (B, T, h, d). Pair i of each head
    is (x1, x2) = (x[i], x[i + d/2]), turned by its angle a: (x1 cos a - x2 sin a,
    x2 cos a + x1 sin a). HF writes it x * cos + rotate_half(x) * sin, rotate_half(x) =
    (-x2, x1); with the minus sign moved into sin (rope_angles), rotate_half is the halves
    swapped, which is a view: no copy, no negation, the same bits. (llama2.c rotates adjacent
    pairs (2i, 2i+1) instead; HF checkpoints permute q/k rows so that this split is right.)
    """
    *lead, d = x.shape
    swapped = x.reshape(*lead, 2, d // 2)[..., ::-1, :]                    # (x2, x1), a view
    turned = swapped * sin.reshape(*sin.shape[:-1], 2, d // 2)              # (..., 2, d/2)
    return x * cos + turned.reshape(*lead, d)


def softmax(x):
    """Along the last axis; subtracting the max keeps exp from overflowing."""
    e = xp.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def causal_mask(positions, S: int):
    """Positions (B, T) of the queries -> visible (B, T, S): the query at position p sees
    slots 0..p. Slots past a row's length (other rows of a batch, rolled-back drafts) are
    hidden by the same rule.
    >>> from minitransformer.backend import to_numpy
    >>> to_numpy(causal_mask(xp.asarray([[1, 2]]), 3)).astype(int).tolist()
    [[[1, 1, 0], [1, 1, 1]]]
    """
    return xp.arange(S)[None, None, :] <= positions[:, :, None]


def plain_attention(q, k, v, visible=None):
    """Grouped-query attention; visible (B, T, S) from causal_mask, or None: all slots seen.

    q (B, T, H, d); k, v (B, Hkv, S, d) where slot j holds position j. -> (B, T, H*d).
    Query head h reads kv head h // G: the queries are grouped, the keys are never repeated,
    so the cache holds Hkv heads and no more.

    The group reshape, on H = 4 query heads over Hkv = 2 kv heads (G = 2), one token: kv head
    0 serves query heads 0 and 1, kv head 1 serves 2 and 3, as HF's repeat_kv does.
    >>> heads = xp.arange(4).reshape(1, 1, 4, 1)        # (B, T, H, d): query head h holds h
    >>> from minitransformer.backend import to_numpy
    >>> to_numpy(heads.reshape(1, 1, 2, 2, 1).transpose(0, 2, 3, 1, 4)[0, :, :, 0, 0]).tolist()
    [[0, 1], [2, 3]]
    """
    B, T, H, d = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    G = H // Hkv
    q = q.reshape(B, T, Hkv, G, d).transpose(0, 2, 3, 1, 4).reshape(B, Hkv, G * T, d)
    scores = (q @ k.transpose(0, 1, 3, 2)) * (1.0 / d ** 0.5)       # (B, Hkv, G*T, S)
    if visible is not None:                                           # hide the future
        scores = xp.where(visible[:, None, None], scores.reshape(B, Hkv, G, T, S), -xp.inf)
    weights = softmax(scores).reshape(B, Hkv, G * T, S)
    out = weights @ v                                                # (B, Hkv, G*T, d)
    return out.reshape(B, Hkv, G, T, d).transpose(0, 3, 1, 2, 4).reshape(B, T, H * d)


@dataclass(frozen=True)
class Attention:
    """A way to attend: the function, and the mask it reads, made once per forward pass."""
    attend: Callable[..., Array]  # (q, k, v, visible) -> (B, T, H*d), as plain_attention
    mask: Callable[..., Array]    # (positions (B, T), S) -> visible, as causal_mask, or a stand-in


# on_threads: whole, or in parts across the threads, the same bits (kernels/attention.py)
PLAIN = Attention(on_threads(plain_attention), causal_mask)  # the other way: tiled.TILED


@dataclass(frozen=True)
class Batch:
    """What one forward pass works out once, before its first layer, for all of them."""
    positions: Array        # (B, T) on the device: each token's position
    cos: Array              # (B, T, 1, d) RoPE, see rope_angles
    sin: Array
    visible: Array          # the mask attend reads; None: every query sees every slot
    windowed: Array         # the sliding-window layers' mask (None: no layer slides, or all seen)
    slots: Array            # the cache's own write indices (None without a cache)
    attend: Callable[..., Array]  # (q, k, v, visible) -> (B, T, H*d): the cache's, or the way's


def prepare(model: Model, ids, cache=None, way: Attention | None = None) -> Batch:
    """Check ids (B, T), find their positions, and prepare what every layer will need: the
    RoPE angles, and the mask, the slots and the attention of the cache (kvcache.py), or
    without one the causal mask of ``way`` (PLAIN unless told)."""
    c = model.config
    ids = np.asarray(ids)  # host token ids, checked here: on CuPy a bad id would wrap around
    if ids.ndim != 2 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"ids must be a non-empty integer array (B, T), got shape {ids.shape} "
                         f"of {ids.dtype}")
    B, T = ids.shape
    if ids.min() < 0 or ids.max() >= c.vocab_size:
        raise ValueError(f"token ids must be in [0, {c.vocab_size}), got {ids.min()}..{ids.max()}")
    if way is not None and (cache is not None or not isinstance(way, Attention)):
        raise ValueError(f"way={way!r}: a pass without a cache takes a model.Attention (PLAIN, "
                         "tiled.TILED); a cache attends its own way, chosen at allocation")
    positions = np.broadcast_to(np.arange(T), (B, T)) if cache is None else cache.positions(T)
    if positions.max() >= c.max_position_embeddings:
        raise ValueError(f"position {positions.max()} is beyond the model's "
                         f"{c.max_position_embeddings} positions")
    on_device = to_device(positions)                                 # (B, T)
    cos, sin = rope_angles(on_device, rope_frequencies(c))
    window = c.sliding_window                                        # W, or None
    if cache is None:  # the T tokens are the whole sequence; alone, a token sees all (itself)
        way = PLAIN if way is None else way
        if window is not None and way.mask is not causal_mask:   # its mask is an array
            raise ValueError("a sliding-window model attends with a plain causal mask "
                             "(attention='plain')")
        visible = windowed = None if T == 1 else way.mask(on_device, T)
        if window is not None and T > window:       # what lies W or more back is hidden too
            windowed = visible & (xp.arange(T)[None, None] > on_device[:, :, None] - window)
        return Batch(on_device, cos, sin, visible, windowed, None, way.attend)
    return Batch(on_device, cos, sin, cache.mask(positions),
                 None if window is None else cache.mask(positions, window),
                 cache.slots(positions), cache.attend)


def attention_block(model, i, x, batch: Batch, cache):
    """Layer i's self-attention on normed input x (B, T, D) -> (B, T, D)."""
    c, layer = model.config, model.layers[i]
    B, T, _ = x.shape
    H, Hkv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    qkv = linear(x, layer.qkv, layer.qkv_bias)                      # (B, T, (H + 2Hkv) * d)
    qkv = qkv.reshape(B, T, H + 2 * Hkv, d)                          # q heads, k heads, v heads
    qk = qkv[:, :, :H + Hkv]                                         # (B, T, H + Hkv, d)
    if layer.qk_norm is not None:                                    # Qwen3: each head normed
        qk = rms_norm(qk, layer.qk_norm, c.rms_norm_eps)            # gains (H + Hkv, d)
    qk = rope(qk, batch.cos, batch.sin)                              # q and k turn alike
    q, k, v = qk[:, :, :H], qk[:, :, H:], qkv[:, :, H + Hkv:]       # (B, T, H|Hkv|Hkv, d)
    if cache is None:  # recompute: this call's tokens are the whole sequence
        k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)     # (B, Hkv, T, d)
    else:              # store the new keys/values, attend over everything held
        k, v = cache.update(i, k, v, batch.slots)                    # (B, Hkv, S, d), as held
    visible = batch.visible if c.window(i) is None else batch.windowed  # (B, T, S) or None
    out = batch.attend(q, k, v, visible)                             # (B, T, H*d)
    return linear(out, layer.o, layer.o_bias)                        # (B, T, D)


def silu(x):
    """x * sigmoid(x), with sigmoid(x) = (1 + tanh(x / 2)) / 2: no exp, so nothing overflows.

    The textbook 1 / (1 + exp(-x)) overflows exp for x < -88 in float32 (a warning, and inf
    on the way to the right 0); tanh saturates quietly at -1.
    >>> from minitransformer.backend import to_numpy
    >>> [round(float(y), 4) for y in to_numpy(silu(xp.array([-100.0, 0.0, 1.0], xp.float32)))]
    [-0.0, 0.0, 0.7311]
    """
    return x * (0.5 * (1.0 + xp.tanh(0.5 * x)))


def mlp(model, i, x):
    """SwiGLU: down(silu(gate(x)) * up(x)), (B, T, D) -> (B, T, D)."""
    layer, F = model.layers[i], model.config.intermediate_size
    gate_up = linear(x, layer.gate_up)                               # (B, T, 2F)
    gate, up = gate_up[..., :F], gate_up[..., F:]                    # (B, T, F) each
    return linear(silu(gate) * up, layer.down)                       # (B, T, D)


def block(model: Model, i: int, h, batch: Batch, cache=None):
    """Decoder layer i: the residual stream h (B, T, D) -> h (B, T, D) after the layer."""
    eps, layer = model.config.rms_norm_eps, model.layers[i]
    h = h + attention_block(model, i, rms_norm(h, layer.input_norm, eps), batch, cache)
    return h + mlp(model, i, rms_norm(h, layer.post_norm, eps))


def embed(model: Model, ids):
    """Token ids (B, T), checked by prepare -> the residual stream's start h (B, T, D)."""
    return model.weights["model.embed_tokens.weight"][to_device(np.asarray(ids))]


@on_one_blas_thread   # BLAS's own threads held at one for the pass (kernels/threads.py)
def forward(model: Model, ids, cache=None, way: Attention | None = None):
    """Token ids (B, T) -> final hidden states (B, T, D), after the last RMSNorm.

    Without a cache the T tokens are the whole sequence (positions 0..T-1), attended over by
    ``way`` (PLAIN, or tiled.TILED: the same numbers, the scores a tile at a time). With
    one they are appended to what it holds: positions continue from each row's length, and it
    has grown by T when this returns. A row's last bits depend on its batch (BLAS picks its
    kernel by the number of rows): alone, it makes the very call a batch of one makes.
    """
    batch = prepare(model, ids, cache, way)
    h = embed(model, ids)                                            # (B, T, D)
    for i in range(model.config.num_hidden_layers):
        h = block(model, i, h, batch, cache)
    if cache is not None:
        cache.advance(batch.positions.shape[1])
    return rms_norm(h, model.weights["model.norm.weight"], model.config.rms_norm_eps)


def head(model: Model, hidden):
    """Hidden states (B, T, D) -> logits (B, T, V). A tied model reuses the embedding matrix."""
    tied = model.config.tie_word_embeddings
    return linear(hidden, model.weights["model.embed_tokens.weight" if tied else "lm_head.weight"])
