"""Generation: the slow way (recompute everything each step) and the fast way (KV cache).

    slow:   for each new token, forward(whole sequence so far), read the last position
    fast:   prefill = forward(prompt) once into the cache; then decode = forward(one token)
            per step, attending over the cache

Both feed the same logits to the same sampling rule, so greedy decoding gives the same tokens
either way: that is experiment 1, and the tests check it token for token.
"""
import numpy as np

from minitransformer.backend import to_numpy
from minitransformer.checks import is_integer
from minitransformer.kvcache import KVCache
from minitransformer.kvquant import check_kv_dtype
from minitransformer.logprobs import check_top, token_logprob
from minitransformer.model import forward, head
from minitransformer.sampling import GREEDY, SamplingSettings, check_sampling, next_token
from minitransformer.tiled import attention_named


def check_prompt(model, ids, max_new_tokens) -> np.ndarray:
    """Validate a prompt and a length against the model; -> ids as an int64 array (T,)."""
    c = model.config
    if not is_integer(max_new_tokens) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    ids = np.asarray(ids)
    if ids.ndim != 1 or ids.size == 0:
        raise ValueError(f"the prompt must be a non-empty 1-D list of token ids, "
                         f"got shape {ids.shape}")
    if not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"token ids must be integers, got dtype {ids.dtype}")
    if ids.min() < 0 or ids.max() >= c.vocab_size:
        raise ValueError(f"token ids must be in [0, {c.vocab_size}), got {ids.min()}..{ids.max()}")
    if ids.size + max_new_tokens > c.max_position_embeddings:
        raise ValueError(f"prompt of {ids.size} tokens + max_new_tokens={max_new_tokens} exceeds "
                         f"the model's {c.max_position_embeddings} positions")
    return ids.astype(np.int64)


def eos_ids(model, eos_token_id) -> set:
    """None -> the model's eos ids; an id or a list of ids -> that set ([] never stops)."""
    if eos_token_id is None:
        return set(model.eos_token_ids)
    ids = np.atleast_1d(np.asarray(eos_token_id))
    if ids.size and (ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer)):
        raise ValueError(f"eos_token_id must be an id or a list of ids, got {eos_token_id!r}")
    return set(ids.tolist())


def seeded_rng(seed) -> np.random.Generator:
    """A request's own random generator; seed None draws a fresh one from the OS."""
    if seed is not None and (not is_integer(seed) or seed < 0):
        raise ValueError(f"seed must be None or an integer >= 0, got {seed!r}")
    return np.random.default_rng(seed)


def last_logits(model, ids, cache=None, way=None) -> np.ndarray:
    """Token ids (B, T) -> host logits (B, V) of each row's last position: a forward pass
    (with the cache, if given; way as in model.forward), then the head on the last hidden
    state."""
    hidden = forward(model, ids, cache, way)                               # (B, T, D)
    return to_numpy(head(model, hidden[:, -1:]))[:, -1]


def last_logits_alone(model, ids, cache=None) -> np.ndarray:
    """last_logits of ids (B, T) row by row, row b on cache.row(b) -> (B, V): the very call a
    batch of one makes, so each row's logits are the very bits it gets alone (batch-invariant),
    at B reads of every weight. In a flat batch they are not: BLAS picks its kernel, and the
    order of its sums, by the number of rows, and softmax sums over the longest row's slots."""
    return np.concatenate([last_logits(model, ids[b:b + 1], None if cache is None else
                                       cache.row(b)) for b in range(len(ids))])


def stream(model, ids, max_new_tokens: int, cache: bool = True,
           sampling: SamplingSettings = GREEDY, seed=None, eos_token_id=None, logprobs=None,
           kv_dtype: str = "f32", attention: str = "plain"):
    """Yield new token ids one at a time. Stops at an eos id or after max_new_tokens.

    sampling: how each token is chosen (sampling.py), greedy unless told otherwise;
    seed: of this call's own random generator (None: a fresh one from the OS);
    eos_token_id: an id or list of ids; None uses the model's (generation_config.json), and
    an empty list never stops early. logprobs: None yields token ids; an integer k in
    [0, MAX_LOGPROBS] yields a ``TokenLogprob`` per token instead (its id, its log-probability
    under the model before any sampling setting, and the k most likely tokens there), taken
    from the logits that chose it. kv_dtype: the cache's format, f32, f16, q8_0 or q4_0
    (kvquant.py). attention: "plain" or "tiled" (tiled.ATTENTIONS).
    """
    settings = check_sampling(sampling)
    ids = check_prompt(model, ids, max_new_tokens)
    eos = eos_ids(model, eos_token_id)
    rng = seeded_rng(seed)
    if logprobs is not None:
        check_top(logprobs)
    check_kv_dtype(kv_dtype)
    if not cache and kv_dtype != "f32":
        raise ValueError(f"kv_dtype={kv_dtype!r} needs the cache (cache=True)")
    if max_new_tokens == 0:
        return
    tokens = ids.tolist()
    kv = KVCache.allocate(model.config, 1, len(tokens) + max_new_tokens, kv_dtype, attention) \
        if cache else None
    recompute = None if cache else attention_named(attention)  # a cache attends its own way
    logits = last_logits(model, ids[None], kv, recompute)[0]            # prefill: (V,)
    for step in range(max_new_tokens):
        token = next_token(logits, tokens, settings, rng)
        yield token if logprobs is None else token_logprob(logits, token, logprobs)
        tokens.append(token)
        if token in eos or step == max_new_tokens - 1:
            return
        if cache:
            logits = last_logits(model, np.array([[token]]), kv)[0]
        else:                                                         # recompute everything
            logits = last_logits(model, np.array([tokens]), way=recompute)[0]


def generate(model, ids, max_new_tokens: int, cache: bool = True,
             sampling: SamplingSettings = GREEDY, seed=None, eos_token_id=None,
             logprobs=None, kv_dtype: str = "f32", attention: str = "plain") -> list:
    """The new token ids (the prompt not included), or with ``logprobs=k`` a TokenLogprob per
    new token. Keyword arguments as in ``stream``."""
    return list(stream(model, ids, max_new_tokens, cache, sampling, seed, eos_token_id,
                       logprobs, kv_dtype, attention))


def logits(model, ids) -> np.ndarray:
    """Float32 logits (T, V) for one sequence of token ids, by one full forward pass."""
    ids = check_prompt(model, ids, 0)
    return to_numpy(head(model, forward(model, ids[None])))[0]

