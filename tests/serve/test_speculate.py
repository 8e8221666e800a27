"""Speculation's parts in the server (serve/speculate.py), each on its own: the config under
vLLM's names and its errors, the draft-length rule, the verification rows (one pass over the
paged cache giving each position a decode's bits), the step's books and blocks, the counters."""
import json

import numpy as np
import pytest

import minitransformer as mt
from conftest import NEAR_TIE
from minitransformer.backend import to_numpy
from minitransformer.checkpoints.synth import qwen2_config, random_model
from minitransformer.generate import last_logits, last_logits_alone
from minitransformer.lookup import lookup_past_insertion, prompt_lookup
from minitransformer.model import forward
from minitransformer.sampling import GREEDY
from minitransformer.serve.config import FIELDS, SpeculativeConfig, parse_speculative_config
from minitransformer.serve.drafting import Ask, draft_length
from minitransformer.serve.paged import PagedCache
from minitransformer.serve.records import Request, Result
from minitransformer.serve.runner import Runner, split_rows
from minitransformer.serve.scheduler import Sequence, hold_drafts
from minitransformer.serve.speculate import SpecCounters, Speculator
from minitransformer.speculative import first_layers


# ---------------------------------------------------------------------------- the config
def test_vllms_example_config_is_read_field_by_field():
    text = ('{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, '
            '"prompt_lookup_min": 2}')
    assert parse_speculative_config(text) == SpeculativeConfig(
        num_speculative_tokens=5, method="ngram", prompt_lookup_max=4, prompt_lookup_min=2)
    # a model alone means a draft model, as vLLM infers it
    assert parse_speculative_config({"model": "/m", "num_speculative_tokens": 3}).method == \
        "draft_model"
    assert parse_speculative_config({"num_speculative_tokens": 2}).method == "ngram"


