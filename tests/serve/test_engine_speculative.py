"""Speculation inside the engine: every decoding sequence's draft verified in one batched pass,
exact (batch-invariant greedy == the engine without speculation == generate; default mode by
the near-tie rule; sampled draws from the target's distribution, chi-square), the paged cache's
books right after every step, and what the server sees (streamed tokens, counters). A draft
named only by its path is loaded; with prefix caching off no block is named; a cancel retires
what speculation keeps for the sequence."""
from dataclasses import replace

import numpy as np
import pytest

import minitransformer as mt
from conftest import assert_like_solo
from minitransformer import speculative
from minitransformer.checkpoints.synth import qwen2_config, random_model
from minitransformer.sampling import SamplingSettings
from minitransformer.serve import drafting
from minitransformer.serve.config import EngineConfig, SpeculativeConfig
from minitransformer.serve.engine import Engine
from minitransformer.serve.records import Request
from minitransformer.speculative import first_layers
from test_speculative import SAMPLING_CASES, accept_always, exact_joint, goodness_of_fit

NGRAM = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=3)


@pytest.fixture(scope="module")
def close_calls(checkpoint_dir):
    """Greedy tokens that are not the last one again: drafts are kept and rejected."""
    return mt.load(checkpoint_dir("qwen2-close-calls"))


def workload(seed=0, n=7, new=24):
    """Prompts that repeat a passage (the lookup finds it), prompts that do not, a shared
    start (the prefix cache), one stopping at an eos id, one asking for logprobs."""
    rng = np.random.default_rng(seed)
    passage = rng.integers(0, 512, 10).tolist()
    prompts = [passage * 2, passage + passage[:4], rng.integers(0, 512, 5).tolist(),
               passage * 2 + [7], [3], passage[:6] * 3, rng.integers(0, 512, 30).tolist()]
    return [Request(tuple(p), new, eos_token_id=[], logprobs=2 if i in (0, 3) else None)
            for i, p in enumerate(prompts[:n])]


def checked_run(engine, requests):
    """Serve requests, the pool's books checked after every step, and no decoding sequence
    holding a block past its length (a rejected position's block is given back at once)."""
    def check(e):
        e.cache.books.check()
        for live in e.running():
            seq = e.cache.books.seqs[live.result.id]
            if not live.prefilling:     # (a prompt holds its blocks from admission)
                assert len(seq.blocks) == e.cache.books.blocks_for(seq.length), live.result.id
    return engine.run(requests, on_step=check)


SETTINGS = {  # name -> EngineConfig fields: the ways a step may be shaped
    "continuous": {"max_num_seqs": 3},
    "static": {"max_num_seqs": 3, "policy": "static"},
    "preempting": {"max_num_seqs": 4, "num_gpu_blocks_override": 14, "block_size": 4},
    "chunked": {"max_num_seqs": 3, "max_num_batched_tokens": 8},
    "no prefix cache": {"max_num_seqs": 7, "enable_prefix_caching": False, "block_size": 2},
}


def engine(model, speculative=None, draft_model=None, history=False, **fields):
    return Engine(model, EngineConfig(speculative_config=speculative, **fields), history,
                  draft_model)


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_batch_invariant_greedy_is_the_engine_without_speculation(close_calls, setting):
    model, kw = close_calls, SETTINGS[setting]
    requests = workload()
    plain = checked_run(engine(model, batch_invariant=True, **kw), requests)
    served = engine(model, NGRAM, batch_invariant=True, **kw)
    run = checked_run(served, requests)
    for r, p, request in zip(run.results, plain.results, requests, strict=True):
        assert r.status == p.status == "finished"
        assert r.tokens == p.tokens == mt.generate(model, list(request.prompt),
                                                   request.max_new_tokens, eos_token_id=[])
        assert r.logprobs == p.logprobs
    c = served.speculator.counters
    assert c.draft_tokens > c.accepted_tokens > 0     # drafts kept and drafts rejected
    books = served.cache.books
    assert books.num_free == books.num_blocks   # every block back (or kept)
    assert not served.speculator.judged               # no books of finished sequences
    if setting == "preempting":
        assert run.preemptions > 0


