"""The checkpoint's weights regrouped as the forward pass multiplies them: fused projections.

q, k and v all read the same normed input, and so do gate and up. Production engines (vLLM's
QKVParallelLinear and MergedColumnParallelLinear, llama.cpp's fused QKV) stack such matrices
into one, so a layer makes one multiply for q/k/v and one for gate/up: one pass over the input,
one BLAS call and one output buffer instead of three or two. This is the one place where the
checkpoint's names meet the fused ones:

    qkv      = [q_proj; k_proj; v_proj]    (H*d + 2*Hkv*d, D)   biases stacked the same way
    gate_up  = [gate_proj; up_proj]        (2F, D)

Stacking rows is exact: output row r of the stack is output row r of the part it came from.
The model's weights dict keeps every checkpoint name, as a view into the stacked matrix, so a
learner can still look up "model.layers.3.self_attn.k_proj.weight", and nothing is held twice.
Quantized weights (linear.is_quantized) cannot be stacked as arrays: a Stacked keeps
them apart and concatenates their outputs, which is the same function. The stacks are made once
per weights dict, where a Model is built (model.Model): a Model made from another with the same
dict (a draft of its first layers, a changed config) shares them. There too every matrix the
forward pass multiplies (the stacks, o, down and the head) is laid out in memory as its products
run fastest on the BLAS here (blas.arrange: row-major as in the checkpoint, or column-major;
the same values either way).
"""
from dataclasses import dataclass

import numpy as np

from minitransformer.backend import xp
from minitransformer.kernels.blas import arrange, release
from minitransformer.linear import is_quantized


@dataclass(frozen=True)
class Layer:
    """One decoder layer's weights as the forward pass uses them (shapes as in model.py)."""
    input_norm: object      # input_layernorm.weight (D,)
    qkv: object             # self_attn.{q,k,v}_proj.weight stacked (H*d + 2*Hkv*d, D)
    qkv_bias: object        # self_attn.{q,k,v}_proj.bias stacked (H*d + 2*Hkv*d,), or None
    qk_norm: object         # Qwen3: self_attn.q_norm.weight (d,) H times, k_norm's Hkv times:
                            # (H + Hkv, d), one gain per head of q and k; None elsewhere
    o: object               # self_attn.o_proj.weight (D, H*d)
    o_bias: object          # self_attn.o_proj.bias (D,), or None
    post_norm: object       # post_attention_layernorm.weight (D,)
    gate_up: object         # mlp.{gate,up}_proj.weight stacked (2F, D)
    down: object            # mlp.down_proj.weight (D, F)


@dataclass(frozen=True)
class Fused:
    """What fuse made from one weights dict: the dict (its q/k/v and gate/up now views into the
    stacks) and the layers. A Model keeps it while its weights are this very dict."""
    weights: dict
    layers: tuple           # Layer per layer


@dataclass(frozen=True)
class Stacked:
    """Matrices that multiply themselves (quantized), stacked along out: x (..., in) ->
    (..., sum of outs), each part's outputs side by side, as one stacked matrix would give."""
    parts: tuple

    def matmul(self, x):
        return xp.concatenate([w.matmul(x) for w in self.parts], axis=-1)


def stack(weights: dict, names: list):
    """Stack the named matrices (or vectors) along their first axis -> the stack (None if
    the first name is absent: a model without biases). Plain arrays are replaced in
    `weights` by views into the stack; anything else goes into a Stacked as it is."""
    if names[0] not in weights:
        return None
    parts = [weights[n] for n in names]
    if any(is_quantized(w) for w in parts):
        return Stacked(tuple(parts))
    whole = arrange(xp.concatenate(parts))                           # (sum of outs, ...)
    start = 0
    for name, part in zip(names, parts, strict=True):
        weights[name] = whole[start:start + len(part)]              # a view, same values
        start += len(part)
    return whole


def fuse(config, weights: dict) -> Fused:
    """-> a new weights dict whose q/k/v and gate/up are views into the stacks, and a Layer per
    layer. The caller's dict is left as it was."""
    weights, layers = dict(weights), []
    head = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
    arranged(weights, head)                        # laid out as its products run fastest here
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        attn = [f"{p}self_attn.{m}_proj" for m in "qkv"]
        layers.append(Layer(
            input_norm=weights[p + "input_layernorm.weight"],
            qkv=stack(weights, [n + ".weight" for n in attn]),
            qkv_bias=stack(weights, [n + ".bias" for n in attn]),
            qk_norm=head_gains(config, weights, p) if config.qk_norm else None,
            o=arranged(weights, p + "self_attn.o_proj.weight"),
            o_bias=weights.get(p + "self_attn.o_proj.bias"),
            **fuse_mlp(weights, i)))
    release()                                      # what measuring the layouts used
    return Fused({name: own(w) for name, w in weights.items()}, tuple(layers))


def head_gains(config, weights: dict, p: str):
    """Qwen3's query and key norm gains, one row per head of the qkv product's first H + Hkv
    heads, so that one rms_norm call norms every head with its own gain."""
    H, Hkv = config.num_attention_heads, config.num_key_value_heads
    q, k = weights[p + "self_attn.q_norm.weight"], weights[p + "self_attn.k_norm.weight"]
    return xp.concatenate([xp.broadcast_to(q, (H, len(q))), xp.broadcast_to(k, (Hkv, len(k)))])


def own(w):
    """w, copied where it is read-only: a view of the checkpoint's file that no product reads
    (an untied embedding: loader.py hands matrices over uncopied, the products' own copied as
    laid out), so that the model holds nothing of a file that may change under it."""
    return w.copy() if isinstance(w, np.ndarray) and not w.flags.writeable else w


def fuse_mlp(weights: dict, i: int) -> dict:
    """Layer i's MLP block as Layer's fields, gate/up stacked (the dict's two now views into
    the stack); also what a model with one MLP block swapped needs (drafts/training.py)."""
    p = f"model.layers.{i}."
    return dict(post_norm=weights[p + "post_attention_layernorm.weight"],
                gate_up=stack(weights, [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]),
                down=arranged(weights, p + "mlp.down_proj.weight"))


def arranged(weights: dict, name: str):
    """weights[name] laid out as its products run fastest here (blas.arrange), put back in
    the dict: the matrix multiplied and the one the name holds are the same array."""
    weights[name] = arrange(weights[name])
    return weights[name]
