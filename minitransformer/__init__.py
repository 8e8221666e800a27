"""minitransformer: the companion code of "Making inference cheap: KV cache, batching and
quantization". A decoder-only transformer (Qwen2, Llama) in plain arrays, and the machinery a
serving engine uses to make it cheap.

Reading order, in the chapter's order and the import order (README.md, with the experiment
each part serves; ../quant/ and ../sim/ sit beside this package):

    config.py, shape.py           the model's shape: config.json, every size derived from it
    model.py                      the forward pass, prefill and decode alike, top to bottom
    kvquant.py, tiled.py,         the KV cache: its formats (f32, f16, q8_0 / q4_0 codes and
      kvcache.py                  scales), attention over it a tile at a time, the cache
    sampling.py, generate.py      the next token; generation without and with the cache
    ../sim/kv_memory.py, macs.py  what the cache costs and saves, from shapes and formulas
    serve/records.py, intake.py,  batching: records, a request checked, the block manager's
      blocks.py, config.py,       books, the engine's knobs, the plan of a step, the pool and
      scheduler.py, paged.py,     the forward pass's view of it, a pass over the pool, the
      runner.py, engine.py,       engine (then the server); experiment 13's simulation:
      ../sim/workload.py,         skewed requests, and the two policies a step at a time
      batching.py
    ../quant/int8.py, qweight.py, scales.py, absmax.py, nf4.py, ggml_blocks.py, kquants.py,
      gguf_weight.py, schemes.py, qmodel.py
                                  weight quantization: the quantizers (llama.cpp's blocks and
                                  k-quants among them), QWeight, the schemes
    ../quant/analysis.py, activations.py, techniques.py
                                  outliers in weights and activations, and what handles them
    measure/text.py, quality.py   the text measured on; what quantization costs in quality
    lookup.py, speculative.py,    a draft guesses, the target checks (lookup.py: a free
      ../sim/speculative.py       draft), and the speedup's formula
    drafts/distill.py,            soft labels and the distillation loss; a draft trained on
      drafts/training.py,         them: forward beside backward, Adam; three drafts trained
      drafts/students.py          side by side from one start, on soft labels and on hard
    ../sim/memory_budget.py       the memory budget of a card

A first pass may skip: loader.py, tokenizer.py, chat.py and formats/ (where the bytes come
from), linear.py, backend.py, kernels/, ../quant/matmul.py and ../quant/packing.py (how the
products run fast, or on a GPU), checks.py and errors.py (refusing bad input), progress.py (a
line on stderr while it loads or measures), checkpoints/ (the
models the experiments run on), ../sim/arch.py (any config read as the cost models want it),
serve/online.py, openai_api.py, detokenize.py, prometheus.py, http.py, drafting.py, speculate.py
and logprobs.py (the server; drafting.py and speculate.py are step 10 in the engine), measure/timing.py and sanity.py (the measuring kit), __main__.py (the command line).

The stable public API:
    load(path)                         -> Model (config, weights, tokenizer)
    logits(model, ids)                 -> float32 (len(ids), vocab), one full forward pass
    generate(model, ids, max_new_tokens, cache=True, sampling=GREEDY, seed=None,
             eos_token_id=None, logprobs=None, kv_dtype="f32", attention="plain")
                                       -> list of new token ids (logprobs=k: of TokenLogprob)
    stream(...)                        -> the same tokens, yielded as they are made
where sampling is a ``minitransformer.sampling.SamplingSettings``.
"""
import sys

from minitransformer.errors import CheckpointError, SettingError

try:
    from minitransformer.generate import generate, logits, stream
    from minitransformer.loader import load
except SettingError as e:       # an MT_* environment value this library does not know
    if sys.argv[:1] != ["-m"]:  # imported by a program: its own to catch (scripts/_common.py)
        raise
    # `python3 -m minitransformer` imports its package before its __main__ runs (sys.argv[0]
    # is "-m" until then), so only here can the command line say it as its one error line
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)

__all__ = ["load", "logits", "generate", "stream", "CheckpointError"]