def test_an_eos_among_the_kept_tokens_ends_the_request_there(close_calls):
    """The target as its own draft: every proposal is kept, 5 tokens a step after the
    prefill's first (token 0), so tokens 1-4, 6-9, ... are accepted proposals; the first of
    them not seen before, as the eos id, ends the request on it, the rest of its step unmade."""
    requests = workload()
    plain = mt.generate(close_calls, list(requests[0].prompt), 24, eos_token_id=[])
    at = next(i for i in range(1, 24) if i % 5 and plain[i] not in plain[:i])
    requests = [Request(r.prompt, r.max_new_tokens, eos_token_id=plain[at]) for r in requests]
    want = [mt.generate(close_calls, list(r.prompt), r.max_new_tokens, eos_token_id=plain[at])
            for r in requests]
    itself = SpeculativeConfig(num_speculative_tokens=4, method="draft_model", model="-")
    served = engine(close_calls, itself, close_calls, max_num_seqs=3, batch_invariant=True)
    run = checked_run(served, requests)
    assert [r.tokens for r in run.results] == want and len(want[0]) == at + 1
    c = served.speculator.counters
    assert c.accepted_tokens == c.draft_tokens > 0


def test_the_next_turn_finds_the_speculated_answer_cached(close_calls):
    """The blocks a speculating sequence fills with kept tokens are named as in plain decoding
    (after the trim: never a rejected one), those of its last step too, so a chat's next turn
    finds every full block of the conversation so far cached. (The target as its own draft:
    11 tokens are the prefill's and two steps of 5, the last one ending the request.)"""
    first = Request(workload()[0].prompt, 11, eos_token_id=[])
    itself = SpeculativeConfig(num_speculative_tokens=4, method="draft_model", model="-")
    cached = {}
    for name, config in (("plain", None), ("speculating", itself)):
        served = engine(close_calls, config, close_calls, max_num_seqs=2, block_size=2,
                        batch_invariant=True)
        run = served.run([first])
        answer = run.results[0].tokens
        turn = Request(first.prompt + tuple(answer) + (5, 6), 4, eos_token_id=[])
        cached[name] = served.run([turn]).results[0].cached_tokens
        served.cache.books.check()
    assert run.steps == 3                           # prefill, then two verifications
    held = len(first.prompt) + len(answer) - 1     # the cache lags the last token
    assert cached["speculating"] == cached["plain"] == held // 2 * 2


def test_a_block_is_named_only_with_the_tokens_it_finally_holds(close_calls):
    """A rejected draft's key is written in the slot its bonus token takes next, and a held
    draft slot nobody proposed for holds nothing: a block is named for the prefix cache only
    after the trim, once it holds the kept tokens alone. So the next turn, served from the
    cached conversation, reads the keys plain decoding wrote: its tokens and logprobs are the
    engine's that never speculated, bit for bit (batch-invariant)."""
    first = Request(workload()[0].prompt, 24, eos_token_id=[])
    turns = {}
    for name, config in (("plain", None), ("speculating", NGRAM)):
        served = engine(close_calls, config, max_num_seqs=2, block_size=2, batch_invariant=True)
        answer = served.run([first]).results[0].tokens
        turn = Request(first.prompt + tuple(answer) + (5, 6), 8, eos_token_id=[], logprobs=3)
        turns[name] = served.run([turn]).results[0]
        served.cache.books.check()
    c = served.speculator.counters
    assert c.draft_tokens > c.accepted_tokens > 0       # drafts kept and drafts rejected
    plain, speculating = turns["plain"], turns["speculating"]
    assert speculating.cached_tokens == plain.cached_tokens > len(first.prompt)
    assert (speculating.tokens, speculating.logprobs) == (plain.tokens, plain.logprobs)


