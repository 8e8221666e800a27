"""What quantization costs the model: perplexity, a question battery, agreement, memory.

Serves experiment 21 (and the agreement feeds experiment 22's acceptance rates).

    perplexity  exp(mean negative log-likelihood) of each next token of a fixed text,
                scored in windows of `window` tokens (each window starts cold)
    battery     16 short factual prompts with known answers, greedy decoding; an answer
                counts when one of its accepted words appears in the continuation
    agreement   run the full-precision model greedily for n tokens; then ask the quantized
                model, at each position, what it would pick given the same prefix (one
                teacher-forced forward pass): the count of positions where the two agree

Perplexity is only comparable between models that share a tokenizer (the chapter's warning).
A battery score comes with its 95% Wilson interval: with 16 questions, 12 right is anything
from about half to nine in ten, so one question more or less says nothing (the chapter's point).
An instruct model can be asked through its chat template (``chat=True``).
Leaves out: sampling-based evaluation, benchmark suites.
"""
import math
import re
from dataclasses import dataclass

import numpy as np

from minitransformer.backend import to_numpy
from minitransformer.generate import generate
from minitransformer.kvcache import KVCache
from minitransformer.logprobs import log_softmax
from minitransformer.model import forward, head
from minitransformer.sampling import SamplingSettings
from minitransformer.serve.config import EngineConfig
from minitransformer.serve.engine import Engine
from minitransformer.serve.paged import pool_for
from minitransformer.serve.records import Request
from minitransformer.tokenizer import encode_prompt

# Written for this project: completion-style prompts (base models complete, they do not chat).
BATTERY = [
    ("The capital of France is", ["Paris"]),
    ("The capital of Japan is", ["Tokyo"]),
    ("The capital of Italy is", ["Rome"]),
    ("The largest planet in our solar system is", ["Jupiter"]),
    ("Water is made of hydrogen and", ["oxygen"]),
    ("The chemical symbol for gold is", ["Au"]),
    ("Romeo and Juliet was written by William", ["Shakespeare"]),
    ("The first president of the United States was George", ["Washington"]),
    ("The opposite of hot is", ["cold"]),
    ("Two plus two equals", ["four", "4"]),
    ("On a clear day the colour of the sky is", ["blue"]),
    ("The planet we live on is called", ["Earth"]),
    ("The longest river in Africa is the", ["Nile"]),
    ("The official language of Brazil is", ["Portuguese"]),
    ("There are seven days in a", ["week"]),
    ("Ice is water in its solid form, and steam is water as a", ["gas", "vapour", "vapor"]),
]


def tokens_of(model, text: str, n: int) -> np.ndarray:
    """The first n token ids of a text, or a ValueError saying how many it has."""
    ids = np.asarray(encode_prompt(model, text, "a text"), dtype=np.int64)
    if len(ids) < n:
        raise ValueError(f"the text gives {len(ids)} tokens; {n} are needed")
    return ids[:n]


@dataclass(frozen=True)
class Perplexity:
    value: float      # exp(nll / tokens)
    nll: float        # summed negative log-likelihood, nats
    tokens: int       # tokens scored
    per_token: np.ndarray  # (tokens,) each one's negative log-likelihood, nats (float64)


def token_nll(logits, targets) -> np.ndarray:
    """Logits (n, V) and the tokens that came (n,) -> each one's negative log-likelihood (n,),
    in float64: minus the log-softmax (logprobs.py) at each target.

    >>> token_nll(np.zeros((1, 4)), [2]).round(4).tolist()      # uniform over 4: log 4
    [1.3863]
    """
    logp = log_softmax(logits)                                               # (n, V)
    return -logp[np.arange(len(logp)), targets]


