"""minitransformer: the companion code of "Making inference cheap: KV cache, batching and
quantization". A decoder-only transformer (Qwen2, Llama) in plain arrays, and the machinery a
serving engine uses to make it cheap.

The stable public API:
    load(path)                         -> Model (config, weights, tokenizer)
    logits(model, ids)                 -> float32 (len(ids), vocab), one full forward pass
    generate(model, ids, max_new_tokens, cache=True, do_sample=False, temperature=1.0,
             top_k=0, top_p=1.0, repetition_penalty=1.0, seed=None, eos_token_id=None)
                                       -> list of new token ids
    stream(...)                        -> the same tokens, yielded as they are made
"""
from minitransformer.errors import CheckpointError
from minitransformer.generate import generate, logits, stream
from minitransformer.loader import load

__all__ = ["load", "logits", "generate", "stream", "CheckpointError"]
