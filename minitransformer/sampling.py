"""Choosing the next token from the logits: greedy, or sampling with the usual knobs.

Hugging Face semantics and order: the repetition penalty first (a logit of a token already in
the sequence is divided by the penalty when positive, multiplied when negative), then for
sampling the temperature, top-k (keep the k largest), top-p (keep the smallest set of most
likely tokens whose probability reaches p), and a draw. ``do_sample=False`` is greedy (argmax)
whatever the temperature; with sampling, temperature 0 also means greedy.

The settings travel as one frozen ``SamplingSettings``, the same for ``generate``, ``stream``,
``speculative_generate``, a serving ``Request``, the server and the command line:

    generate(model, ids, 20, sampling=SamplingSettings(do_sample=True, temperature=0.7), seed=0)

This runs on the host, on one vector of V logits per step (the distribution in float64). Each
request owns its seeded ``numpy.random.Generator``, so a request samples the same tokens alone
or in a batch.
"""
import math
from dataclasses import dataclass

import numpy as np

from minitransformer.checks import is_integer, is_real


@dataclass(frozen=True)
class SamplingSettings:
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0                 # 0: off
    top_p: float = 1.0             # 1.0: off
    repetition_penalty: float = 1.0  # 1.0: off

    def __post_init__(self):
        if not isinstance(self.do_sample, (bool, np.bool_)):
            raise ValueError(f"do_sample must be True or False, got {self.do_sample!r}")
        if not is_real(self.temperature) or not 0 <= self.temperature < math.inf:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not is_integer(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 turns it off), got {self.top_k!r}")
        if not is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not is_real(self.repetition_penalty) or not 0 < self.repetition_penalty < math.inf:
            raise ValueError(f"repetition_penalty must be a finite number > 0, "
                             f"got {self.repetition_penalty!r}")

    @property
    def greedy(self) -> bool:
        return not self.do_sample or self.temperature == 0


GREEDY = SamplingSettings()     # argmax at every step: the default everywhere


def check_sampling(settings) -> SamplingSettings:
    """The one form sampling is given in, everywhere (generate, stream, speculative_generate,
    a serving Request): a SamplingSettings, whose fields were checked when it was made."""
    if not isinstance(settings, SamplingSettings):
        raise ValueError(f"sampling must be a SamplingSettings, got {settings!r}")
    return settings


def apply_repetition_penalty(logits, previous_ids, penalty: float):
    """(V,) -> (V,): push down every token already in the sequence (CTRL / HF rule)."""
    if penalty == 1.0 or len(previous_ids) == 0:
        return logits
    logits = logits.copy()
    seen = np.unique(np.asarray(previous_ids))
    chosen = logits[seen]
    logits[seen] = np.where(chosen > 0, chosen / penalty, chosen * penalty)
    return logits


def probabilities(logits, settings: SamplingSettings):
    """Logits (V,) after any penalty -> the sampling distribution (V,) float32, sums to 1.

    Temperature scales, top-k and top-p cut (cut tokens get probability exactly 0).
    Computed in float64, and in an order that stays finite for every legal setting: the max is
    subtracted *before* dividing by the temperature (logits / 1e-39 overflows float32 to inf,
    and inf - inf is NaN; (z - max) / T only goes to -inf, whose exp is 0), and the most likely
    token always survives top-p (the mass before it is exactly 0, and top_p > 0, however
    small). Tiny settings thus degrade to greedy, as they should.

    Top-p 0.75 over 0.5, 0.3, 0.15, 0.05: tokens are kept while the mass before them is below
    0.75 (0 before the first, 0.5 before the second, 0.8 before the third), then renormalised.
    >>> top_p = SamplingSettings(do_sample=True, top_p=0.75)
    >>> probabilities(np.log([0.5, 0.3, 0.15, 0.05]), top_p).round(3).tolist()
    [0.625, 0.375, 0.0, 0.0]
    """
    z = np.asarray(logits, dtype=np.float64)
    if 0 < settings.top_k < z.size:
        kth = np.partition(z, -settings.top_k)[-settings.top_k]
        z = np.where(z >= kth, z, -np.inf)  # ties with the k-th are kept, as in HF
    with np.errstate(over="ignore"):  # overflow here goes to -inf, exp(-inf) = 0: intended
        z = (z - z.max()) / float(settings.temperature or 1.0)  # <= 0; the max is exactly 0
    p = np.exp(z)
    p /= p.sum()  # >= 1: exp(0) of the max is in it
    if settings.top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        before = np.cumsum(p[order]) - p[order]  # mass of the tokens more likely than each
        # keep tokens while the mass *before* them is below top_p: the first always stays
        # (nothing is before it: 0 < top_p)
        keep = order[before < settings.top_p]
        mask = np.zeros(p.size, dtype=bool)
        mask[keep] = True
        p = np.where(mask, p, 0.0)
        p /= p.sum()
    return p.astype(np.float32)


def draw(p, rng: np.random.Generator) -> int:
    """One token from distribution p (V,) by inverting its cumulative sum."""
    cumulative = np.cumsum(p)
    return int(min(np.searchsorted(cumulative, rng.random() * cumulative[-1], side="right"),
                   p.size - 1))


def next_token(logits, previous_ids, settings: SamplingSettings, rng) -> int:
    """The full rule for one step: penalty, then argmax or a draw."""
    logits = apply_repetition_penalty(np.asarray(logits, dtype=np.float32), previous_ids,
                                      settings.repetition_penalty)
    if not np.isfinite(logits.max()):  # argmax of NaNs is silently token 0: say so instead
        raise ValueError(f"the logits hold NaN or +inf (max {logits.max()}): the model's "
                         "numbers overflowed or its weights are broken")
    if settings.greedy:
        return int(np.argmax(logits))
    return draw(probabilities(logits, settings), rng)
