"""The engine fuzzed: random workloads, and what must hold after every step and at the end.

Shared by tests/serve/test_engine_fuzz.py (a fixed seed, a few cases, in CI) and
scripts/dev/fuzz_engine.py (as many cases as asked). A case draws slots, a block size, a pool
from tight (waiting, preemption, eviction from the prefix cache) to roomy, requests with shared
prompt prefixes and repeated prompts, greedy or seeded sampling, eos on or off, zero-token and
too-long requests, requests for n parallel samples (sharing the prompt's blocks) and for
logprobs, cancels at random steps, prefix caching on or off and chunked prefill on (a small
token budget) or off, under either policy. The engine's clock is set to the step count before
each step (as an online loop may set it to wall time) and arrivals are whole steps: admission
then depends on whole seconds only, so a case runs the same schedule every time (while a step
takes < 1 s).

Invariants after every step: the paged cache's books (``PagedCache.check``: refcounts equal
the block tables holding each block, the free list and the prefix cache's kept blocks are
exactly the unheld ones, names consistent); a running or padding row holds its blocks, a
waiting request none; a sequence holds no block its tokens do not fill (its prompt's, during
a chunked prefill); with caching off, no block named. A request the policy calls exact
(batch-invariant mode, its prompt prefilled whole, nothing of it cached) has tokens so far
that are a prefix of what ``generate`` gives it alone (==), sample i of a request seeded
seed + i. At the end: every request over and returned, zero blocks held, each request's
tokens against its solo tokens by the exactness policy of tests/conftest.py (== where exact;
elsewhere a token may differ only where the solo run was at a near tie), and each logprob
within 1e-4 of generate's wherever the tokens so far agree.
"""
import math
from dataclasses import replace

import numpy as np

import minitransformer as mt
from conftest import assert_like_solo
from minitransformer.logprobs import log_softmax
from minitransformer.sampling import SamplingSettings
from minitransformer.serve.blocks import blocks_for
from minitransformer.serve.config import EngineConfig
from minitransformer.serve.engine import Engine
from minitransformer.serve.records import Request, metrics

STEP_SECONDS = 1.0          # the clock set before step i is i x this: a fixed schedule


def solo(model, request, choice=0, logprobs=None):
    """What minitransformer.generate gives the request (its sample ``choice``: seed + choice)
    alone, same settings: token ids, or with ``logprobs=k`` TokenLogprobs."""
    seed = request.seed if request.seed is None else request.seed + choice
    return mt.generate(model, list(request.prompt), request.max_new_tokens,
                       sampling=request.sampling, seed=seed,
                       eos_token_id=request.eos_token_id, logprobs=logprobs)


def solo_sample(model, request, choice) -> tuple:
    """-> (sample choice's solo tokens, their TokenLogprobs or None when not asked)."""
    made = solo(model, request, choice, request.logprobs or 0)
    return [t.token for t in made], made if request.logprobs is not None else None