def test_a_draft_model_in_the_engine(close_calls):
    config = SpeculativeConfig(num_speculative_tokens=3, method="draft_model", model="-")
    requests = workload(n=4)
    served = engine(close_calls, config, first_layers(close_calls, 1), max_num_seqs=2,
                    batch_invariant=True)
    run = checked_run(served, requests)
    for r, request in zip(run.results, requests, strict=True):
        assert r.tokens == mt.generate(close_calls, list(request.prompt),
                                       request.max_new_tokens, eos_token_id=[])
    assert served.speculator.counters.accepted_tokens > 0 and not served.speculator.proposer.holding()


def short_draft(model, positions):
    """The target's first layer as a draft that holds only `positions` positions."""
    draft = first_layers(model, 1)
    return replace(draft, config=replace(draft.config, max_position_embeddings=positions))


@pytest.mark.parametrize("policy", ["continuous", "static"])
def test_a_draft_with_fewer_positions_drafts_only_while_a_sequence_fits_them(close_calls,
                                                                             policy):
    """A 16-position draft beside a 256-position target (vLLM's way: a sequence past the
    draft's positions stops drafting): a request within them (5 + 8 tokens), one that grows
    past them (10 + 24), one whose prompt alone is longer (20 + 6): each gets the
    non-speculating engine's greedy tokens (== generate); the second drafted while it fit and
    not after, the third never; nobody's draft cache outlives its drafting."""
    config = SpeculativeConfig(num_speculative_tokens=3, method="draft_model", model="-")
    draft = short_draft(close_calls, 16)
    requests = [Request(tuple(range(1, 1 + p)), new, eos_token_id=[])
                for p, new in ((5, 8), (10, 24), (20, 6))]
    plain = checked_run(engine(close_calls, batch_invariant=True, policy=policy,
                               max_num_seqs=3), requests)
    made = []                   # (sequence id, its length, its draft) per row drafting
    steps = []                  # (sequence id, its length, the draft length asked) per step
    original = drafting.DraftModel.propose

    def propose(self, asks):
        out = original(self, asks)
        for a, (drafts, _) in zip(asks, out, strict=True):
            steps.append((a.seq_id, len(a.tokens), a.n))
            made.append((a.seq_id, len(a.tokens), len(drafts)))
        return out
    drafting.DraftModel.propose = propose
    try:
        served = engine(close_calls, config, draft, batch_invariant=True, policy=policy,
                        max_num_seqs=3)
        run = checked_run(served, requests)
    finally:
        drafting.DraftModel.propose = original
    for r, p, request in zip(run.results, plain.results, requests, strict=True):
        assert r.status == "finished" and r.tokens == p.tokens == mt.generate(
            close_calls, list(request.prompt), request.max_new_tokens, eos_token_id=[])
    drafted = {i: [(length, n) for seq, length, n in made if seq == i and n] for i in range(3)}
    assert drafted[0] and drafted[1] and not drafted[2]
    assert all(length + n - 1 <= 16 for length, n in drafted[0] + drafted[1])
    # it drafted at every step it fitted (up to the edge), and at none past it
    second = [(n_tokens, n) for seq, n_tokens, n in steps if seq == 1]
    assert any(n_tokens > 16 for n_tokens, _ in second)
    assert all((n > 0) == (n_tokens <= 16) for n_tokens, n in second
               if n_tokens - 10 < 24 - 1), second
    assert served.speculator.counters.accepted_tokens > 0 and not served.speculator.proposer.holding()


def test_online_a_request_past_a_short_drafts_positions_is_served_as_without_speculation(
        close_calls):
    """What the server saw: a request whose prompt + max_tokens passes the draft's positions
    was a 500 "engine failed", then 503 for ever. Now, beside the non-speculating engine
    online, the same greedy tokens for one within and one past a 16-position draft, and the
    loop still up."""
    from minitransformer.serve.online import OnlineEngine
    config = SpeculativeConfig(num_speculative_tokens=3, method="draft_model", model="-")
    requests = [Request(tuple(range(1, 6)), 8, eos_token_id=[]),
                Request(tuple(range(1, 11)), 30, eos_token_id=[])]
    onlines = [OnlineEngine(engine(close_calls, spec, short_draft(close_calls, 16),
                                   max_num_seqs=2, batch_invariant=True))
               for spec in (None, config)]
    try:
        plain, speculating = [[list(o.stream(r)) for r in requests] for o in onlines]
        assert speculating == plain and onlines[1].error is None
        assert onlines[1].engine.speculator.counters.drafts > 0
    finally:
        for online in onlines:
            online.close()


