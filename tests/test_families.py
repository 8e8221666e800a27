"""Every way of running the model on the newer families: Qwen3 (q/k norms, its own head_dim),
Llama 3.x's rope scaling and sliding windows (Mistral; Qwen2's upper layers), as
tests/test_golden.py holds them against transformers.

The cache, the paged engine with prefix caching and chunked prefill, and speculation give the
tokens plain greedy decoding gives: the family changes what a layer computes, never how the
machinery around it saves work. Each run's exactness is the policy's (conftest.assert_like_solo):
== where the calls match, the near-tie rule where batching or chunking reorders a sum.
"""
import numpy as np
import pytest

import minitransformer as mt
from conftest import assert_like_solo
from minitransformer.checkpoints.synth import (
    llama_config,
    mistral_config,
    qwen2_config,
    qwen3_config,
    random_model,
)
from minitransformer.kvcache import KVCache
from minitransformer.kvquant import cache_bytes_per_token
from minitransformer.lookup import PromptLookup
from minitransformer.serve.config import EngineConfig, SpeculativeConfig
from minitransformer.serve.engine import Engine
from minitransformer.serve.records import Request
from minitransformer.speculative import speculative_generate

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}
FAMILIES = {
    "qwen3": qwen3_config(vocab_size=128, num_hidden_layers=3),
    "qwen3-untied-bias": qwen3_config(vocab_size=128, attention_bias=True,
                                      tie_word_embeddings=False),
    "llama3-rope": llama_config(vocab_size=128, head_dim=16, rope_scaling=LLAMA3),
}


WINDOWED = {  # a window of 6 under prompts of 12-29 tokens: the ring turns over many times
    "mistral": mistral_config(vocab_size=128, sliding_window=6),
    "qwen2-upper-layers": qwen2_config(vocab_size=128, num_hidden_layers=3,
                                       use_sliding_window=True, sliding_window=6,
                                       max_window_layers=1),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def model(request):
    return random_model(FAMILIES[request.param], seed=7)


@pytest.fixture(scope="module", params=sorted(WINDOWED))
def windowed(request):
    return random_model(WINDOWED[request.param], seed=7)


def assert_same_steps(cached, recomputed):
    assert [t.token for t in cached] == [t.token for t in recomputed]
    np.testing.assert_allclose([[lp for _, lp in t.top] for t in cached],
                               [[lp for _, lp in t.top] for t in recomputed], atol=2e-6)


def prompts(model):
    rng = np.random.default_rng(3)
    stem = rng.integers(1, model.config.vocab_size, 9).tolist()      # a prefix worth sharing
    return [stem + rng.integers(1, model.config.vocab_size, n).tolist() for n in (3, 11, 20)]


def test_the_cache_gives_the_tokens_and_logprobs_of_recomputing(model):
    """Tokens equal, and every step's log-probabilities within float32 rounding: a random
    model's tokens hardly depend on attention, its logprobs do (a decode step that turned
    its keys by the wrong angles moves them by ~1e-4)."""
    for ids in prompts(model):
        assert_same_steps(mt.generate(model, ids, 12, logprobs=3),
                          mt.generate(model, ids, 12, cache=False, logprobs=3))


def test_a_rotating_cache_gives_the_tokens_of_recomputing_holding_window_slots(windowed):
    """A windowed layer keeps W slots whatever the length (the chapter's formula with W for
    the sequence), a full layer one per position; tokens and logprobs are recomputing's, with
    its plain causal-and-window mask over the whole sequence."""
    c = windowed.config
    for ids in prompts(windowed):
        assert_same_steps(mt.generate(windowed, ids, 12, logprobs=3),
                          mt.generate(windowed, ids, 12, cache=False, logprobs=3))
    kv = KVCache.allocate(c, 1, 500)
    slots = [c.window(i) or 500 for i in range(c.num_hidden_layers)]
    per_slot = cache_bytes_per_token(c, "f32") // c.num_hidden_layers
    assert kv.nbytes == per_slot * sum(slots) and kv.rings
    assert mt.generate(windowed, prompts(windowed)[2], 40) == \
        mt.generate(windowed, prompts(windowed)[2], 40, cache=False)


def test_speculation_rolls_back_within_the_rings_spare_slots(windowed):
    """Rejected drafts are trimmed from a ring that kept gamma + 1 slots past its window: the
    tokens are generate's; a ring without spare slots refuses a trim it could not undo."""
    for ids in prompts(windowed):
        ids = ids + ids[:9]                                  # a repeat for the lookup to find
        made = speculative_generate(windowed, PromptLookup(max_ngram=3), ids, 16, gamma=4)
        assert made.tokens == mt.generate(windowed, ids, 16)
        assert made.rejected > 0 or made.accepted > 0
    kv = KVCache.allocate(windowed.config, 1, 40)
    mt.model.forward(windowed, np.array([prompts(windowed)[0]]), kv)
    with pytest.raises(ValueError, match="spare=0"):
        kv.trim(1)


LONG = 30   # new tokens: prompts of 12-29 grow to 42-59 positions, 7-10 windows of 6

WINDOWED_ENGINES = {
    "prefix-cache": {"max_num_seqs": 3, "block_size": 4},
    "chunks-under-the-window": {"max_num_seqs": 3, "block_size": 4, "max_num_batched_tokens": 4},
    "chunks-over-the-window": {"max_num_seqs": 3, "block_size": 4, "max_num_batched_tokens": 9},
    "batch-invariant": {"max_num_seqs": 3, "block_size": 4, "batch_invariant": True},
    "tiled": {"max_num_seqs": 3, "block_size": 4, "attention": "tiled"},
    "ngram-speculation": {"max_num_seqs": 2, "block_size": 4, "speculative_config":
                          SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=3)},
    "draft-model-speculation": {"max_num_seqs": 2, "block_size": 4, "speculative_config":
                                SpeculativeConfig(num_speculative_tokens=3,
                                                  method="draft_model", model="-")},
}


