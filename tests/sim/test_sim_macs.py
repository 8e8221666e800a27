"""Experiment 3: MAC counts checked against a brute-force count over real matmuls."""
import numpy as np
import pytest

from minitransformer.checkpoints.synth import qwen25_05b_config
from sim.macs import compare, generation_macs, step_macs

QWEN25_05B = qwen25_05b_config()  # the chapter's model: 24 layers, 14 q heads, 2 kv heads

TINY_GQA = {"hidden_size": 12, "intermediate_size": 20, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 6,
            "vocab_size": 17}
TINY_MHA = dict(TINY_GQA, num_key_value_heads=4, head_dim=4)  # H*d != D on purpose
# (head dims even: a ModelConfig refuses an odd one, which RoPE cannot turn in pairs)


class Counter:
    """Runs real matmuls on zero arrays and adds up m*k*n of each, from the arrays' shapes."""
    def __init__(self):
        self.macs = 0

    def mm(self, a, b):
        (m, k), (k2, n) = a.shape, b.shape
        assert k == k2
        self.macs += m * k * n
        return a @ b


def brute_force(cfg, tokens, prompt_len, cache):
    """Generate `tokens` tokens the plain way, one head at a time, counting every matmul."""
    D, F, H, Hkv, d, L, V = (cfg[k] for k in (
        "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
        "head_dim", "num_hidden_layers", "vocab_size"))
    z = np.zeros
    per_step, c = [], Counter()
    keys = [z((Hkv, 0, d)) for _ in range(L)]  # per layer (Hkv, S, d)
    values = [z((Hkv, 0, d)) for _ in range(L)]
    for i in range(tokens):
        before = c.macs
        context = prompt_len + i
        new = (prompt_len if i == 0 else 1) if cache else context
        if not cache:
            keys = [z((Hkv, 0, d)) for _ in range(L)]
            values = [z((Hkv, 0, d)) for _ in range(L)]
        x = z((new, D))
        for layer in range(L):
            q = c.mm(x, z((D, H * d)))
            k = c.mm(x, z((D, Hkv * d))).reshape(new, Hkv, d).transpose(1, 0, 2)
            v = c.mm(x, z((D, Hkv * d))).reshape(new, Hkv, d).transpose(1, 0, 2)
            keys[layer] = np.concatenate([keys[layer], k], axis=1)
            values[layer] = np.concatenate([values[layer], v], axis=1)
            heads = []
            for h in range(H):
                g = h // (H // Hkv)  # the kv head this query head reads
                scores = c.mm(q[:, h * d:(h + 1) * d], keys[layer][g].T)  # (T, S)
                heads.append(c.mm(scores, values[layer][g]))             # (T, d)
            x = c.mm(np.concatenate(heads, axis=1), z((H * d, D)))
            hidden = c.mm(x, z((D, F))) * c.mm(x, z((D, F)))  # gate, up
            x = c.mm(hidden, z((F, D)))                       # down
        c.mm(x[-1:], z((D, V)))  # logits of the last position only
        per_step.append(c.macs - before)
    return per_step


@pytest.mark.parametrize("cfg", [TINY_GQA, TINY_MHA])
@pytest.mark.parametrize("prompt_len", [1, 3])
@pytest.mark.parametrize("cache", [True, False])
def test_matches_brute_force(cfg, prompt_len, cache):
    steps = generation_macs(cfg, 6, prompt_len, cache)
    assert [s.total for s in steps] == brute_force(cfg, 6, prompt_len, cache)


def test_growth_orders():
    T = 12
    cached = np.array([s.total for s in generation_macs(QWEN25_05B, T)], dtype=object)
    uncached = np.array([s.total for s in generation_macs(QWEN25_05B, T, cache=False)],
                        dtype=object)
    # per step: cached is linear in the context (second differences vanish after prefill),
    # uncached quadratic (third differences vanish, second ones do not)
    assert set(np.diff(cached[1:], 2)) == {0}
    assert set(np.diff(uncached, 3)) == {0} and 0 not in set(np.diff(uncached, 2))
    # summed: O(T^2) vs O(T^3)
    assert set(np.diff(np.cumsum(cached[1:]), 3)) == {0}
    assert set(np.diff(np.cumsum(uncached), 4)) == {0}
    assert 0 not in set(np.diff(np.cumsum(uncached), 3))
    ratios = [compare(QWEN25_05B, t).ratio for t in (8, 16, 32, 64)]
    assert ratios == sorted(ratios) and ratios[-1] > 2 * ratios[0]


def test_parts_and_options():
    s = step_macs(TINY_GQA, 3, 5)
    assert s.attention == 2 * 2 * 4 * 3 * 5 * 6  # L * 2 * H * T * S * d
    assert s.lm_head == 12 * 17
    assert step_macs(TINY_GQA, 3, 5, logits_for_all=True).lm_head == 3 * 12 * 17
    c = compare(TINY_GQA, 1)
    assert c.uncached == c.cached  # one step from a one-token prompt: nothing to reuse


@pytest.mark.parametrize("args", [(0, 1), (3, 2)])
def test_bad_step(args):
    with pytest.raises(ValueError, match="new_tokens"):
        step_macs(TINY_GQA, *args)


def test_bad_generation():
    with pytest.raises(ValueError, match="tokens"):
        generation_macs(TINY_GQA, 0)
    with pytest.raises(ValueError, match="num_attention_heads"):
        generation_macs({"num_hidden_layers": 2, "num_key_value_heads": 1, "head_dim": 4}, 3)