def test_num_speculative_tokens_is_bounded_by_the_positions_and_metrics_by_the_drafts(
        close_calls):
    """More than the model's positions is refused naming both, before anything is made; as
    many is served, and /metrics' per-position lines are as many as the longest draft verified
    (a request of 6 tokens drafts 4 after its first: not a line per position of the model)."""
    from minitransformer.serve.prometheus import speculative_lines
    positions = close_calls.config.max_position_embeddings
    for n in (positions + 1, 10**30):
        with pytest.raises(ValueError, match=f"num_speculative_tokens={n} is more than the "
                                             f"model's {positions} positions"):
            engine(close_calls, SpeculativeConfig(num_speculative_tokens=n))
    itself = SpeculativeConfig(num_speculative_tokens=positions, method="draft_model",
                               model="-")           # every proposal kept
    served = engine(close_calls, itself, close_calls, max_num_seqs=2, batch_invariant=True)
    request = workload()[0]
    run = served.run([replace(request, max_new_tokens=6, logprobs=None)])
    assert run.results[0].tokens == mt.generate(close_calls, list(request.prompt), 6,
                                                eos_token_id=[])
    c = served.speculator.counters          # the prefill's token, then one draft of 4
    assert (c.drafts, c.per_position) == (1, [1, 1, 1, 1])
    lines = speculative_lines('model_name="m"', c)
    assert sum("per_pos_total{" in line for line in lines) == len(c.per_position)


def test_a_draft_model_of_another_vocabulary_is_refused_naming_both_sizes(close_calls):
    """The engine's draft model is held to generate's rule (speculative.check_vocabulary)."""
    V = close_calls.config.vocab_size
    other = replace(close_calls, config=replace(close_calls.config, vocab_size=V + 1))
    with pytest.raises(ValueError, match=f"share a vocabulary: the draft has {V + 1} tokens, "
                                         f"the target {V}"):
        engine(close_calls, SpeculativeConfig(2, "draft_model", "-"), other)


def test_default_mode_greedy_follows_the_near_tie_rule(close_calls):
    requests = workload(seed=1)
    served = engine(close_calls, NGRAM, max_num_seqs=4)
    run = checked_run(served, requests)
    for r, request in zip(run.results, requests, strict=True):
        prompt = list(request.prompt)
        assert_like_solo(close_calls, r.tokens,
                         mt.generate(close_calls, prompt, request.max_new_tokens,
                                     eos_token_id=[]), prompt, eos_token_id=[])
    assert served.speculator.counters.accepted_tokens > 0


def test_one_verification_pass_per_step_for_the_whole_batch(close_calls, monkeypatch):
    """Each step is ONE forward call: every sequence's draft verified together (never one
    sequence after another), with the step's prompts where it has some: counted by wrapping
    the pass (a ragged one, or a step without drafts: the plain decode's)."""
    from minitransformer.serve import runner as runner_module
    calls = []

    def counted(real):
        def call(model, ids, *args, **kw):
            calls.append(ids.shape)
            return real(model, ids, *args, **kw)
        return call
    monkeypatch.setattr(runner_module, "forward", counted(runner_module.forward))
    monkeypatch.setattr(runner_module, "last_logits", counted(runner_module.last_logits))
    served = engine(close_calls, NGRAM, history=True, max_num_seqs=4)
    served.run(workload(n=4))
    batches = [B for B, _ in served.decode_times]
    assert len(calls) == served.steps and max(batches) == 4
    assert all(B == 1 or R == 1 for B, R in calls)          # (1, R) or a decode's (B, 1)
    assert max(R for B, R in calls if B == 1) > 4          # (1, R): drafts