@pytest.fixture(scope="module")
def recomputed(windowed):
    """generate's steps without a cache (its plain causal-and-window mask over the whole
    sequence) for each prompt, by prompt."""
    return {tuple(ids): mt.generate(windowed, ids, LONG, cache=False, eos_token_id=[],
                                    logprobs=1) for ids in prompts(windowed)}


@pytest.mark.parametrize("name", sorted(WINDOWED_ENGINES))
def test_the_paged_engine_gives_a_windowed_models_tokens(windowed, recomputed, name):
    """Each layer's window in the paged pool's attention (a sliding layer's mask, a full
    layer's causal one) and the blocks that slid out of every layer's window released,
    through prefix caching (the second run finds the first's blocks, kept after they slid
    out), chunks shorter and longer than the window and speculation: greedy tokens are recomputing's (by the near-tie policy), and
    each token's logprob within float32 rounding of its (a random model's tokens hardly
    depend on attention, its logprobs do: a window one too wide moves them by ~0.05)."""
    fields = WINDOWED_ENGINES[name]
    draft = random_model(WINDOWED["mistral"], seed=8) if "draft-model" in name else None
    engine = Engine(windowed, EngineConfig(**fields), draft_model=draft)
    requests = [Request(tuple(ids), LONG, eos_token_id=[], logprobs=1) for ids in recomputed]
    first, again = engine.run(requests), engine.run(requests)
    assert all(r.cached_tokens for r in again.results)         # the prefix cache was read
    for result in first.results + again.results:
        prompt, steps = list(result.request.prompt), recomputed[result.request.prompt]
        assert_like_solo(windowed, result.tokens, [s.token for s in steps], prompt,
                         eos_token_id=[])
        same = next((i for i, (a, b) in enumerate(zip(result.tokens, steps, strict=True))
                     if a != b.token), LONG)
        np.testing.assert_allclose([t.logprob for t in result.logprobs[:same]],
                                   [s.logprob for s in steps[:same]], atol=1e-5)


@pytest.mark.parametrize("fields", [
    {"max_num_seqs": 3, "block_size": 4},                                  # prefix caching
    {"max_num_seqs": 3, "block_size": 4, "max_num_batched_tokens": 6},     # chunked prefill
    {"max_num_seqs": 3, "block_size": 4, "batch_invariant": True},
    {"max_num_seqs": 2, "block_size": 4, "speculative_config": SpeculativeConfig(
        num_speculative_tokens=3, prompt_lookup_max=3)},                   # speculation
], ids=["prefix-cache", "chunked", "batch-invariant", "ngram-speculation"])
def test_the_paged_engine_gives_generates_tokens(model, fields):
    engine = Engine(model, EngineConfig(**fields))
    first = engine.run([Request(tuple(ids), 10, eos_token_id=[]) for ids in prompts(model)])
    again = engine.run([Request(tuple(ids), 10, eos_token_id=[]) for ids in prompts(model)])
    assert all(r.cached_tokens for r in again.results)         # the prefix cache was read
    for result in first.results + again.results:
        prompt = list(result.request.prompt)
        exact = fields.get("batch_invariant") and not result.cached_tokens \
            and result.prefill_chunks <= 1
        assert_like_solo(model, result.tokens, mt.generate(model, prompt, 10, eos_token_id=[]),
                         prompt, batch_invariant=exact, eos_token_id=[])


