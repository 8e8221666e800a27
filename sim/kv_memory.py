"""How many bytes the KV cache holds: per token, per users x tokens, per attention variant.

For every token in the context, every layer keeps one key vector and one value vector per
key-value head:

    bytes/token = 2 (key and value) * layers * kv_heads * head_dim * bytes_per_element

(the formula is ``kvquant.cache_bytes_per_token``, the cache's own; here it is priced for any
config and any whole number of bytes per element).
Serves experiments 8 (the formula, checked against real cache tensors elsewhere), 9 (users x
tokens: only the total resident tokens matter), 10 (MHA vs GQA vs MQA: the formula divided by
an integer) and 11 (a 7B-class cache against context length, and where it outgrows the
weights). Unit convention: the chapter's KB / MB / GB are binary (2^10, 2^20, 2^30 bytes:
12,288 B x 65,536 tokens = "768 MB"), and so are the constants below.

Leaves out: allocator rounding and the preallocation slack of a real cache (experiment 8
measures those), and paging (experiment 14).
"""
from dataclasses import dataclass

from minitransformer.kvquant import cache_bytes_per_token
from sim.arch import kv_dims, query_heads

KB, MB, GB = 2**10, 2**20, 2**30  # binary, as in the chapter's tables


def kv_bytes_per_token(config, bytes_per_elem=2):
    """config (object, dict or config.json path) -> bytes of K and V cached per token."""
    return cache_bytes_per_token(kv_dims(config), bytes_per_elem)


def cache_bytes(config, users, tokens, bytes_per_elem=2):
    """Bytes of the cache for `users` sequences of `tokens` tokens each."""
    for name, value in (("users", users), ("tokens", tokens)):
        if int(value) != value or value < 0:
            raise ValueError(f"{name}={value!r}: expected a non-negative integer")
    return users * tokens * kv_bytes_per_token(config, bytes_per_elem)


@dataclass(frozen=True)
class UsersTokens:
    """One row of experiment 9."""
    users: int
    tokens_each: int
    total_tokens: int
    nbytes: int


def users_tokens_table(config, shapes, bytes_per_elem=2):
    """[(users, tokens each), ...] -> one UsersTokens row per shape."""
    return [UsersTokens(u, t, u * t, cache_bytes(config, u, t, bytes_per_elem))
            for u, t in shapes]


@dataclass(frozen=True)
class Variant:
    """One row of experiment 10: the same model with a different number of kv heads."""
    name: str
    kv_heads: int
    bytes_per_token: int
    vs_configured: float  # bytes/token relative to the model as configured


def attention_variants(config, bytes_per_elem=2):
    """config -> [MHA, the model as configured, MQA]: kv heads = H, Hkv, 1.

    Every query head keeps its own kv head (MHA), a group of query heads shares one (GQA), or
    all share a single one (MQA). Nothing else in the formula changes, so the ratios are the
    ratios of kv heads: none of the variants buys arithmetic, they divide the cache.
    """
    layers, kv_heads, head_dim = kv_dims(config)
    names = {query_heads(config): "MHA", 1: "MQA"}
    names[kv_heads] = names.get(kv_heads, "GQA") + " (configured)"
    base = kv_bytes_per_token(config, bytes_per_elem)
    rows = []
    for n in sorted(names, reverse=True):
        shape = {"num_hidden_layers": layers, "num_key_value_heads": n, "head_dim": head_dim}
        per_token = kv_bytes_per_token(shape, bytes_per_elem)
        rows.append(Variant(names[n], n, per_token, per_token / base))
    return rows


@dataclass(frozen=True)
class ContextRow:
    """One row of experiment 11: one user's cache at a given context length."""
    tokens: int
    nbytes: int
    vs_weights: float  # cache bytes / weight bytes


def context_table(config, contexts, weight_bytes, bytes_per_elem=2):
    """One user's cache for each context length, against the model's weight bytes."""
    if weight_bytes <= 0:
        raise ValueError(f"weight_bytes={weight_bytes!r}: expected a positive size")
    rows = []
    for n in contexts:
        nbytes = cache_bytes(config, 1, n, bytes_per_elem)
        rows.append(ContextRow(n, nbytes, nbytes / weight_bytes))
    return rows


def crossing_tokens(config, weight_bytes, bytes_per_elem=2):
    """Smallest context (tokens) at which one user's cache holds more bytes than the weights."""
    if weight_bytes <= 0:
        raise ValueError(f"weight_bytes={weight_bytes!r}: expected a positive size")
    per_token = kv_bytes_per_token(config, bytes_per_elem)
    return int(weight_bytes // per_token) + 1


def format_bytes(n):
    """Bytes in the chapter's style: '12 KB', '768 MB', '3.5 MB', '13.0 GB' (binary units).

    GB keep one decimal, as the chapter's budget tables do; KB and MB drop a trailing '.0'.
    """
    sign, n = ("-" if n < 0 else ""), abs(n)
    if n >= GB:
        return f"{sign}{n / GB:,.1f} GB"
    for unit, name in ((MB, "MB"), (KB, "KB")):
        if n >= unit:
            text = f"{n / unit:,.1f}"
            return f"{sign}{text[:-2] if text.endswith('.0') else text} {name}"
    return f"{sign}{n:,} B"