BAD_CONFIGS = [  # (value, what the message must name)
    ("{", "not JSON"),
    ("[1]", "JSON object"),
    ('{"num_speculative_tokens": 2, "num_speculative_tokens": 3}', "given twice"),
    ({"num_speculative_tokens": 2, "gamma": 3}, "'gamma'"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "method 'eagle'"),
    ({"method": "ngram"}, "num_speculative_tokens is required"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens must be an integer >= 1"),
    ({"num_speculative_tokens": None}, "num_speculative_tokens must be an integer >= 1, got None"),
    ('{"num_speculative_tokens": null}', "num_speculative_tokens must be an integer >= 1"),
    ({"num_speculative_tokens": [3]}, "num_speculative_tokens must be an integer"),
    ({"num_speculative_tokens": True}, "num_speculative_tokens must be an integer"),
    ({"num_speculative_tokens": 2.0}, "num_speculative_tokens must be an integer"),
    ({"num_speculative_tokens": "5"}, "num_speculative_tokens must be an integer"),
    ({"num_speculative_tokens": 2, "prompt_lookup_max": 0}, "prompt_lookup_max must be"),
    ({"num_speculative_tokens": 2, "prompt_lookup_min": -1}, "prompt_lookup_min must be"),
    ({"num_speculative_tokens": 2, "prompt_lookup_max": 2, "prompt_lookup_min": 3},
     "prompt_lookup_min (3) is more than prompt_lookup_max (2)"),
    ({"num_speculative_tokens": 2, "disable_by_batch_size": 0}, "disable_by_batch_size"),
    ({"num_speculative_tokens": 2, "weight_rows": float("nan")}, "weight_rows"),
    ({"num_speculative_tokens": 2, "weight_rows": -1}, "weight_rows"),
    ({"num_speculative_tokens": 2, "weight_rows": "16"}, "weight_rows"),
    ({"num_speculative_tokens": 2, "min_acceptance": 0}, "min_acceptance"),
    ({"num_speculative_tokens": 2, "min_acceptance": 1.5}, "min_acceptance"),
    ({"num_speculative_tokens": 2, "min_acceptance": float("nan")}, "min_acceptance"),
    ({"num_speculative_tokens": 2, "min_acceptance": "0.5"}, "min_acceptance"),
    ({"method": "ngram", "model": "/m", "num_speculative_tokens": 2}, "is for method"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "needs model"),
    ({"method": "draft_model", "model": 3, "num_speculative_tokens": 2}, "needs model"),
]


@pytest.mark.parametrize("value, named", BAD_CONFIGS, ids=[m for _, m in BAD_CONFIGS])
def test_a_bad_config_is_a_value_error_naming_the_field(value, named):
    with pytest.raises(ValueError) as e:
        parse_speculative_config(value)
    assert named in str(e.value) and str(e.value).startswith("speculative config: ")


def test_a_null_optional_field_is_its_default():
    """vLLM's reading: null is the field left out (it once reached the dataclass, and
    prompt_lookup_min > None was a TypeError)."""
    nulls = {name: None for name in FIELDS if name not in ("num_speculative_tokens", "model")}
    assert parse_speculative_config(json.dumps({"num_speculative_tokens": 2} | nulls)) == \
        SpeculativeConfig(num_speculative_tokens=2)
    assert parse_speculative_config({"num_speculative_tokens": 2, "model": "/m",
                                     "method": None}).method == "draft_model"


def test_every_field_has_a_home_in_the_dataclass():
    assert set(FIELDS) == set(SpeculativeConfig.__dataclass_fields__)
    assert parse_speculative_config(json.dumps({"num_speculative_tokens": 1})) == \
        SpeculativeConfig(num_speculative_tokens=1)


# ---------------------------------------------------------------------------- the length rule
def best_by_hand(alpha, batch, top, W, c):
    """The rule written out: tokens per round over its cost in plain steps, 0..top."""
    def ratio(n):
        tokens = sum(alpha ** k for k in range(n + 1))
        return tokens / (n * c + (W + batch * (n + 1)) / (W + batch))
    return max(range(top + 1), key=ratio)


def test_adaptive_length_is_the_formulas_best_and_shrinks_with_batch_and_rejections():
    config = SpeculativeConfig(num_speculative_tokens=6, weight_rows=12)
    for c in (0.0, 0.1):
        for alpha in (0.2, 0.5, 0.7, 0.9, 0.99):
            lengths = [draft_length(config, alpha, b, c) for b in (1, 2, 4, 8, 16, 32)]
            assert lengths == [best_by_hand(alpha, b, 6, 12, c) for b in (1, 2, 4, 8, 16, 32)]
            assert lengths == sorted(lengths, reverse=True)     # the batch grows: no longer
        by_alpha = [draft_length(config, a, 4, c) for a in (0.99, 0.9, 0.7, 0.5, 0.2)]
        assert by_alpha == sorted(by_alpha, reverse=True)       # acceptance falls: no longer
    assert draft_length(config, 0.99, 1) == 6 and draft_length(config, 0.9, 1000) == 0


def test_fixed_length_is_vllms_and_disable_by_batch_size_turns_it_off():
    fixed = SpeculativeConfig(num_speculative_tokens=4, disable_by_batch_size=3)
    assert [draft_length(fixed, 0.01, b) for b in (1, 3, 4, 100)] == [4, 4, 0, 0]


def test_min_acceptance_drafts_nothing_below_it_whatever_the_other_rule_says():
    for weight_rows in (None, 1e6):     # fixed length; the formula with verifying all but free
        config = SpeculativeConfig(num_speculative_tokens=4, weight_rows=weight_rows,
                                   min_acceptance=0.6)
        assert [draft_length(config, a, 1) for a in (0.59, 0.6, 0.95)] == [0, 4, 4]


# ---------------------------------------------------------------------------- verification rows
@pytest.fixture(scope="module")
def model():
    return random_model(qwen2_config())


PROMPTS = {"a": [1, 2, 3, 4, 5, 6], "b": [7, 8, 9]}


def prefilled(model, num_blocks=32, block_size=4) -> PagedCache:
    """Both prompts in a pool, all but their last token computed (as the engine holds them)."""
    cache = PagedCache.allocate(model.config, num_blocks, block_size)
    for seq_id, prompt in PROMPTS.items():
        cache.books.add(seq_id, prompt)
        forward(model, np.array([prompt[:-1]]), cache.view([seq_id]))
    return cache


@pytest.mark.parametrize("batch_invariant", [True, False])
def test_one_pass_gives_every_position_a_decode_steps_logits(model, batch_invariant):
    """Sequence a feeds 3 tokens, b 2, in one pass; the same tokens decoded step by step (the
    engine's decode: a batch of both, then a alone) give the same logits, bit for bit in
    batch-invariant mode, within the float32 rounding of other shapes otherwise."""
    fed = {"a": [6, 11, 12], "b": [9, 13]}
    cache = prefilled(model)
    starts = cache.books.append(["a"], 3) + cache.books.append(["b"], 2)   # as a plan counts them
    z = Runner(model, cache, batch_invariant).decode(["a", "b"], starts, [fed["a"], fed["b"]])
    assert z.shape == (5, model.config.vocab_size)
    assert (cache.books.seqs["a"].length, cache.books.seqs["b"].length) == (8, 4)
    step = prefilled(model)
    rows = {"a": [], "b": []}
    for t, ids in enumerate([["a", "b"], ["a", "b"], ["a"]]):
        step.books.make_room(ids, 1)
        decode = last_logits_alone if batch_invariant else last_logits   # the engine's
        logits = decode(model, np.array([[fed[s][t]] for s in ids]), step.view(ids))
        for s, row in zip(ids, logits, strict=True):
            rows[s].append(row)
    reference = np.array(rows["a"] + rows["b"])
    if batch_invariant:
        assert (z == reference).all()
        # the keys and values written are a decode's too: both caches continue alike
        for c in (cache, step):
            c.books.make_room(["a", "b"], 1)
        assert (last_logits_alone(model, np.array([[3], [4]]), cache.view(["a", "b"])) ==
                last_logits_alone(model, np.array([[3], [4]]), step.view(["a", "b"]))).all()
    else:   # other shapes, other last bits: within the measured rounding window (conftest)
        scale = np.abs(reference).max()
        np.testing.assert_allclose(z, reference, atol=NEAR_TIE * scale, rtol=0)


def test_a_step_without_drafts_is_a_plain_decode_bit_for_bit(model):
    """No sequence drafts (free generation under the bar, most steps): the verification is
    the engine's decode call, the very bits of a step without speculation, in the default
    mode too (a ragged pass of the same rows would be shaped otherwise)."""
    cache, plain = prefilled(model), prefilled(model)
    held = cache.books.append(["a", "b"], 1)
    starts = plain.books.append(["a", "b"], 1)
    z = Runner(model, cache).decode(["a", "b"], held, [[6], [9]])
    assert (z == last_logits(model, np.array([[6], [9]]), plain.view(["a", "b"], starts))).all()


# ---------------------------------------------------------------------------- the step's books
def rows_of(tokens: dict, prompt_len: dict, settings=GREEDY, max_new=40):
    """Decoding Sequences, as the engine hands them to speculation: sequence s holds
    tokens[s], the first prompt_len[s] its prompt."""
    return [Sequence(Result(s, 0.0, Request(tuple(tokens[s][:prompt_len[s]]), max_new,
                                            sampling=settings),
                            tokens=tokens[s][prompt_len[s]:], status="running"),
                     tokens[s], np.random.default_rng(0)) for s in tokens]


def step(spec, cache, rows, batch_invariant=True, spare=None):
    """A step as the engine takes it: the plan holds each row's slot for its last token and
    its draft's (scheduler.hold_drafts: within the budget's spare tokens and the free list),
    the speculator proposes, ONE pass (Runner.decode), each row verified -> per row
    (kept tokens, the logits each was chosen from). The slots stay held until ``keep``."""
    ids = [row.result.id for row in rows]
    starts = cache.books.append(ids, 1)
    drafts = spec.propose(rows, hold_drafts(cache.books, ids, spec.wants(rows), spare))
    fed = [[row.tokens[-1]] + draft.tokens for row, draft in zip(rows, drafts, strict=True)]
    logits = Runner(spec.model, cache, batch_invariant).decode(ids, starts, fed)
    out = []
    for row, z, draft in zip(rows, split_rows(logits, map(len, fed)), drafts, strict=True):
        kept = [] if row.padding else spec.verify(row, z, draft)
        out.append((kept, z[:len(kept)]))
    return out


def keep(cache, seq_id, valid: int) -> None:
    """As the scheduler's commit keeps a step: the sequence holds its first `valid` tokens,
    its slots past them (rejected or unproposed drafts) go back."""
    cache.books.trim(seq_id, cache.books.seqs[seq_id].length - valid)


@pytest.fixture(scope="module")
def close_calls(checkpoint_dir):
    """A model whose greedy tokens are not its last one again: drafts are kept and rejected."""
    return mt.load(checkpoint_dir("qwen2-close-calls"))


def test_a_step_keeps_what_greedy_keeps_and_trims_the_rest_back_to_the_pool(close_calls):
    """Greedy over several steps with prompt lookup: the tokens are plain greedy's
    (batch-invariant), each keep leaves the cache holding all but the last token and no
    block past it (those of rejected positions are back in the pool), the books consistent."""
    model, new = close_calls, 20
    passage = np.random.default_rng(0).integers(0, 512, 12).tolist()
    prompts = {"a": passage * 2, "b": [1, 2, 3, 4, 5, 6]}
    spec = Speculator(SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=2), model)
    cache = PagedCache.allocate(model.config, 40, 2)
    for seq_id, prompt in prompts.items():
        cache.books.add(seq_id, prompt)
        forward(model, np.array([prompt[:-1]]), cache.view([seq_id]))
    tokens = {s: list(p) for s, p in prompts.items()}
    while any(len(tokens[s]) - len(prompts[s]) < new for s in tokens):
        live = {s: t for s, t in tokens.items() if len(t) - len(prompts[s]) < new}
        rows = rows_of(live, {s: len(prompts[s]) for s in live}, max_new=new)
        out = step(spec, cache, rows)
        for row, (kept, z) in zip(rows, out, strict=True):
            assert len(z) == len(kept) >= 1
            tokens[row.result.id] += kept
            keep(cache, row.result.id, len(tokens[row.result.id]) - 1)
            seq = cache.books.seqs[row.result.id]
            assert seq.length == len(tokens[row.result.id]) - 1
            assert len(seq.blocks) == cache.books.blocks_for(seq.length)   # nothing past it held
        cache.books.check()
    for s, p in prompts.items():
        assert tokens[s][len(p):] == mt.generate(model, p, new, eos_token_id=[])
    held = sum(len(seq.blocks) for seq in cache.books.seqs.values())
    assert cache.books.num_free == cache.books.num_blocks - held
    c = spec.counters
    assert c.draft_tokens > c.accepted_tokens > 0     # some kept, some trimmed