def test_a_steps_drafts_are_counted_against_max_num_batched_tokens(close_calls, monkeypatch):
    """Every step's tokens, its verification rows (last tokens and drafts) and its prompt
    chunks together, stay within the budget; without it the same run verifies more."""
    from minitransformer.serve import runner as runner_module
    tokens = []                         # per step, the tokens its forward passes took

    def counted(real):
        def forward(model, ids, *args, **kw):
            tokens[-1] += ids.size
            return real(model, ids, *args, **kw)
        return forward
    monkeypatch.setattr(runner_module, "forward", counted(runner_module.forward))
    for budget, fits in ((8, True), (None, False)):
        served = engine(close_calls, NGRAM, max_num_seqs=3, max_num_batched_tokens=budget)
        tokens[:] = [0]
        served.run(workload(), on_step=lambda e: tokens.append(0))
        assert (max(tokens) <= 8) == fits, tokens
        assert served.speculator.counters.accepted_tokens > 0


def test_min_acceptance_drafts_less_and_changes_no_greedy_token(close_calls):
    """A bar of 0.8, above every sequence's acceptance before evidence (1/2): its drafts come
    only once its lookup, judged for free while it does not draft, has been right often
    enough; fewer proposals are rejected than drafting every step, the tokens the same."""
    requests = workload()
    plain = [r.tokens for r in engine(close_calls, batch_invariant=True).run(requests).results]
    counters = {}
    for config in (NGRAM, replace(NGRAM, min_acceptance=0.8)):
        served = engine(close_calls, config, batch_invariant=True)
        assert [r.tokens for r in served.run(requests).results] == plain
        counters[config.min_acceptance] = c = served.speculator.counters
        assert c.accepted_tokens > 0
    rejected = {bar: c.draft_tokens - c.accepted_tokens for bar, c in counters.items()}
    assert rejected[0.8] < rejected[None]


# ---------------------------------------------------------------------------- a cancel
PROMPT = (1, 2, 3, 1, 2, 3, 1, 2)      # repeats: the lookup proposes


@pytest.fixture(scope="module")
def model():
    """A random Qwen2 (this file's own: conftest's `model` is the server tests')."""
    return random_model(qwen2_config())


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_a_cancel_leaving_nothing_running_retires_speculations_books_and_draft(model, method):
    """A cancel retires everything the sequence held, at the cancel: its blocks, and what
    speculation keeps for it (its acceptance books, a draft model's cache of it). When the
    cancel leaves nothing running no step follows, so nothing left for "the next step" would
    ever go."""
    spec = SpeculativeConfig(num_speculative_tokens=3, method=method,
                             model="-" if method == "draft_model" else None)
    engine = Engine(model, EngineConfig(max_num_seqs=2, num_gpu_blocks_override=16,
                                        block_size=4, speculative_config=spec),
                    draft_model=first_layers(model, 1) if method == "draft_model" else None)
    rid = engine.submit(Request(PROMPT, 20, eos_token_id=[]))
    for _ in range(3):                          # the prefill, then verifications
        engine.step()
    speculator = engine.speculator
    assert rid in speculator.judged and speculator.counters.draft_tokens > 0
    if method == "draft_model":
        assert rid in speculator.proposer.holding()
    assert engine.cancel(rid)
    assert not engine.running() and not engine.waiting
    assert speculator.judged == {} and speculator.proposer.holding() == set()
    books = engine.cache.books
    assert books.seqs == {} and books.num_free == books.num_blocks
    assert engine.results[rid].status == "cancelled"


# ---------------------------------------------------------------------------- sampling
N_RUNS = 1500   # seeded requests: a wrong rule misses by miles (test_speculative's count)


