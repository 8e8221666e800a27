"""A draft model drafts for the whole batch at once (serve/drafting.py): ONE draft pass per
draft position whatever the number of sequences, over a paged pool of its own; in
batch-invariant mode each sequence's proposals are those it gets drafting alone; the pool's
blocks go back when a sequence is trimmed, finished or cancelled."""
import numpy as np
import pytest

import minitransformer as mt
import minitransformer.serve.runner as runner_module
from minitransformer.checkpoints.synth import qwen2_config, random_model
from minitransformer.sampling import GREEDY, SamplingSettings
from minitransformer.serve.config import EngineConfig, SpeculativeConfig
from minitransformer.serve.drafting import Ask, DraftModel
from minitransformer.serve.engine import Engine
from minitransformer.serve.records import Request
from minitransformer.speculative import ModelDraft, first_layers

PROMPTS = {"a": [1, 2, 3, 4, 5, 6, 7], "b": [9, 8], "c": [4, 4, 5, 1, 2]}
ROUNDS = [{"a": 3, "b": 1, "c": 2}, {"a": 0, "b": 4, "c": 2}, {"a": 2, "b": 2, "c": 3}]


@pytest.fixture(scope="module")
def draft():
    return first_layers(random_model(qwen2_config(num_hidden_layers=2)), 1)


def rounds(draft_model, ids, settings=GREEDY, batch_invariant=True):
    """ROUNDS of proposals for the sequences ids, all proposing in one call per round, each
    keeping its first proposal and one token of its own (a rollback, as a verification
    would) -> every round's proposals and q by sequence, the draft, the tokens."""
    model = DraftModel(draft_model, 32, 4, batch_invariant)
    tokens = {s: list(PROMPTS[s]) for s in ids}
    rngs = {s: np.random.default_rng(list(PROMPTS).index(s)) for s in ids}
    made = []
    for wanted in ROUNDS:
        asks = [Ask(s, tokens[s], wanted[s], settings, rngs[s]) for s in ids]
        out = dict(zip(ids, model.propose(asks), strict=True))
        made.append(out)
        for s, (proposal, _) in out.items():
            tokens[s] += proposal[:1] + [(len(tokens[s]) * 7) % 97]
            model.rollback(s, len(tokens[s]) - 1)
    return made, model, tokens


@pytest.mark.parametrize("settings", [GREEDY, SamplingSettings(do_sample=True, temperature=0.8, top_k=20)],
                         ids=["greedy", "sampled"])
def test_batch_invariant_proposals_are_each_sequence_drafting_alone(draft, settings):
    together, _, _ = rounds(draft, list(PROMPTS), settings)
    for s in PROMPTS:
        alone, _, _ = rounds(draft, [s], settings)
        for batch_round, own in zip(together, alone, strict=True):
            (tokens, q), (own_tokens, own_q) = batch_round[s], own[s]
            assert tokens == own_tokens
            assert all(x is None and y is None or (x == y).all()
                       for x, y in zip(q, own_q, strict=True))
    assert [len(r[s][0]) for r in together for s in PROMPTS] == \
        [w[s] for w in ROUNDS for s in PROMPTS]


def test_batch_invariant_proposals_are_the_librarys_one_sequence_drafts(checkpoint_dir):
    """Against an independent reference: speculative.ModelDraft, the library's draft of one
    sequence on a contiguous cache of its own, fed the same tokens and rolled back alike."""
    target = mt.load(checkpoint_dir("qwen2-close-calls"))
    together, _, _ = rounds(first_layers(target, 1), list(PROMPTS))
    for s, prompt in PROMPTS.items():
        alone, tokens = ModelDraft(first_layers(target, 1), target, np.array(prompt), 40), \
            list(prompt)
        for wanted, batch_round in zip(ROUNDS, together, strict=True):
            proposal, _ = alone.propose(tokens, wanted[s], GREEDY, None)
            assert proposal == batch_round[s][0]
            tokens += proposal[:1] + [(len(tokens) * 7) % 97]
            alone.rollback(len(tokens) - 1)
    assert len({t for r in together for tokens, _ in r.values() for t in tokens}) > 3