def test_named_and_shared_blocks_are_never_written_by_verification(model):
    """Two samples of one prompt share its blocks: a named full one and the partly filled
    last one. Both verify a draft reaching past it: the named block keeps its bits, the shared
    one is copied before a write (the view refuses any write into a shared or named block)."""
    cache = PagedCache.allocate(model.config, 16, 4)
    prompt = [1, 2, 3, 1, 2, 3]     # "2 3" seen before: the lookup proposes 1 2 3
    cache.books.add("a", prompt)
    forward(model, np.array([prompt[:-1]]), cache.view(["a"]))
    cache.books.seal("a", prompt)
    cache.books.fork("a", "b")
    named, = cache.books.index.name_of
    before = [to_numpy(k[named]) for k in cache.k + cache.v]
    spec = Speculator(SpeculativeConfig(num_speculative_tokens=3), model)
    rows = rows_of({"a": list(prompt), "b": list(prompt)}, {"a": 6, "b": 6})
    out = step(spec, cache, rows)
    assert spec.counters.draft_tokens == 6
    assert all((to_numpy(k[named]) == old).all()
               for k, old in zip(cache.k + cache.v, before, strict=True))
    assert cache.books.seqs["a"].blocks[1] != cache.books.seqs["b"].blocks[1]     # copied on write
    for row, (kept, _) in zip(rows, out, strict=True):
        keep(cache, row.result.id, len(prompt) + len(kept) - 1)
    cache.books.check()
    assert out[0][0] == out[1][0] == mt.generate(model, prompt, len(out[0][0]), eos_token_id=[])


