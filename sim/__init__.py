"""Cost models of the chapter that need no weights: numbers from shapes and formulas.

One module per question the chapter asks with arithmetic rather than a stopwatch:

    arch           the few config fields the cost models read (any config object, dict or path)
    kv_memory      KV-cache bytes per token, per user x tokens, MHA/GQA/MQA   (experiments 8-11)
    memory_budget  weights + cache + reserve on 8/16/24 GB cards               (experiment 24)
    macs           multiply-accumulates to generate T tokens, cache or not     (experiment 3)
    speculative    expected tokens per verification pass and net speedup      (experiment 22)
    workload       the 64 skewed requests of experiment 13 and their arrivals
    batching       static vs continuous batching, simulated step by step     (experiment 13)

Everything here is plain Python (numpy at most) and returns numbers or small dataclasses;
only the scripts print. Nothing here loads weights; the batching simulation shares the
engine's serving records (minitransformer/serve/records.py), so the two are measured alike.
"""