def served_samples(target, prompt, k, settings, config, draft=None):
    """N_RUNS seeded requests through one speculating engine, 16 at a time -> their tokens."""
    served = engine(target, config, draft, max_num_seqs=16)
    run = served.run([Request(tuple(prompt), k, sampling=settings, seed=s, eos_token_id=[])
                      for s in range(N_RUNS)])
    return [tuple(r.tokens) for r in run.results], served.speculator.counters


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_sampled_requests_draw_from_the_targets_distribution(pair, method):
    k, _, settings = SAMPLING_CASES["all knobs"]
    target, draft = pair
    prompt = [1, 2, 3, 1, 2, 1]     # repeats: the lookup has something to propose
    config = SpeculativeConfig(num_speculative_tokens=3, method=method,
                               model=None if method == "ngram" else "-")
    samples, counters = served_samples(target, prompt, k, settings, config,
                                       draft if method == "draft_model" else None)
    assert counters.draft_tokens > counters.accepted_tokens > 0
    # fixed seeds: the p-value is one deterministic number, not a coin flip per run
    assert goodness_of_fit(samples, exact_joint(target, prompt, k, settings)) > 1e-3


def test_a_wrong_acceptance_rule_fails_the_served_test(pair, monkeypatch):
    """Always accepting the draft's token: the served samples fail the same test. (k = 3:
    the first token comes from the prefill, never drafted; the others are.)"""
    _, _, settings = SAMPLING_CASES["bonus path"]
    target, draft, k = *pair, 3
    config = SpeculativeConfig(num_speculative_tokens=1, method="draft_model", model="-")
    joint = exact_joint(target, [1, 2, 3], k, settings)
    right, _ = served_samples(target, [1, 2, 3], k, settings, config, draft)
    assert goodness_of_fit(right, joint) > 1e-3
    monkeypatch.setattr(speculative, "leviathan_step", accept_always)
    wrong, _ = served_samples(target, [1, 2, 3], k, settings, config, draft)
    assert goodness_of_fit(wrong, joint) < 1e-6


def test_a_seeded_sample_is_the_same_alone_batched_and_again(close_calls):
    """Batch-invariant mode: a sampled request's draws come from its own generator, its
    drafts from its own tokens, its logits are its own bits: the same tokens alone, beside
    others, and on a second run."""
    settings = SamplingSettings(do_sample=True, temperature=0.8, top_p=0.9)
    requests = [Request(r.prompt, 20, sampling=settings, seed=i, eos_token_id=[])
                for i, r in enumerate(workload())]

    def serve(batch, slots):
        served = engine(close_calls, NGRAM, max_num_seqs=slots, batch_invariant=True)
        return [r.tokens for r in served.run(batch).results]
    together = serve(requests, 4)
    assert together == serve(requests, 4)
    assert [serve([r], 1)[0] for r in requests[:3]] == together[:3]


# ---------------------------------------------------------------------------- served
def test_a_stream_gets_the_tokens_of_each_verification_together_and_metrics_count_them(
        close_calls):
    """Through the online engine: a step that kept several tokens hands them over in one
    update, as they are verified; the updates add up to the request's tokens; the snapshot
    carries the counters /metrics shows under vLLM's names."""
    import queue

    from minitransformer.serve.online import OnlineEngine
    from minitransformer.serve.prometheus import ServingMetrics
    request = workload()[0]
    online = OnlineEngine(engine(close_calls, NGRAM, max_num_seqs=2, batch_invariant=True))
    try:
        updates = queue.Queue()
        online.submit(request, updates.put)
        got = [updates.get(timeout=60)]
        while not got[-1].done:
            got.append(updates.get(timeout=60))
    finally:
        online.close()
    tokens = [t for u in got for t in u.tokens]
    assert tokens == mt.generate(close_calls, list(request.prompt), request.max_new_tokens,
                                 eos_token_id=[])
    assert max(len(u.tokens) for u in got) > 1 and len(got) < len(tokens)
    counters = online.snapshot.speculative
    assert counters is not online.engine.speculator.counters      # a copy, for /metrics
    assert counters.accepted_tokens == online.engine.speculator.counters.accepted_tokens > 0
    text = ServingMetrics("m").render(online.snapshot)
    assert f'vllm:spec_decode_num_accepted_tokens_total{{model_name="m"}} ' \
           f'{counters.accepted_tokens}' in text


