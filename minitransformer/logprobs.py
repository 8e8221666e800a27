"""Log-probabilities: what the model thought of each token it made or read.

The model's log-probability of a token is the log-softmax of its logits at the position that
predicts it, taken *before* any sampling setting (repetition penalty, temperature, top-k,
top-p): what the model itself says, the same whatever the request sampled with. This is what
vLLM returns by default and what an evaluation harness needs (the log-likelihood of a
continuation given a context is the sum of its tokens' log-probabilities). They come from the
logits that chose each token, the ones decoding computed anyway: no second forward pass.

    log p(token) = z[token] - max(z) - log(sum(exp(z - max(z))))      (float64)

Beside the token's own, a caller may ask for the k most likely tokens at that position (the
"top logprobs"), most likely first; k is at most ``MAX_LOGPROBS``.

>>> z = np.log([0.5, 0.25, 0.125, 0.125])     # logits whose softmax we know
>>> t = token_logprob(z, token=2, k=2)
>>> t.token, round(t.logprob, 4), [(i, round(p, 4)) for i, p in t.top]
(2, -2.0794, [(0, -0.6931), (1, -1.3863)])

A prompt read in one forward pass gives every prompt token's log-probability but the first
(nothing predicts it): position t's logits score token t + 1.

>>> [None if p is None else round(p.logprob, 4) for p in prompt_logprobs(np.stack([z, z]),
...                                                                        [0, 1], k=0)]
[None, -1.3863]
"""
from dataclasses import dataclass

import numpy as np

from minitransformer.checks import is_integer

MAX_LOGPROBS = 20   # top alternatives per token at most (vLLM's default bound)


@dataclass(frozen=True)
class TokenLogprob:
    token: int          # the token id
    logprob: float | None  # its log-probability under the model (natural log; None: unscored)
    top: tuple | None = ()  # ((token id, logprob), ...): the k most likely, most likely first


def check_top(k, name: str = "logprobs") -> int:
    """How many top alternatives were asked for: an integer in [0, MAX_LOGPROBS]."""
    if not is_integer(k) or not 0 <= k <= MAX_LOGPROBS:
        raise ValueError(f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {k!r}")
    return int(k)


def log_softmax(logits) -> np.ndarray:
    """Logits (..., V) -> log-probabilities (..., V), float64, each row's exp sums to 1."""
    z = np.asarray(logits, dtype=np.float64)
    z = z - z.max(axis=-1, keepdims=True)                    # the max becomes exactly 0
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def token_logprob(logits, token: int, k: int = 0) -> TokenLogprob:
    """One position's logits (V,) -> the log-probability of ``token`` and the top k."""
    logp = log_softmax(logits)                                               # (V,)
    top = np.argpartition(-logp, k - 1)[:k] if 0 < k < logp.size else np.arange(logp.size)[:k]
    top = top[np.lexsort((top, -logp[top]))]                 # most likely first; ties: lower id
    return TokenLogprob(int(token), float(logp[token]),
                        tuple((int(i), float(logp[i])) for i in top))


def prompt_logprobs(logits, ids, k: int = 0) -> list:
    """Logits (T, V) of a prompt's positions, its ids (T,) -> [None, TokenLogprob x T-1]."""
    return [None] + [token_logprob(z, token, k)
                     for z, token in zip(logits[:-1], ids[1:], strict=True)]