def test_the_default_batch_is_one_draft_pass_per_position(draft, monkeypatch):
    """Proposing 3, 1 and 2 tokens for three sequences: 3 forward passes of the draft, not 6
    (one per sequence and position); its first pass feeds every sequence's unseen tokens."""
    calls = []

    def counted(real):
        def call(model, ids, *rest):
            calls.append(ids.shape)
            return real(model, ids, *rest)
        return call
    monkeypatch.setattr(runner_module, "forward", counted(runner_module.forward))          # the first
    monkeypatch.setattr(runner_module, "last_logits", counted(runner_module.last_logits))  # the others
    made, model, _ = rounds(draft, list(PROMPTS), batch_invariant=False)
    per_round = [max(w.values()) for w in ROUNDS]
    assert len(calls) == model.passes == sum(per_round) == 3 + 4 + 3
    assert calls[0] == (1, sum(map(len, PROMPTS.values())))    # the prompts, one ragged row
    assert calls[1:3] == [(2, 1), (1, 1)]                      # then the rows still drafting


def test_the_draft_pool_holds_only_kept_tokens_and_gives_every_block_back(draft):
    made, model, tokens = rounds(draft, list(PROMPTS))
    pool = model.pool
    assert set(pool.books.seqs) == set(PROMPTS)
    for s in PROMPTS:       # its tokens but the last, none of the rejected proposals
        assert pool.books.seqs[s].length == len(tokens[s]) - 1
    for s in PROMPTS:
        model.forget(s)
    pool.books.check()
    assert pool.books.num_free == pool.books.num_blocks and not pool.books.seqs


def test_a_full_draft_pool_cuts_the_drafts_it_cannot_hold(draft):
    """A pool of 2 blocks of 4: "a" (7 tokens) fits 2 proposals, "b" behind it none; nothing
    raises."""
    model = DraftModel(draft, 2, 4)
    out = model.propose([Ask("a", PROMPTS["a"], 4, GREEDY, None),
                         Ask("b", PROMPTS["b"], 4, GREEDY, None)])
    assert [len(tokens) for tokens, _ in out] == [2, 0]
    assert set(model.pool.books.seqs) == {"a"} and model.pool.books.num_free == 0


@pytest.mark.parametrize("end", ["finish", "cancel"])
def test_the_engine_gives_the_drafts_blocks_back(draft, end):
    target = random_model(qwen2_config(num_hidden_layers=2))
    spec = SpeculativeConfig(num_speculative_tokens=3, method="draft_model", model="-")
    engine = Engine(target, EngineConfig(max_num_seqs=3, num_gpu_blocks_override=32,
                                         block_size=4, speculative_config=spec),
                    draft_model=first_layers(target, 1))
    pool = engine.speculator.proposer.draft.pool
    ids = [engine.submit(Request(tuple(p), 12, eos_token_id=[])) for p in PROMPTS.values()]
    for _ in range(3):
        engine.step()
    assert pool.books.num_free < pool.books.num_blocks and engine.speculator.proposer.holding()
    if end == "cancel":
        for i in ids:
            engine.cancel(i)
    while engine.running() or engine.waiting:
        engine.step()
    pool.books.check()
    assert pool.books.num_free == pool.books.num_blocks
    assert not engine.speculator.proposer.holding()


def test_the_ragged_first_pass_gives_each_row_its_own_logits(draft):
    """Rows feeding as many tokens are one group (a and c: 7 each, b: 2), so the pass's row
    order is not the asks'; each row's logits are still its own (as alone, up to rounding)."""
    prompts = {"a": PROMPTS["a"], "b": PROMPTS["b"], "c": [3, 1, 4, 1, 5, 9, 2]}
    together = DraftModel(draft, 32, 4)._first([Ask(s, p, 1, GREEDY, None)
                                                 for s, p in prompts.items()])
    for row, (s, p) in zip(together, prompts.items(), strict=True):
        alone = DraftModel(draft, 32, 4)._first([Ask(s, p, 1, GREEDY, None)])[0]
        np.testing.assert_allclose(row, alone, rtol=0, atol=1e-5 * np.abs(alone).max())