def test_the_engine_config_takes_a_parsed_speculative_config_only():
    with pytest.raises(ValueError, match="speculative_config=.*expected a SpeculativeConfig"):
        EngineConfig(speculative_config={"num_speculative_tokens": 2})
    assert EngineConfig(speculative_config=NGRAM).speculative_config is NGRAM


# ---------------------------------------------------------------------------- the benchmark
def test_the_benchmark_runs_both_workloads_side_by_side(run_script):
    out, _ = run_script("bench_spec_serving", "--model", "default", "--batches", "1,2",
                        "--new-tokens", "6", "--repeat", "1")
    rows = [line.split() for line in out.splitlines() if line.startswith(("rewrite", "free"))]
    assert [(r[0], r[1], r[-1]) for r in rows if r[1].isdigit()] == [
        ("rewrite", "1", "1/1"), ("rewrite", "2", "2/2"), ("free", "1", "1/1"),
        ("free", "2", "2/2")]
    assert "rewrite: " in out and " at 1 stream(s)" in out


def test_no_speedup_is_claimed_where_the_tokens_differ():
    from bench_spec_serving import Sides, crossover, summary
    slower = Sides(plain=[1.0], spec=[2.0], same=1)           # 0.5x, same tokens
    differs = Sides(plain=[1.0], spec=[2.0], same=1)          # 0.5x, one stream of 2 differs
    faster = Sides(plain=[2.0], spec=[1.0], same=1)
    assert crossover({1: faster, 2: differs, 4: Sides([1.0], [2.0], same=4)}) == 4
    assert crossover({1: slower}) == 1 and crossover({1: faster}) is None
    assert "tokens differ" in summary("rewrite", {2: differs})
    assert summary("rewrite", {1: faster, 2: faster}) == \
        "rewrite: 2.00x at 1 stream(s); not below 1 up to 2 streams"


def test_exp22_prints_the_served_crossover_beside_the_formulas(run_script):
    out, _ = run_script("exp22_speculative", "--model", "default", "--new-tokens", 8,
                        "--repeats", 1, "--max-gamma", 2, "--schemes", "int8-row",
                        "--no-layers-draft", "--distilled", "none", "--serving-batches", "1,2")
    served = out[out.index("Experiment 22 (served)"):]
    assert "crossover (speedup below 1): predicted" in served and "; measured" in served
    assert [line.split()[0] for line in served.splitlines()
            if line.split()[-1:] in (["1/1"], ["2/2"])] == ["1", "2"]


def test_a_draft_model_named_only_by_its_path_is_loaded_and_changes_no_token(tiny_model):
    """speculative_config names the draft by its checkpoint's path and no draft is passed:
    the engine loads it, and batch-invariant greedy tokens are those of no speculation."""
    from minitransformer.serve.config import SpeculativeConfig
    spec = SpeculativeConfig(num_speculative_tokens=2, method="draft_model",
                             model=tiny_model.path)
    requests = [Request((1, 2, 3), 6, eos_token_id=[]), Request((4, 5), 5, eos_token_id=[])]
    plain = Engine(tiny_model, EngineConfig(max_num_seqs=2, batch_invariant=True)).run(requests)
    run = Engine(tiny_model, EngineConfig(max_num_seqs=2, batch_invariant=True,
                                          speculative_config=spec)).run(requests)
    assert [r.tokens for r in run.results] == [r.tokens for r in plain.results]


def test_speculating_with_prefix_caching_off_names_no_block(tiny_model):
    from minitransformer.serve.config import SpeculativeConfig
    spec = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=2)
    engine = Engine(tiny_model, EngineConfig(max_num_seqs=2, block_size=2,
                                             enable_prefix_caching=False,
                                             speculative_config=spec))
    named = []
    engine.run([Request((1, 2, 1, 2, 1, 2), 8, eos_token_id=[]),
                Request((3, 4, 3, 4), 8, eos_token_id=[])],
               on_step=lambda e: named.append(len(e.cache.books.index.name_of)))
    assert len(named) > 2 and set(named) == {0}