def perplexity(model, ids, window: int, progress=None, chunk: int = 256) -> Perplexity:
    """Score ids[1:] given what precedes each, in windows of `window` inputs (T = len(ids)).

    The head is applied `chunk` positions at a time, so a 150k-token vocabulary does not
    need a (window, V) float array all at once. progress(i, n) after window i of n is scored.
    """
    ids = np.asarray(ids, dtype=np.int64)
    if len(ids) < 2:
        raise ValueError(f"perplexity needs at least 2 tokens (one to predict), got {len(ids)}")
    if window < 1 or chunk < 1:
        raise ValueError(f"window and chunk must be at least 1, got {window} and {chunk}")
    window = min(window, model.config.max_position_embeddings)
    starts = range(0, len(ids) - 1, window)
    nll, count, each = 0.0, 0, []
    for i, start in enumerate(starts, 1):
        inputs = ids[start:start + window]
        targets = ids[start + 1:start + window + 1]
        hidden = forward(model, inputs[None])                              # (1, T, D)
        for a in range(0, len(targets), chunk):
            logits = to_numpy(head(model, hidden[:, a:a + chunk]))[0]     # (chunk, V)
            each.append(token_nll(logits[: len(targets) - a], targets[a:a + chunk]))
            nll += float(each[-1].sum())
        count += len(targets)
        if progress is not None:
            progress(i, len(starts))
    return Perplexity(float(np.exp(nll / count)), nll, count, np.concatenate(each))


def paired_ratio(nll, base, z: float = 1.96) -> tuple[float, float, float]:
    """Perplexity ratio exp(mean(nll - base)) of two models (or caches) scored on the same
    tokens, and its 95% (z = 1.96) interval: the per-token differences are paired, so the
    interval is mean +- z standard errors of their mean, exponentiated. A small change to a
    model is told apart on far fewer tokens this way than by two perplexities' own intervals.

    >>> [round(x, 4) for x in paired_ratio([1.0, 1.2, 1.1, 1.3], [1.0, 1.0, 1.0, 1.0])]
    [1.1618, 1.0238, 1.3185]
    """
    diff = np.asarray(nll, dtype=np.float64) - np.asarray(base, dtype=np.float64)
    if diff.size < 2:
        raise ValueError(f"a paired interval needs at least 2 tokens, got {diff.size}")
    mean, half = diff.mean(), z * diff.std(ddof=1) / math.sqrt(diff.size)
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


def next_token_scores(model, ids, kv_dtype: str = "f32", chunk: int = 256):
    """One prefill of ids[:-1] through a KV cache of format kv_dtype (so that attention reads
    keys and values as that cache holds them) -> (nll (n,), picks (n,)), n = len(ids) - 1:
    each next token's negative log-likelihood (nats, float64) and the model's argmax there."""
    ids = np.asarray(ids, dtype=np.int64)
    if len(ids) < 2:
        raise ValueError(f"scoring needs at least 2 tokens (one to predict), got {len(ids)}")
    inputs, targets = ids[:-1], ids[1:]
    cache = KVCache.allocate(model.config, 1, len(inputs), kv_dtype)
    hidden = forward(model, inputs[None], cache)                           # (1, n, D)
    nll, picks = [], []
    for a in range(0, len(targets), chunk):
        logits = to_numpy(head(model, hidden[:, a:a + chunk]))[0]               # (chunk, V)
        nll.append(token_nll(logits, targets[a:a + chunk]))
        picks.append(logits.argmax(axis=1))
    return np.concatenate(nll), np.concatenate(picks)


def default_repetition_penalty(model, fallback: float = 1.1) -> float:
    """The checkpoint's own repetition penalty (its generation_config.json, as the loader read
    it onto the model), else `fallback`.

    The battery's "penalty on" setting: a chat model ships the penalty it was tuned with.
    """
    return float(model.sampling_defaults.get("repetition_penalty", fallback))


@dataclass(frozen=True)
class Battery:
    correct: int
    outputs: list     # (prompt, continuation, right?) per question