def test_speculation_cuts_its_draft_to_the_free_blocks(model):
    """A pool with no free block: the draft is cut to the slots the sequence's blocks still
    have, nothing raises, nobody is preempted."""
    cache = PagedCache.allocate(model.config, 4, 2)
    prompt = [1, 2, 1, 2, 1]
    cache.books.add("a", prompt)
    forward(model, np.array([prompt[:-1]]), cache.view(["a"]))
    while cache.books.num_free:           # fill the pool with another holder's blocks
        cache.books.add(len(cache.books.seqs), [3])
    spec = Speculator(SpeculativeConfig(num_speculative_tokens=4), model)
    (kept, _), = step(spec, cache, rows_of({"a": prompt}, {"a": 5}), batch_invariant=False)
    # the next token's block has one slot more: one proposal fits, no block is taken
    assert spec.counters.draft_tokens == 1 and cache.books.num_free == 0
    assert kept == mt.generate(model, prompt, len(kept), eos_token_id=[])


OLD = [11, 12, 13, 14, 15, 16, 17, 18]      # a finished turn: two full blocks of 4, kept
A = [1, 2, 3, 1, 2, 3, 1, 2]                # decoding; its lookup proposes "3 1 2 3"


def test_a_draft_never_takes_a_kept_block_nor_one_a_pending_copy_reads(model):
    """A draft's room comes from the free list, never from the prefix cache's kept blocks
    (named, held by nobody, counted free by the admission): taking one would evict a cached
    turn, and a kept block that the same step's plan still copies from (a prompt cached in full
    copies its last block, to be written at its last token, after the verification pass) would
    have the draft's keys written into it before the copy reads it.

    The pool: OLD's two blocks kept; "a" holding two full blocks once its last token is
    counted; "new", OLD again, holding OLD's first block and copying its second (the copy
    pending, as a plan leaves it for the prefill after the verification); the free list
    emptied by other holders. The draft gets no room (its rows feed the last token alone):
    OLD's blocks stay named and found, and the copy reads OLD's keys, not a draft's."""
    cache = PagedCache.allocate(model.config, 8, 4)
    cache.books.add("old", OLD)
    forward(model, np.array([OLD]), cache.view(["old"]))
    cache.books.seal("old", OLD)
    kept = list(cache.books.seqs["old"].blocks)
    before = [to_numpy(pool[kept[1]]).copy() for pool in cache.k + cache.v]
    cache.books.free_seq("old")                                    # both blocks kept, unheld
    cache.books.add("a", A)
    forward(model, np.array([A[:-1]]), cache.view(["a"]))
    cache.books.add("new", OLD)                                    # cached in full: copy the last
    moves = cache.books.take_moves()                         # the plan's, done after the pass
    while cache.books.free:
        cache.books.add(("filler", len(cache.books.seqs)), [3])
    assert cache.books.num_free == 1                               # OLD's second block, kept
    spec = Speculator(SpeculativeConfig(num_speculative_tokens=4), model)
    (kept_tokens, _), = step(spec, cache, rows_of({"a": list(A)}, {"a": len(A)}))
    assert spec.counters.draft_tokens == 0 and spec.fed == [1]
    assert cache.books.index.evicted == 0
    assert len(cache.books.cached_prefix(OLD)[1]) == 2             # the turn is still found whole
    cache.do(moves)                                          # the plan's copy, after the pass
    copy = cache.books.seqs["new"].blocks[1]
    assert copy != kept[1]
    for pool, old in zip(cache.k + cache.v, before, strict=True):
        assert (to_numpy(pool[copy]) == old).all()
    cache.books.check()


