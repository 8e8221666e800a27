"""The engine's defining properties, one test each, observed where a user would see them break:
a chunked prefill puts every chunk at its own positions; admission of n parallel samples counts
each sample's first-token copy, and a sample writing into the shared block copies it first;
a logprob is the chosen token's (not the top one's) and the top k come most likely first;
batch-invariant mode multiplies row by row (the products' call shapes) and so gives each
request the very bits it gets alone."""
import importlib

import numpy as np
import pytest

import minitransformer as mt
import minitransformer.linear as linear_module
import minitransformer.serve.runner as runner_module
from minitransformer.backend import to_numpy
from minitransformer.kvcache import KVCache
from minitransformer.logprobs import log_softmax, token_logprob
from minitransformer.model import forward
from minitransformer.sampling import SamplingSettings
from minitransformer.serve.config import EngineConfig
from minitransformer.serve.engine import Engine
from minitransformer.serve.records import Request

generate_module = importlib.import_module("minitransformer.generate")  # not the function
PROMPT = (5, 9, 2, 7, 7, 1, 30, 12, 4, 18, 3, 44, 60, 2)      # 14 tokens
SAMPLED = SamplingSettings(do_sample=True, temperature=1.0)
# Keys and values of a prompt prefilled in chunks against the same prompt prefilled whole: the
# same arithmetic on differently shaped products. Measured over the five tiny models, budgets
# 2, 3, 4, 5, 7 and 16, block size 4: at most 1.19e-7 (4 float32 ulps on values below 0.5).
# Ten times that: a chunk at a wrong position moves its keys by RoPE's angles (about 0.1).
CHUNK_TOLERANCE = 1.2e-6
# The engine's logprobs (paged decode) against log_softmax of one full forward pass: measured
# at most 1.76e-7 over the five tiny models, 5 seeds, 16 tokens each (their logits spread over
# about 0.12, so a logprob off by a wrong token's or a temperature's is off by >= 0.01).
LOGPROB_TOLERANCE = 2e-6


def held(cache, seq_id, layer, pool="k"):
    """A sequence's keys (or values) read through its block table: (Hkv, length, d)."""
    seq = cache.books.seqs[seq_id]
    blocks = to_numpy(getattr(cache, pool)[layer][np.array(seq.blocks)])   # (nb, Hkv, bs, d)
    return np.concatenate(list(blocks), axis=1)[:, :seq.length]


def whole_prefill(model, tokens) -> KVCache:
    kv = KVCache.allocate(model.config, 1, len(tokens))
    forward(model, np.array([tokens]), kv)
    return kv


