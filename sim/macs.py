"""Experiment 3: multiply-accumulates to generate T tokens from a cold start, cache or not.

Counting MACs instead of milliseconds takes the machine out of the argument. One forward
pass over T new tokens that attend to S positions (S = cached + new) costs, per layer,

    projections  T * (D*H*d + 2*D*Hkv*d + H*d*D)    q, k, v (GQA: Hkv heads), o
    MLP          T * 3*D*F                          gate, up, down
    attention    2 * H * T*S*d                      scores Q K^T and the weighted sum P V

plus the LM head, D*V per position whose logits are computed. Generating T tokens:

    with the cache     prefill over the P prompt tokens, then T-1 steps of one token against
                       S = P+1, ..., P+T-1 positions: a step is linear in the context;
    without the cache  step i recomputes all P+i positions: a step is quadratic in the
                       context (attention is (P+i)^2), and the sum over a generation is
                       O(T^3) against O(T^2), so the ratio grows without bound.

What is counted: every matmul, as a dense one computes it. In particular the masked upper
triangle of the causal score matrix is counted, because a dense (T, S) score matmul computes
it and then throws it away (experiment 2 measures that matrix). GQA does not shrink the
attention MACs: each of the H query heads still takes its own dot products.
What is not counted (not multiply-accumulates, and O(S) or O(D) per token): RMSNorm, RoPE,
softmax, SiLU and the gating product, residual adds, biases, the embedding lookup, sampling.
"""
from dataclasses import dataclass

from sim.arch import arch


@dataclass(frozen=True)
class StepMacs:
    """MACs of one forward pass, by part."""
    projections: int
    mlp: int
    attention: int
    lm_head: int

    @property
    def total(self):
        return self.projections + self.mlp + self.attention + self.lm_head


def step_macs(config, new_tokens, positions, logits_for_all=False):
    """One forward pass: T=new_tokens queries against S=positions keys (S >= T).

    The LM head runs on the last position only (the one generation samples from) unless
    `logits_for_all`, which is what a forward that returns (T, V) logits pays.
    """
    if new_tokens < 1 or positions < new_tokens:
        raise ValueError(f"new_tokens={new_tokens}, positions={positions}: need "
                         "1 <= new_tokens <= positions")
    a = arch(config)
    D, F, H, Hkv, d, L, V = (a.hidden_size, a.intermediate_size, a.num_attention_heads,
                             a.num_key_value_heads, a.head_dim, a.num_hidden_layers,
                             a.vocab_size)
    T, S = new_tokens, positions
    return StepMacs(
        projections=L * T * (D * H * d + 2 * D * Hkv * d + H * d * D),
        mlp=L * T * 3 * D * F,
        attention=L * 2 * H * T * S * d,
        lm_head=(T if logits_for_all else 1) * D * V,
    )


def generation_macs(config, tokens, prompt_len=1, cache=True, logits_for_all=False):
    """MACs of each of the `tokens` steps that generate `tokens` tokens after a prompt.

    Cold start: nothing is cached before the first step. Step i produces token i; the last
    token produced is never fed back, so there are exactly `tokens` forward passes.
    """
    if tokens < 1 or prompt_len < 1:
        raise ValueError(f"tokens={tokens}, prompt_len={prompt_len}: both must be >= 1")
    config = arch(config)  # validate (and read a path) once, not once per step
    steps = []
    for i in range(tokens):
        context = prompt_len + i  # positions the step's forward pass sees
        new = (prompt_len if i == 0 else 1) if cache else context
        steps.append(step_macs(config, new, context, logits_for_all))
    return steps


@dataclass(frozen=True)
class Comparison:
    """One row of experiment 3."""
    tokens: int
    uncached: int            # summed over the generation
    cached: int
    last_step_uncached: int  # the final step alone: quadratic vs linear in the context
    last_step_cached: int

    @property
    def ratio(self):
        return self.uncached / self.cached


def compare(config, tokens, prompt_len=1, logits_for_all=False):
    """Both ways of generating `tokens` tokens, summed and at the last step."""
    config = arch(config)
    slow = generation_macs(config, tokens, prompt_len, False, logits_for_all)
    fast = generation_macs(config, tokens, prompt_len, True, logits_for_all)
    return Comparison(tokens, sum(s.total for s in slow), sum(s.total for s in fast),
                      slow[-1].total, fast[-1].total)