def wilson_interval(correct: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% (z = 1.96) Wilson score interval for a proportion correct / n.

    Unlike p +- z sqrt(p(1-p)/n) it stays inside [0, 1] and is not zero-width at 0/n or n/n.

    >>> [round(x, 3) for x in wilson_interval(12, 16)]
    [0.505, 0.898]
    """
    if n < 1 or not 0 <= correct <= n:
        raise ValueError(f"need 0 <= correct <= n and n >= 1, got {correct} of {n}")
    p = correct / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return float(max(0.0, centre - half)), float(min(1.0, centre + half))


# How a completion prompt is put to an instruct model through its chat template.
CHAT_INSTRUCTION = "Complete the sentence: {prompt}"


def answered(continuation: str, answers) -> bool:
    """An accepted answer appears as a whole word (case-insensitive)."""
    return any(re.search(rf"\b{re.escape(a)}\b", continuation, re.IGNORECASE) for a in answers)


def battery(model, repetition_penalty: float, max_new_tokens: int = 8,
            questions=BATTERY, chat: bool = False, progress=None,
            batch_invariant: bool = False) -> Battery:
    """Greedy answers to the questions (repetition_penalty 1.0 turns the penalty off).

    The questions are decoded together, as a serving engine would: one slot each, one batched
    decode step for all of them (minitransformer/serve/engine.py), instead of one generation after
    another. A batch multiplies its rows as one matrix, so an answer can differ from the one
    ``generate`` gives the question alone only at a step whose top two logits are a near tie
    (the engine's stated exactness); the score is a measurement, not an identity.
    batch_invariant=True gives every answer exactly the tokens it gets alone (slower).
    chat: ask through the tokenizer's chat template (an instruct model's own format).
    progress(i, n) as answer i of n is completed."""
    if not questions:
        raise ValueError("no questions to ask: 0 correct of 0 would say nothing")
    sampling = SamplingSettings(repetition_penalty=repetition_penalty)
    requests = [Request(tuple((model.tokenizer.chat_prompt(
        [{"role": "user", "content": CHAT_INSTRUCTION.format(prompt=prompt)}])
        if chat else encode_prompt(model, prompt))), max_new_tokens, sampling=sampling)
        for prompt, _ in questions]
    slots, block_size = len(requests), 16
    engine = Engine(model, EngineConfig(
        max_num_seqs=slots, block_size=block_size, batch_invariant=batch_invariant,
        num_gpu_blocks_override=pool_for(requests, slots, block_size)))
    reported = 0

    def answered_so_far(engine):
        nonlocal reported
        while progress is not None and reported < sum(r.status == "finished"
                                                      for r in engine.results.values()):
            reported += 1
            progress(reported, len(requests))
    run = engine.run(requests, on_step=answered_so_far)
    outputs = []
    for (prompt, answers), result in zip(questions, run.results, strict=True):
        text = model.tokenizer.decode(result.tokens)
        outputs.append((prompt, text, answered(text, answers)))
    return Battery(sum(ok for *_, ok in outputs), outputs)


def reference_tokens(model, prefix, n: int) -> list[int]:
    """The model's plain greedy continuation of prefix, exactly n tokens (eos does not stop)."""
    return generate(model, list(prefix), n, eos_token_id=[])


def agreement(model, prefix, reference) -> int:
    """Positions where the model's argmax, given prefix + reference[:i], is reference[i]."""
    if len(prefix) == 0:
        raise ValueError("agreement needs a non-empty prefix: the first pick is made after it")
    if len(reference) == 0:
        raise ValueError("agreement needs a non-empty reference: no positions to compare")
    ids = np.asarray(list(prefix) + list(reference[:-1]), dtype=np.int64)
    hidden = forward(model, ids[None])[:, len(prefix) - 1:]                # (1, n, D)
    picks = to_numpy(head(model, hidden)).argmax(axis=-1)[0]               # (n,)
    return int((picks == np.asarray(reference)).sum())