def random_case(rng, vocab_size, max_positions):
    """-> (an EngineConfig, requests, {step: request index to cancel})."""
    bs = int(rng.choice([1, 2, 4, 8]))
    stem = rng.integers(0, vocab_size, 3 * bs + 1).tolist()  # a prefix worth sharing
    requests, longest = [], min(40, max_positions - 1)
    for _ in range(int(rng.integers(1, 12))):
        own = rng.integers(0, vocab_size, int(rng.integers(1, 12))).tolist()
        shared = len(stem) if rng.random() < 0.5 else int(rng.integers(0, len(stem) + 1))
        prompt = (stem[:shared] + own)[:longest]
        if requests and rng.random() < 0.2:     # an earlier prompt again: cached in full
            prompt = list(requests[int(rng.integers(len(requests)))].prompt)
        new = int(rng.integers(0, min(24, max_positions - len(prompt)) + 1))
        settings = SamplingSettings(
            do_sample=bool(rng.random() < 0.5), temperature=float(rng.choice([0.7, 1.0])),
            top_k=int(rng.choice([0, 5])), top_p=float(rng.choice([1.0, 0.9])),
            repetition_penalty=float(rng.choice([1.0, 1.3])))
        arrival = float(rng.integers(0, 20)) * STEP_SECONDS if rng.random() < 0.5 else 0.0
        requests.append(Request(tuple(prompt), new, arrival, settings,
                                seed=int(rng.integers(2**31)),
                                eos_token_id=None if rng.random() < 0.3 else [],
                                n=int(rng.choice([1, 1, 2, 3])),
                                logprobs=[None, 0, 3][int(rng.integers(3))],
                                prompt_logprobs=[None, None, 1][int(rng.integers(3))]))
    biggest = max(blocks_for(len(r.prompt) + r.max_new_tokens, bs) for r in requests)
    slots = int(rng.integers(1, 5))
    config = EngineConfig(
        max_num_seqs=slots, block_size=bs,
        num_gpu_blocks_override=int(rng.integers(max(1, biggest // 2), 2 * biggest + 2)),
        policy=str(rng.choice(["static", "continuous"])),
        enable_prefix_caching=bool(rng.random() < 0.75),
        max_num_batched_tokens=None if rng.random() < 0.5 else slots + int(rng.integers(1, 9)))
    requests = [replace(r, n=min(r.n, slots)) for r in requests]
    cancels = {int(rng.integers(0, 30)): int(rng.integers(0, len(requests)))
               for _ in range(int(rng.integers(0, 3)))}
    return config, requests, cancels


def exact(engine, result) -> bool:
    """Does the policy promise this request generate's very bits? Batch-invariant mode, and
    its prompt prefilled whole (no chunk) with nothing cached."""
    return engine.batch_invariant and not result.cached_tokens and result.prefill_chunks <= 1


def check_pool(engine) -> None:
    """The cache's books; exactly the running rows and padding rows hold blocks."""
    cache = engine.cache
    cache.books.check()
    members = [live for live in engine.slots if live is not None]
    assert all(live.result.id in cache.books.seqs for live in engine.running()), \
        "a row lost blocks"
    assert set(cache.books.seqs) <= {live.result.id for live in members}, "blocks of nobody's row"
    assert not any(live.result.id in cache.books.seqs for live in engine.waiting)
    assert engine.prefix_caching or not cache.books.index.name_of, "named blocks with caching off"
    for live in members:  # paging holds no more than the blocks its tokens fill (its whole
        seq = cache.books.seqs.get(live.result.id)   # prompt while a chunked prefill is under way)
        written = len(live.tokens) if live.prefilling else seq.length if seq else 0
        assert seq is None or len(seq.blocks) <= blocks_for(written, cache.books.block_size), \
            "a sequence holds more blocks than its tokens fill"


def run_case(model, seed, batch_invariant=True) -> dict:
    """One random case, checked after every step -> counts for a summary line."""
    rng = np.random.default_rng(seed)
    config, requests, cancels = random_case(rng, model.config.vocab_size,
                                            model.config.max_position_embeddings)
    expected = [solo_sample(model, r, i) for r in requests for i in range(r.n)]   # result order
    asked = [r for r in requests for _ in range(r.n)]
    engine = Engine(model, replace(config, batch_invariant=batch_invariant))
    for request in requests:
        engine.submit(request)
    while engine.waiting or engine.running():
        if engine.steps in cancels:
            result = engine.results[cancels[engine.steps]]
            was_live = result.status in ("waiting", "running")
            assert engine.cancel(result.id) is was_live
            check_pool(engine)
        engine.clock = max(engine.clock, engine.steps * STEP_SECONDS)
        engine.step()
        check_pool(engine)
        for result, (tokens, _) in zip(engine.results.values(), expected, strict=True):
            assert not exact(engine, result) or result.tokens == tokens[:len(result.tokens)], \
                f"case {seed}, request {result.id}: a token differs from generate alone"
    check_pool(engine)
    cache = engine.cache
    books = cache.books
    assert books.num_free == books.num_blocks and not books.seqs and not any(engine.slots)
    for result, request, (tokens, logprobs) in zip(engine.results.values(), asked, expected,
                                                   strict=True):
        where = f"case {seed}, request {result.id}"
        assert result.request is request, where
        assert result.status in ("finished", "cancelled", "rejected"), where
        assert not math.isnan(result.returned) and result.returned >= result.ended, where
        if result.status == "rejected":
            bs, P = config.block_size, len(request.prompt)
            need = max(blocks_for(P + request.max_new_tokens, bs),
                       blocks_for(P + 1, bs) + request.n - 1)
            assert need > config.num_blocks and result.tokens == [], where
        else:                             # finished: all its tokens; cancelled: those so far
            solo_so_far = tokens if result.status == "finished" else tokens[:len(result.tokens)]
            assert_like_solo(model, result.tokens, solo_so_far, request.prompt,
                             request.sampling, request.seed + result.choice,
                             exact(engine, result), eos_token_id=request.eos_token_id)
        if request.prompt_logprobs is not None and result.tokens:   # from its one prefill
            assert result.cached_tokens == 0 and result.prompt_logprobs[0] is None, where
            reference = log_softmax(mt.logits(model, list(request.prompt)))
            scored = result.prompt_logprobs[1:]
            assert [s.token for s in scored] == list(request.prompt[1:]), where
            assert all(abs(s.logprob - row[s.token]) < 1e-4      # the last row: past the prompt
                       for s, row in zip(scored, reference[:-1], strict=True)), where
        if logprobs is not None:          # the model's own, where the tokens so far agree
            assert [t.token for t in result.logprobs] == result.tokens, where
            # a cancelled or rejected result holds fewer tokens than generate made: the pairing
            # ends with it
            for mine, alone in zip(result.logprobs, logprobs, strict=False):
                if mine.token != alone.token:
                    break
                assert abs(mine.logprob - alone.logprob) < 1e-4, where
                assert len(mine.top) == request.logprobs, where
        if result.tokens:
            assert request.arrival <= result.first_token <= result.ended, where
    if any(r.status == "finished" and r.tokens for r in engine.results.values()):
        m = metrics(engine.results.values())
        assert all(math.isfinite(x) for x in (m.throughput, m.latency_mean, m.ttft_mean))
    return dict(requests=len(requests), steps=engine.steps,
                preemptions=sum(r.preemptions for r in engine.results.values()),
                cancelled=sum(r.status == "cancelled" for r in engine.results.values()),
                rejected=sum(r.status == "rejected" for r in engine.results.values()),
                cached=sum(r.cached_tokens > 0 for r in engine.results.values()),
                evicted=engine.cache.books.index.evicted, slid=engine.cache.books.slid_out,
                forked=sum(r.choice > 0 and r.tokens != [] for r in engine.results.values()),
                chunked=config.max_num_batched_tokens is not None,
                caching=config.enable_prefix_caching, static=config.policy == "static")
