"""minitransformer: the companion code of "Making inference cheap: KV cache, batching and
quantization". A decoder-only transformer (Qwen2, Llama) in plain arrays, and the machinery a
serving engine uses to make it cheap.

Reading order, in the chapter's order (the experiment each part serves in brackets):

    config.py, shape.py  the model's shape: config.json, and every size derived from it once
    model.py             the forward pass, prefill and decode alike, top to bottom       [2]
    kvcache.py           the KV cache: append, attend over, trim                      [1-8]
    kvquant.py           the cache's formats: f32, f16, q8_0 / q4_0 codes and scales [8, 10]
    tiled.py             the same attention, its scores one tile at a time             [2, 4]
    sampling.py          the next token: greedy, or temperature, top-k, top-p, penalty
    generate.py          generation without and with the cache                    [1, 4-7]
    serve/               batching: records, paged cache, engine; then the server    [12-14]
    ../quant/            weight quantization: schemes, quantizers, QWeight          [15-21]
    speculative.py       a draft guesses, the target checks (lookup.py: a free draft)  [22]
    drafts/distill.py    soft labels and the distillation loss                         [23]
    drafts/training.py   a draft trained on them: forward beside backward, Adam    [22, 23]
    ../sim/              cost models, numbers from shapes and formulas [3, 9-11, 13, 22, 24]

A first pass may skip: loader.py, tokenizer.py, chat.py and formats/ (where the bytes come
from), linear.py, backend.py and kernels/ (how the products run fast, or on a GPU), checks.py
and errors.py (refusing bad input), checkpoints/ (the models the experiments run on),
logprobs.py (what the model thought of each token, for the API), measure/ (timing and scoring
for the experiments), __main__.py (the command line).

The stable public API:
    load(path)                         -> Model (config, weights, tokenizer)
    logits(model, ids)                 -> float32 (len(ids), vocab), one full forward pass
    generate(model, ids, max_new_tokens, cache=True, sampling=GREEDY, seed=None,
             eos_token_id=None, logprobs=None, kv_dtype="f32", attention="plain")
                                       -> list of new token ids (logprobs=k: of TokenLogprob)
    stream(...)                        -> the same tokens, yielded as they are made
where sampling is a ``minitransformer.sampling.SamplingSettings``.
"""
from minitransformer.errors import CheckpointError
from minitransformer.generate import generate, logits, stream
from minitransformer.loader import load

__all__ = ["load", "logits", "generate", "stream", "CheckpointError"]