def test_a_draft_model_drafts_with_its_own_cache(close_calls):
    """The target's first layer as the draft model, a paged pool of its own: greedy tokens
    still the target's, its rejected proposals rolled out of its cache."""
    model = close_calls
    config = SpeculativeConfig(num_speculative_tokens=3, method="draft_model", model="-")
    spec = Speculator(config, model, first_layers(model, 1))
    cache = prefilled(model)
    tokens = {s: list(p) for s, p in PROMPTS.items()}
    for _ in range(5):
        rows = rows_of(tokens, {s: len(PROMPTS[s]) for s in tokens}, max_new=30)
        for row, (kept, _) in zip(rows, step(spec, cache, rows), strict=True):
            tokens[row.result.id] += kept
            keep(cache, row.result.id, len(tokens[row.result.id]) - 1)
            # the draft's cache holds no rejected proposal: at most the kept tokens
            held = spec.proposer.draft.pool.books.seqs[row.result.id].length
            assert held <= len(tokens[row.result.id]) - 1
    for s, p in PROMPTS.items():
        made = tokens[s][len(p):]
        assert made == mt.generate(model, p, len(made), eos_token_id=[])
    c = spec.counters
    assert c.draft_tokens == 2 * 5 * 3 and 0 < c.accepted_tokens < c.draft_tokens
    assert 0.5 < spec.proposer.cost < 1         # one of two layers, and the embeddings
    pool = spec.proposer.draft.pool
    spec.forget("a")
    assert spec.proposer.holding() == {"b"}
    spec.forget("b")
    assert pool.books.num_free == pool.books.num_blocks and not spec.proposer.holding()


