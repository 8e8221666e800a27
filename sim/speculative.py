"""Experiment 22, the formula half: what speculative decoding is worth for a given alpha.

A draft model proposes gamma tokens; the target verifies them in one forward pass and keeps
the longest accepted prefix plus one token of its own. If each draft token is accepted with
probability alpha, independently (Leviathan et al., 2023, the i.i.d. assumption), the number
of tokens one verification pass yields is 1 + alpha + ... + alpha^gamma:

    E[tokens / pass] = (1 - alpha^(gamma+1)) / (1 - alpha)      (gamma + 1 when alpha = 1)

Drafting costs gamma draft passes of c target passes each, plus the verification pass (whose
gamma positions cost about one decode step: decode is weight-bound), so

    speedup = E[tokens / pass] / (gamma * c + 1)

It can be below 1: speculation can make generation slower. The measured half (alpha of each
quantized model as a draft for the full-precision target) lives in its own script.
Leaves out: acceptance that varies along the draft, and any cost of verifying more positions.
"""
from dataclasses import dataclass


def _check(alpha, gamma, c=0.0):
    if isinstance(alpha, bool) or not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha={alpha!r}: an acceptance rate is a probability in [0, 1]")
    if isinstance(gamma, bool) or not isinstance(gamma, int) or gamma < 1:
        raise ValueError(f"gamma={gamma!r}: the draft length is an integer >= 1")
    if isinstance(c, bool) or not c >= 0.0:  # `not >=` also rejects NaN
        raise ValueError(f"c={c!r}: the draft's cost relative to the target must be >= 0")


def expected_tokens(alpha, gamma):
    """Expected tokens produced per verification pass: sum of alpha^k for k = 0..gamma."""
    _check(alpha, gamma)
    if alpha == 1.0:
        return float(gamma + 1)  # every draft token accepted, plus the target's own
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def speedup(alpha, gamma, c):
    """Tokens per unit of target time, relative to plain decoding (one token per pass)."""
    _check(alpha, gamma, c)
    return expected_tokens(alpha, gamma) / (gamma * c + 1.0)


@dataclass(frozen=True)
class Cell:
    alpha: float
    gamma: int
    c: float
    tokens_per_pass: float
    passes: float  # cost of one round in target-pass units: gamma * c + 1
    speedup: float


def table(alphas, gammas, cs):
    """Every (c, alpha, gamma) combination, in that nesting order."""
    return [Cell(a, g, c, expected_tokens(a, g), g * c + 1.0, speedup(a, g, c))
            for c in cs for a in alphas for g in gammas]