FAR = 100   # new tokens: a prompt of 20 grows to 119 positions, about 20 windows of 6


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["no-prefix-cache", "prefix-cache"])
def test_a_windowed_sequence_holds_one_windows_blocks_however_long_it_runs(windowed,
                                                                          prefix_caching):
    """Where every layer slides (Mistral), a sequence's blocks that slid out of its next
    query's window go back as it runs: past its prompt it holds ceil(W / bs) + 1 blocks at
    every step, a pool of 6 blocks (its prompt's) serves 119 positions (30 blocks' worth),
    and every block it released is counted: (119 - W + 1) // bs = 28 of them, on the free list
    (with prefix caching, kept by name until evicted: a second run of the same prompt is
    still recomputing's). Where a layer attends fully (Qwen2 from layer 1) nothing can be
    released: the sequence holds a block per 4 positions, 30 at the end."""
    W, bs, prompt = 6, 4, prompts(windowed)[1]                      # 20 tokens
    slides = windowed.config.cache_window is not None
    N = 6 if slides else 30
    engine = Engine(windowed, EngineConfig(max_num_seqs=1, block_size=bs,
                                           num_gpu_blocks_override=N,
                                           enable_prefix_caching=prefix_caching), history=True)
    books, schedule, planned = engine.cache.books, engine.scheduler.schedule, []

    def plan(*args):                 # blocks held once a decode step has made its room
        made = schedule(*args)
        if not made.prefill:
            planned.append(books.stats().blocks_held)
        return made

    engine.scheduler.schedule = plan
    reference = mt.generate(windowed, prompt, FAR, cache=False, eos_token_id=[], logprobs=1)
    for _ in range(2):
        (result,) = engine.run([Request(tuple(prompt), FAR, eos_token_id=[], logprobs=1)]).results
        assert_like_solo(windowed, result.tokens, [s.token for s in reference], prompt,
                         eos_token_id=[])
        if result.tokens == [s.token for s in reference]:
            np.testing.assert_allclose([t.logprob for t in result.logprobs],
                                       [s.logprob for s in reference], atol=1e-5)
        books.check()
        assert books.num_free == N and not books.seqs           # all of it back
        if not prefix_caching:
            break
    kept = [stats.blocks_held for stats in engine.memory]     # at each step's end
    if slides:
        assert max(planned) == -(-W // bs) + 1 and max(kept) <= -(-W // bs) + 1
        assert books.slid_out == (119 - W + 1) // bs * (1 + prefix_caching)
        assert len(books.free) == N or prefix_caching
    else:
        assert kept[-1] == 30 and books.slid_out == 0


def test_preempted_windowed_sequences_come_back_with_their_holes(windowed, monkeypatch):
    """Four sequences in a pool too small for them all: the latest admitted is swapped out,
    its released blocks staying released (a swapped-out table keeps its holes, only the
    blocks it holds are copied out and back), and every token is recomputing's."""
    from minitransformer.serve.blocks import BlockManager
    rng = np.random.default_rng(5)
    ps = [rng.integers(1, 128, 8).tolist() for _ in range(4)]    # 8 tokens: past the window
    slid, swap_out = [], BlockManager.swap_out
    monkeypatch.setattr(BlockManager, "swap_out",
                        lambda books, seq_id: slid.append(books.seqs[seq_id].slid) or
                        swap_out(books, seq_id))
    slides = windowed.config.cache_window is not None
    engine = Engine(windowed, EngineConfig(max_num_seqs=4, block_size=4,
                                           num_gpu_blocks_override=9 if slides else 14))
    run = engine.run([Request(tuple(p), LONG, eos_token_id=[], logprobs=1) for p in ps])
    assert engine.preemptions > 0 and any(slid) == slides
    for result, ids in zip(run.results, ps, strict=True):
        steps = mt.generate(windowed, ids, LONG, cache=False, eos_token_id=[], logprobs=1)
        assert_like_solo(windowed, result.tokens, [s.token for s in steps], ids, eos_token_id=[])
        np.testing.assert_allclose([t.logprob for t in result.logprobs],
                                   [s.logprob for s in steps], atol=1e-5)


def test_a_windowed_draft_model_releases_its_blocks_as_the_target_does(windowed):
    """A Mistral draft (window 6) over a pool of its own as small as the target's, 6 blocks:
    rolled back to the tokens kept, its blocks that slid out go back too, so it drafts to the
    end of a 100-token answer (holding every block, it would stop once its 6 were full,
    after 3 drafts); the tokens are recomputing's."""
    prompt = prompts(windowed)[1]                                   # 20 tokens
    draft = random_model(WINDOWED["mistral"], seed=8)
    spec = SpeculativeConfig(num_speculative_tokens=3, method="draft_model", model="-")
    N = 6 if windowed.config.cache_window else 30
    engine = Engine(windowed, EngineConfig(max_num_seqs=1, block_size=4, speculative_config=spec,
                                           num_gpu_blocks_override=N), draft_model=draft)
    (result,) = engine.run([Request(tuple(prompt), FAR, eos_token_id=[])]).results
    assert_like_solo(windowed, result.tokens,
                     mt.generate(windowed, prompt, FAR, cache=False, eos_token_id=[]), prompt,
                     eos_token_id=[])
    books = engine.speculator.proposer.draft.pool.books
    assert books.slid_out >= 20 and engine.speculator.counters.drafts >= FAR // 2
