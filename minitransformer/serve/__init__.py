"""Serving: the machinery between a model and many users, read after the core.

    config       EngineConfig: the engine's knobs in one frozen dataclass, vLLM's names
    records      Request, Result, Run and their metrics: the vocabulary of a serving run
    paged        the paged KV cache: blocks, block tables, slots, the prefix cache
    engine       continuous (and static) batching over the paged cache, step by step
    online       the engine on its own thread, fed by a queue: requests arrive while it runs
    detokenize   tokens -> text as they stream, spaces and multi-byte characters whole
    openai_api   OpenAI's request and response bodies, checked field by field
    prometheus   /metrics under vLLM's names
    http         the OpenAI-compatible HTTP server (FastAPI + uvicorn)

Import each module by its own path; this package re-exports nothing.
"""