# --- chunked prefill -----------------------------------------------------------------------
@pytest.mark.parametrize("budget", [3, 5, 14])
def test_a_step_prefills_at_most_its_budget(tiny_model, budget):
    """A 14-token prompt alone under a budget of b tokens a step: its first token comes at
    step ceil(14 / b), each step having computed b prompt tokens (the last one the rest)."""
    engine = Engine(tiny_model, EngineConfig(max_num_seqs=2, block_size=4,
                                              max_num_batched_tokens=budget,
                                              enable_prefix_caching=False))
    rid = engine.submit(Request(PROMPT, 3, eos_token_id=[]))
    steps = 0
    while not engine.results[rid].tokens:
        engine.step()
        steps += 1
    assert steps == engine.results[rid].prefill_chunks == -(-len(PROMPT) // budget)


@pytest.mark.parametrize("budget", [3, 4, 6])
def test_every_chunk_is_computed_at_its_own_positions(tiny_model, budget):
    """Chunks of budget - 1 tokens (one decode beside them), block size 4, so chunks start
    inside blocks: every layer's keys and values equal a whole prefill's."""
    engine = Engine(tiny_model, EngineConfig(max_num_seqs=2, block_size=4,
                                              max_num_batched_tokens=budget,
                                              enable_prefix_caching=False))
    engine.submit(Request((1, 2), 40, eos_token_id=[]))
    engine.step()                                       # it decodes during the chunks
    rid = engine.submit(Request(PROMPT, 3, eos_token_id=[]))
    while not engine.results[rid].tokens:
        engine.step()
    assert engine.results[rid].prefill_chunks == -(-len(PROMPT) // (budget - 1)) > 2
    kv = whole_prefill(tiny_model, list(PROMPT))
    for layer in range(tiny_model.config.num_hidden_layers):
        for pool in ("k", "v"):
            whole = to_numpy(getattr(kv, pool)[layer][0])[:, :len(PROMPT)]
            np.testing.assert_allclose(held(engine.cache, rid, layer, pool)[:, :len(PROMPT)],
                                       whole, rtol=0, atol=CHUNK_TOLERANCE,
                                       err_msg=f"layer {layer} {pool}")


def test_a_prompt_after_its_cached_prefix_is_computed_at_its_own_positions(tiny_model):
    """The same for the tokens after a cached prefix (the rest of the prompt is one chunk)."""
    engine = Engine(tiny_model, EngineConfig(max_num_seqs=2, block_size=4))
    engine.run([Request(PROMPT[:9], 1, eos_token_id=[])])
    rid = engine.submit(Request(PROMPT, 3, eos_token_id=[]))
    engine.step()
    assert engine.results[rid].cached_tokens == 8
    kv = whole_prefill(tiny_model, list(PROMPT))
    for layer in range(tiny_model.config.num_hidden_layers):
        np.testing.assert_allclose(held(engine.cache, rid, layer)[:, :len(PROMPT)],
                                   to_numpy(kv.k[layer][0])[:, :len(PROMPT)], rtol=0,
                                   atol=CHUNK_TOLERANCE)


# --- parallel samples ----------------------------------------------------------------------
@pytest.mark.parametrize("spare", [0, 1])
def test_admission_counts_each_samples_first_token_copy(tiny_model, spare):
    """One running request holds 1 block (it ends before it needs another). 4 samples of a
    10-token prompt need its 3 blocks and, at their first decode, 3 copies of its half-filled
    last block (the 4th writes into it): 6 blocks. With 5 free they wait for the running one
    to end; with 6 they enter at once. Either way nobody is ever preempted."""
    prompt = PROMPT[:10]
    engine = Engine(tiny_model, EngineConfig(max_num_seqs=5, num_gpu_blocks_override=6 + spare,
                                             block_size=4))
    engine.submit(Request((1, 2), 3, eos_token_id=[]))         # writes positions 2, 3
    engine.step()                                       # its prompt and first token
    samples = engine.submit(Request(prompt, 3, sampling=SAMPLED, seed=7, n=4, eos_token_id=[],
                                    arrival=engine.clock))
    assert engine.cache.books.num_free == 5 + spare and engine.cache.books.blocks_needed(0, 1) == 0
    engine.step()                          # it decodes position 2 (block 0), then admission
    assert engine.results[samples].status == ("running" if spare else "waiting")
    while engine.waiting or engine.running():
        engine.step()
    assert engine.preemptions == 0
    assert all(r.status == "finished" for r in engine.results.values())


def test_a_sample_writing_into_the_shared_block_copies_it_first(tiny_model):
    """4 samples share the prompt's half-filled last block; at their first decode each
    writes its own first token at position 10: each sample's keys there are its own token's
    (a whole prefill of prompt + that token), the prompt's slots unchanged and shared."""
    prompt = list(PROMPT[:10])
    engine = Engine(tiny_model, EngineConfig(max_num_seqs=4, block_size=4, batch_invariant=True))
    first = engine.submit(Request(tuple(prompt), 3, sampling=SAMPLED, seed=11, n=4,
                                  eos_token_id=[]))
    engine.step()                                       # prefill, forks, first tokens
    leader = engine.cache.books.seqs[first].blocks
    prompt_keys = held(engine.cache, first, 0)
    engine.step()                                       # each writes position 10
    ids = range(first, first + 4)
    tokens = [engine.results[i].tokens[0] for i in ids]
    assert len(set(tokens)) > 1, "the samples drew one first token: nothing to tell apart"
    tables = [engine.cache.books.seqs[i].blocks for i in ids]
    assert all(t[:2] == leader[:2] for t in tables) and len({t[2] for t in tables}) == 4
    for i, token in zip(ids, tokens, strict=True):
        mine = held(engine.cache, i, 0)
        assert np.array_equal(mine[:, :10], prompt_keys)
        alone = to_numpy(whole_prefill(tiny_model, prompt + [token]).k[0][0])[:, 10]
        np.testing.assert_allclose(mine[:, 10], alone, rtol=0, atol=CHUNK_TOLERANCE)


# --- logprobs ------------------------------------------------------------------------------
def test_a_logprob_is_the_chosen_tokens_and_the_top_k_come_most_likely_first():
    p = np.array([0.05, 0.3, 0.1, 0.4, 0.1, 0.05])          # known probabilities
    z = np.log(p).astype(np.float32) + 3.0                   # logits: softmax gives p back
    for token in range(len(p)):
        scored = token_logprob(z, token, k=4)
        assert scored.token == token
        assert scored.logprob == pytest.approx(np.log(p[token]), abs=1e-6)
    top = token_logprob(z, 0, k=4).top
    assert [i for i, _ in top] == [3, 1, 2, 4]               # by probability; tie: lower id
    assert [lp for _, lp in top] == pytest.approx(np.log([0.4, 0.3, 0.1, 0.1]), abs=1e-6)
    assert [i for i, _ in token_logprob(z, 0, k=6).top] == [3, 1, 2, 4, 0, 5]
    assert token_logprob(z, 5, k=0).top == ()


def test_the_engine_scores_the_token_it_drew_not_the_likeliest(tiny_model):
    """Sampling at temperature 2 draws tokens that are not the top one: each step's logprob
    is the drawn token's under the model (log_softmax of one full forward pass, before the
    temperature), and its top 3 are the three largest, in order."""
    hot = SamplingSettings(do_sample=True, temperature=2.0)
    run = Engine(tiny_model, EngineConfig(max_num_seqs=1)).run(
        [Request(PROMPT, 16, sampling=hot, seed=5, eos_token_id=[], logprobs=3)])
    result = run.results[0]
    ref = log_softmax(mt.logits(tiny_model, list(PROMPT) + result.tokens))[len(PROMPT) - 1:-1]
    off_top = 0
    for row, token, scored in zip(ref, result.tokens, result.logprobs, strict=True):
        assert scored.token == token
        assert scored.logprob == pytest.approx(row[token], abs=LOGPROB_TOLERANCE)
        ids, values = [i for i, _ in scored.top], [lp for _, lp in scored.top]
        assert values == sorted(values, reverse=True) and len(set(ids)) == 3
        assert values == pytest.approx(row[ids], abs=LOGPROB_TOLERANCE)
        assert values == pytest.approx(np.sort(row)[::-1][:3], abs=LOGPROB_TOLERANCE)
        off_top += row[token] < row.max() - 0.1
    assert off_top >= 3, "too few draws off the top token to tell the two apart"


# --- batch-invariant mode ------------------------------------------------------------------
def decode_product_rows(monkeypatch, model, batch_invariant):
    """Run 3 requests of 3 lengths through 3 slots -> (batch sizes of the decode steps, rows
    of every product made during them)."""
    decodes, rows, inside = [], [], []
    real_multiply = linear_module.multiply

    def multiply(x, w, out=None):
        if inside:
            rows.append(x.shape[0])
        return real_multiply(x, w, out)

    def watched(real):            # a decode step, flat (last_logits) or row by row (_alone)
        def step(model, ids, *args, **kwargs):
            decodes.append(len(ids))
            inside.append(1)
            try:
                return real(model, ids, *args, **kwargs)
            finally:
                inside.pop()
        return step
    monkeypatch.setattr(linear_module, "multiply", multiply)
    for name in ("last_logits", "last_logits_alone"):
        monkeypatch.setattr(runner_module, name, watched(getattr(generate_module, name)))
    Engine(model, EngineConfig(max_num_seqs=3, block_size=4, batch_invariant=batch_invariant)).run(
        [Request(PROMPT[:n], 5, eos_token_id=[]) for n in (3, 7, 12)])
    return decodes, rows


def test_batch_invariant_decodes_multiply_each_row_alone(tiny_model, monkeypatch):
    """Every product of a batched decode takes one row (a batch of one's call), for every
    projection and the head; the default mode takes the batch as one flat matrix."""
    decodes, rows = decode_product_rows(monkeypatch, tiny_model, batch_invariant=True)
    assert max(decodes) == 3
    layers = tiny_model.config.num_hidden_layers
    assert len(rows) == sum(decodes) * (4 * layers + 1)    # qkv, o, gate_up, down; the head
    assert set(rows) == {1}
    decodes, rows = decode_product_rows(monkeypatch, tiny_model, batch_invariant=False)
    assert max(rows) == 3 and len(rows) == len(decodes) * (4 * layers + 1)


def test_a_steps_rows_draw_their_tokens_side_by_side_on_the_threads(tiny_model, monkeypatch):
    """At 2 threads the rows of a decode step that sample draw on the caller's thread and the
    pool's worker at once (threads.map_in_parts; its first steps' draws are cut, while it
    measures), each the token it draws at 1 thread: a draw reads only its own row's logits
    and generator. Top-p's sort is the costly draw."""
    import threading

    from minitransformer.kernels import threads
    drawn_on, draw = [], Engine._draw

    def spy(self, seq, logits):
        drawn_on.append(threading.current_thread().name)
        return draw(self, seq, logits)
    monkeypatch.setattr(Engine, "_draw", spy)
    monkeypatch.setattr(threads, "taken", {})    # measured afresh: the first steps alternate
    monkeypatch.setattr(threads, "timings", {})  # whole and in parts (whole_or_parts)
    top_p = SamplingSettings(do_sample=True, temperature=0.9, top_p=0.9)
    requests = [Request(PROMPT[:n], 6, sampling=top_p, seed=n + i, eos_token_id=[])
                for i, n in enumerate((3, 6, 6, 11))]
    tokens, names = {}, {}
    for n in (1, 2):
        drawn_on.clear()
        with threads.using(n):
            run = Engine(tiny_model, EngineConfig(max_num_seqs=4, block_size=4)).run(requests)
        tokens[n], names[n] = [r.tokens for r in run.results], set(drawn_on)
    assert tokens[1] == tokens[2] and all(len(t) == 6 for t in tokens[1])
    here = threading.current_thread().name
    assert names[1] == {here} and names[2] == {here, "product-part-1"}


@pytest.mark.usefixtures("step_threads")
def test_batch_invariant_requests_get_the_bits_they_get_alone(tiny_model):
    """Four requests of three lengths decode side by side, nothing cached: each one's
    logprobs (float64 from its logits) are exactly generate's for it alone."""
    requests = [Request(PROMPT[:n], 8, sampling=SAMPLED, seed=n + i, eos_token_id=[],
                        logprobs=0) for i, n in enumerate((3, 6, 6, 11))]
    run = Engine(tiny_model, EngineConfig(max_num_seqs=4, block_size=4, batch_invariant=True,
                                          enable_prefix_caching=False)).run(requests)
    for request, result in zip(requests, run.results, strict=True):
        alone = mt.generate(tiny_model, list(request.prompt), 8, sampling=SAMPLED,
                            seed=request.seed, eos_token_id=[], logprobs=0)
        assert result.tokens == [s.token for s in alone]
        assert [s.logprob for s in result.logprobs] == [s.logprob for s in alone]