def test_ngram_proposals_are_the_lookup_over_prompt_and_output(model):
    """The server's lookup resumes a copy past a token put in (lookup_past_insertion): the
    last text copied 6 7, then put in 0, which prompt_lookup finds nowhere."""
    spec = Speculator(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=2), model)
    for tokens in ([5, 6, 7, 9, 5, 6], [1, 2, 3], [4, 4, 4, 4], [1, 2, 3, 1],  # 2-, no, 1-gram
                   [5, 6, 7, 8, 9, 2, 5, 6, 7, 0]):                          # 0 put in
        (drafts, dists), = spec.proposer.propose([Ask(0, tokens, 3, GREEDY, None)])
        assert drafts == lookup_past_insertion(tokens, 3, 2, 1)
        assert dists == [None] * len(drafts)
    assert drafts == [8, 9, 2] and prompt_lookup(tokens, 3, 2, 1) == []
    assert spec.proposer.shadow(tokens) == 8


# ---------------------------------------------------------------------------- the counters
def test_counters_count_drafts_tokens_and_acceptance_per_position():
    c = SpecCounters()
    for proposed, accepted in ((4, 4), (3, 1), (0, 0), (2, 0)):
        c.count(proposed, accepted)
    assert (c.drafts, c.draft_tokens, c.accepted_tokens) == (3, 9, 5)
    assert c.per_position == [2, 1, 1, 1]


def test_metrics_show_the_counters_under_vllms_names_only_when_speculating():
    from minitransformer.serve.online import Snapshot
    from minitransformer.serve.prometheus import ServingMetrics
    c = SpecCounters()
    c.count(3, 2)
    c.count(2, 0)
    metrics = ServingMetrics("m")
    text = metrics.render(Snapshot(1, 0, 2, 10, 0, speculative=c))
    for line in ('vllm:spec_decode_num_drafts_total{model_name="m"} 2',
                 'vllm:spec_decode_num_draft_tokens_total{model_name="m"} 5',
                 'vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 2',
                 'vllm:spec_decode_num_accepted_tokens_per_pos_total{position="0",'
                 'model_name="m"} 1',
                 'vllm:spec_decode_num_accepted_tokens_per_pos_total{position="1",'
                 'model_name="m"} 1',
                 'vllm:spec_decode_num_accepted_tokens_per_pos_total{position="2",'
                 'model_name="m"} 0'):
        assert line in text.splitlines()
    assert "spec_decode" not in metrics.render(Snapshot(1, 0, 2, 10, 0))


def test_the_batch_cost_model_fits_back_its_own_weight_rows_and_falls_with_the_batch():
    from sim.speculative import batch_verify_cost, batched_speedup, fit_weight_rows
    for W in (0.5, 3.0, 40.0):
        v = {n: batch_verify_cost(n, 1, W) for n in range(1, 8)}
        assert fit_weight_rows(v) == pytest.approx(W, rel=1e-12)
        speedups = [batched_speedup(3.5, 5, B, W) for B in (1, 2, 4, 8, 16, 32, 1024)]
        assert speedups == sorted(speedups, reverse=True) and speedups[-1] < 1
    assert fit_weight_rows({1: 1.0, 2: 1.0}) == float("inf")      # verifying for free
    assert batch_verify_cost(3, 5, 1e12) == pytest.approx(1.0)     # weights dominate: free


