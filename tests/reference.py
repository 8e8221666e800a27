"""An independent, deliberately slow reference forward pass for the tests.

Written from the equations, not from minitransformer.model: float64, one position and one head
at a time, keys/values repeated per query head explicitly, RoPE by complex multiplication of
(x[i], x[i + d/2]) pairs, an explicit causal loop instead of a mask. If both implementations
agree, neither is likely to share a bug with the other.
"""
import numpy as np

from minitransformer.backend import to_numpy


def reference_logits(model, ids):
    c = model.config
    w = {k: to_numpy(v).astype(np.float64) for k, v in model.weights.items()}
    d, H, Hkv = c.head_dim, c.num_attention_heads, c.num_key_value_heads
    T = len(ids)

    def norm(x, g):
        return g * x / np.sqrt(np.mean(x ** 2) + c.rms_norm_eps)

    def rotate(x, pos):  # x (d,)
        i = np.arange(d // 2)
        z = (x[: d // 2] + 1j * x[d // 2:]) * np.exp(1j * pos * c.rope_theta ** (-2.0 * i / d))
        return np.concatenate([z.real, z.imag])

    def proj(name, x):
        y = w[name + ".weight"] @ x
        return y + w[name + ".bias"] if name + ".bias" in w else y

    h = [w["model.embed_tokens.weight"][t].copy() for t in ids]
    for layer in range(c.num_hidden_layers):
        p = f"model.layers.{layer}."
        xs = [norm(x, w[p + "input_layernorm.weight"]) for x in h]
        q = [proj(p + "self_attn.q_proj", x).reshape(H, d) for x in xs]
        k = [proj(p + "self_attn.k_proj", x).reshape(Hkv, d) for x in xs]
        v = [proj(p + "self_attn.v_proj", x).reshape(Hkv, d) for x in xs]
        for t in range(T):
            heads = []
            for head in range(H):
                kv = head // (H // Hkv)
                qt = rotate(q[t][head], t)
                scores = np.array([rotate(k[s][kv], s) @ qt for s in range(t + 1)]) / np.sqrt(d)
                a = np.exp(scores - scores.max())
                a /= a.sum()
                heads.append(sum(a[s] * v[s][kv] for s in range(t + 1)))
            h[t] = h[t] + proj(p + "self_attn.o_proj", np.concatenate(heads))
        for t in range(T):
            x = norm(h[t], w[p + "post_attention_layernorm.weight"])
            g, u = proj(p + "mlp.gate_proj", x), proj(p + "mlp.up_proj", x)
            h[t] = h[t] + proj(p + "mlp.down_proj", g / (1 + np.exp(-g)) * u)
    E = w["model.embed_tokens.weight" if c.tie_word_embeddings else "lm_head.weight"]
    return np.array([E @ norm(x, w["model.norm.weight"]) for x in h])
