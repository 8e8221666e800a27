"""Choosing the next token from the logits: greedy, or sampling with the usual knobs.

Hugging Face semantics and order: the repetition penalty first (a logit of a token already in
the sequence is divided by the penalty when positive, multiplied when negative), then for
sampling the temperature, top-k (keep the k largest), top-p (keep the smallest set of most
likely tokens whose probability reaches p), and a draw. ``do_sample=False`` is greedy (argmax)
whatever the temperature; with sampling, temperature 0 also means greedy.

This runs on the host in float32, on one vector of V logits per step. Each request owns its
seeded ``numpy.random.Generator``, so a request samples the same tokens alone or in a batch.
"""
import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SamplingSettings:
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0                 # 0: off
    top_p: float = 1.0             # 1.0: off
    repetition_penalty: float = 1.0  # 1.0: off

    def __post_init__(self):
        if not isinstance(self.temperature, (int, float)) or not 0 <= self.temperature < math.inf:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, (int, np.integer)) \
                or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 turns it off), got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.repetition_penalty, (int, float)) \
                or not 0 < self.repetition_penalty < math.inf:
            raise ValueError(f"repetition_penalty must be a finite number > 0, "
                             f"got {self.repetition_penalty!r}")

    @property
    def greedy(self) -> bool:
        return not self.do_sample or self.temperature == 0


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
    """
    logits = np.asarray(logits, dtype=np.float32) / np.float32(settings.temperature or 1.0)
    if 0 < settings.top_k < logits.size:
        kth = np.partition(logits, -settings.top_k)[-settings.top_k]
        logits = np.where(logits >= kth, logits, -np.inf)  # ties with the k-th are kept, as in HF
    p = np.exp(logits - logits.max())
    p /= p.sum()
    if settings.top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        cumulative = np.cumsum(p[order])
        # keep tokens while the mass *before* them is below top_p: the first always stays
        keep = order[(cumulative - p[order]) < settings.top_p]
        mask = np.zeros(p.size, dtype=bool)
        mask[keep] = True
        p = np.where(mask, p, np.float32(0))
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
    if settings.greedy:
        return int(np.argmax(logits))
    return draw(probabilities(logits, settings), rng)