def test_below_min_acceptance_a_sequence_feeds_one_token_and_its_lookup_is_judged_for_free(
        model, monkeypatch):
    """A sequence whose drafts were rejected (books 0 of 4: acceptance 1/6) drafts nothing
    although its text repeats; the lookup's first proposal is judged against the token made,
    so its books grow without a draft; with books above the bar it drafts again."""
    prompt = [1, 2, 1, 2, 1]                        # the lookup proposes 2 1
    made = mt.generate(model, prompt, 1, eos_token_id=[])[0]
    spec = Speculator(SpeculativeConfig(num_speculative_tokens=3, min_acceptance=0.5), model)
    for shadow, hit in ((None, 0), (made, 1)):  # the lookup's own proposal, then the very token
        if shadow is not None:
            monkeypatch.setattr(spec.proposer, "shadow", lambda tokens: shadow)
        cache = prefilled_one(model, prompt)
        spec.judged["a"] = [0, 4]
        (kept, _), = step(spec, cache, rows_of({"a": list(prompt)}, {"a": 4}))
        assert spec.fed == [1] and spec.counters.drafts == 0 and kept == [made]
        assert prompt_lookup(prompt, 1) != [made]   # so the lookup's own proposal missed
        assert spec.judged["a"] == [hit, 5]
    cache = prefilled_one(model, prompt)
    spec.judged["a"] = [3, 4]                   # acceptance 4/6: above the bar
    step(spec, cache, rows_of({"a": list(prompt)}, {"a": 4}))
    assert spec.fed == [3] and spec.counters.drafts == 1   # its last token, then 2 1


def test_a_lookup_drafts_only_once_it_has_been_judged(model):
    """min_acceptance 0.5: before any evidence alpha is 1/2, which passes the bar; a lookup
    is judged for free, so its first decode step only judges (one row, never a rejected
    first draft of num_speculative_tokens rows), and it drafts from the next step on while
    its alpha stays above the bar. A draft model, whose proposals cost a pass, starts at once."""
    prompt = [1, 2, 1, 2, 1]                        # the lookup proposes 2 1
    spec = Speculator(SpeculativeConfig(num_speculative_tokens=3, min_acceptance=0.5), model)
    cache = prefilled_one(model, prompt)
    (kept, _), = step(spec, cache, rows_of({"a": list(prompt)}, {"a": 4}))
    assert spec.fed == [1] and spec.counters.drafts == 0 and spec.judged["a"][1] == 1
    spec.judged["a"] = [1, 1]                   # its lookup was right: alpha 2/3
    step(spec, cache, rows_of({"a": prompt + kept}, {"a": 4}))
    assert spec.fed[0] > 1 and spec.counters.drafts == 1
    assert draft_length(spec.config, 0.5, 1, cost=0.2, judged=0) == 3


def prefilled_one(model, prompt, num_blocks=16, block_size=4) -> PagedCache:
    """Sequence "a" in a pool, all but its prompt's last token computed."""
    cache = PagedCache.allocate(model.config, num_blocks, block_size)
    cache.books.add("a", prompt)
    forward(model, np.array([prompt[:-1]]), cache.view(["a"]))
    return cache


def test_the_drafts_take_no_more_than_the_budgets_spare_tokens(model):
    """spare: what max_num_batched_tokens leaves after the plan; the rows draft in order."""
    cache = prefilled(model)
    spec = Speculator(SpeculativeConfig(num_speculative_tokens=4), model)
    rows = rows_of({"a": PROMPTS["a"] + [1, 2], "b": PROMPTS["b"] + [7, 8]}, {"a": 6, "b": 3})
    step(spec, cache, rows, batch_invariant=False, spare=3)
    assert spec.fed == [4, 1]                   # a: 3 proposals (of 4), b: none left
