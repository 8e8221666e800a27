"""Experiment 22, the formula half: what speculative decoding is worth for a given alpha.

A draft model proposes gamma tokens; the target verifies them in one forward pass and keeps
the longest accepted prefix plus one token of its own. If each draft token is accepted with
probability alpha, independently (Leviathan et al., 2023, the i.i.d. assumption), the number
of tokens one verification pass yields is 1 + alpha + ... + alpha^gamma:

    E[tokens / pass] = (1 - alpha^(gamma+1)) / (1 - alpha)      (gamma + 1 when alpha = 1)

Drafting costs gamma draft passes of c target passes each, plus the verification pass (whose
gamma positions cost about one decode step: decode is weight-bound), so

    speedup = E[tokens / pass] / (gamma * c + 1)

It can be below 1: speculation can make generation slower. Where verifying is not free (a
CPU: a pass over gamma + 1 rows costs v(gamma) > 1 decode steps), the 1 becomes v, measured;
`best_gamma` picks the draft length from such costs, and `replayed_speedup` prices actual
rounds (a prompt-lookup draft's, which vary in length) at them. The measured half (alpha of
each draft for the full-precision target, the costs, real runs) lives in its own script.
Leaves out: acceptance that varies along the draft.
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


def speedup(alpha, gamma, c, v=1.0):
    """Tokens per unit of target time, relative to plain decoding (one token per pass).

    v: the verification pass's cost in decode steps (1 where decode is weight-bound)."""
    _check(alpha, gamma, c)
    if isinstance(v, bool) or not v > 0:
        raise ValueError(f"v={v!r}: a verification pass costs more than nothing")
    return expected_tokens(alpha, gamma) / (gamma * c + v)


def best_gamma(alpha, c, costs: dict) -> int:
    """The draft length with the best speedup, given costs {gamma: v(gamma)}.

    >>> best_gamma(0.8, 0.0, {1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0})    # free verification: longest
    8
    >>> best_gamma(0.8, 0.0, {1: 1.2, 2: 1.3, 4: 1.6, 8: 2.9})    # a CPU's: in between
    4
    """
    return max(costs, key=lambda g: speedup(alpha, g, c, costs[g]))


def replayed_speedup(rounds, costs: dict) -> float:
    """Rounds [(proposed, kept), ...] priced at costs {n: v(n)} -> speedup over plain decoding.

    A round yields kept + 1 tokens for one pass over proposed + 1 positions (a round that
    proposed nothing is a plain step, 1); plain decoding pays one step a token.
    >>> replayed_speedup([(4, 4), (4, 1), (0, 0)], {4: 2.0})    # 8 tokens for 5 steps
    1.6
    """
    tokens = sum(kept + 1 for _, kept in rounds)
    return tokens / sum(costs[n] if n else 1.0 for n, _ in rounds)


def best_lookup_gamma(tokens, prompt_len: int, costs: dict, draft) -> tuple:
    """Prompt lookup's gamma (1..largest) with the best replayed speedup at the costs
    {n: v(n)} of verifying n = 1..largest proposals -> (gamma, its rounds, its predicted
    speedup). tokens: the prompt, then greedy's tokens. No model is run.

    >>> from minitransformer.lookup import PromptLookup
    >>> g, rounds, speedup = best_lookup_gamma([1, 2, 3, 1, 2, 3, 1, 2, 9], 4, {1: 1.2, 2: 1.5},
    ...                                        PromptLookup())
    >>> g, rounds, round(speedup, 2)             # 5 tokens for 1.5 + 1.2 steps
    (2, [(2, 2), (1, 1)], 1.85)
    """
    from minitransformer.lookup import replay
    replays = {g: replay(tokens, prompt_len, g, draft) for g in range(1, max(costs) + 1)}
    predicted = {g: replayed_speedup(rounds, costs) for g, rounds in replays.items()}
    gamma = max(predicted, key=predicted.__getitem__)
    return gamma, replays[gamma], predicted[gamma]


def batch_verify_cost(n, batch: int, weight_rows: float) -> float:
    """A step that verifies n proposals for each of `batch` sequences, in plain decode steps
    of that batch, where a pass over R rows costs weight_rows + R: reading the weights once is
    worth weight_rows rows of arithmetic (a GPU: hundreds; NumPy on a CPU: a few). The pass
    over B (n + 1) rows against the plain step's B: (W + B (n + 1)) / (W + B). One sequence,
    n = 4, W = 15: 20 / 16; a batch of 16: 95 / 31, verifying stops being free.

    >>> batch_verify_cost(4, 1, 15), round(batch_verify_cost(4, 16, 15), 2)
    (1.25, 3.06)
    """
    return (weight_rows + batch * (n + 1)) / (weight_rows + batch)


def fit_weight_rows(v: dict) -> float:
    """W from one sequence's measured v(n) {n: cost of a pass over n + 1 positions in decode
    steps}: v(n) - 1 = n / (W + 1), the slope fitted by least squares through the origin.
    A v that does not grow with n (verifying for free) is W = inf.

    >>> fit_weight_rows({1: 1.25, 2: 1.5, 4: 2.0})      # v - 1 = n / 4
    3.0
    """
    slope = sum(n * (cost - 1) for n, cost in v.items()) / sum(n * n for n in v)
    return float("inf") if slope <= 0 else 1 / slope - 1


def batched_speedup(tokens_per_pass, proposed_per_pass, batch: int, weight_rows: float) -> float:
    """Speculation's speedup at a batch of `batch` sequences, each of whose verification
    passes yields tokens_per_pass tokens for proposed_per_pass proposals (a plain step: 1
    token a sequence): tokens_per_pass / batch_verify_cost. It falls with the batch.

    >>> [round(batched_speedup(3.0, 4.0, b, 15), 2) for b in (1, 4, 16)]
    [2.4, 1.63, 0.98]
    """
    return tokens_per_pass / batch_verify_cost(proposed_per_pass, batch, weight_rows)


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
