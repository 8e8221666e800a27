"""Serving: the machinery between a model and many users, read after the core.

    config       EngineConfig, SpeculativeConfig: the engine's knobs, frozen, vLLM's names
    records      Request, Result, Run and their metrics: the vocabulary of a serving run
    intake       a request's fields checked against the model before the engine takes it
    blocks       the block manager's books, host integers: block tables, refcounts, the
                 prefix cache (decide nothing, compute nothing: account)
    scheduler    each step's plan on the books alone: admit, preempt, decode, prefill chunks
    paged        the paged KV cache's arrays, the moves the books decide, the forward's view
    engine       a step = plan -> run (forward passes, sampling) -> commit; n-sample fan-out
    drafting     where a step's drafts come from (a prompt lookup, a batched draft model)
                 and how long they are
    speculate    speculative decoding: the drafts wanted, verified in the step's one pass
    online       the engine on its own thread, fed by a queue: requests arrive while it runs
    detokenize   tokens -> text as they stream, spaces and multi-byte characters whole
    openai_api   OpenAI's request and response bodies, checked field by field
    prometheus   /metrics under vLLM's names
    http         the OpenAI-compatible HTTP server (FastAPI + uvicorn)

Import each module by its own path; this package re-exports nothing.
"""
