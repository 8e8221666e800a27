"""What a run hands back besides the tokens, and the records it keeps: on_step's argument,
the records forgotten once the run is over, releasing a record (what it forgets, the refusal
of one not over, in its words), the policy it names, and under a stopped clock a run of zero
seconds with its prefill, decode and verification timings. Found by mutation testing of
serve/engine.py (docs/testing.md); the other tests found so sit in their promises' files."""
from types import SimpleNamespace

import pytest

import minitransformer as mt
from minitransformer.serve import engine as engine_module
from minitransformer.serve.config import EngineConfig, SpeculativeConfig
from minitransformer.serve.engine import Engine
from minitransformer.serve.records import Request


def test_run_passes_the_engine_to_on_step_and_forgets_its_records_after(tiny_model):
    engine = Engine(tiny_model, EngineConfig(max_num_seqs=2))
    seen = []
    run = engine.run([Request((1, 2), 2, eos_token_id=[])], on_step=seen.append)
    assert seen == [engine] * run.steps and run.steps == 2
    assert engine.results == {}                   # released: no history kept


def test_a_stopped_clock_gives_a_run_of_zero_seconds_with_its_prefill_timings(tiny_model,
                                                                              monkeypatch):
    """Every step lasting 0 s (perf_counter frozen at 1000): the clock, each first token and
    every timing stay 0, and the history holds one prefill of each prompt's 3 tokens."""
    monkeypatch.setattr(engine_module, "time", SimpleNamespace(perf_counter=lambda: 1000.0))
    run = Engine(tiny_model, EngineConfig(max_num_seqs=2), history=True).run(
        [Request((1, 2, 3), 2, eos_token_id=[]), Request((4, 5, 6), 2, eos_token_id=[])])
    assert run.elapsed == 0.0 and [r.first_token for r in run.results] == [0.0, 0.0]
    assert run.prefill_times == ((3, 0.0), (3, 0.0))   # both prompts in the one pass
    assert run.decode_times == ((2, 0.0),)


def test_a_stopped_clock_times_each_batch_invariant_pass_at_zero(tiny_model, monkeypatch):
    monkeypatch.setattr(engine_module, "time", SimpleNamespace(perf_counter=lambda: 1000.0))
    run = Engine(tiny_model, EngineConfig(max_num_seqs=2, batch_invariant=True),
                 history=True).run([Request((1, 2, 3), 2, eos_token_id=[]),
                                    Request((4, 5), 2, eos_token_id=[])])
    assert run.elapsed == 0.0 and [r.first_token for r in run.results] == [0.0, 0.0]
    assert run.prefill_times == ((3, 0.0), (2, 0.0)) and run.decode_times == ((2, 0.0),)


def test_releasing_a_record_forgets_it_and_one_not_over_is_refused_in_words(tiny_model):
    engine = Engine(tiny_model, EngineConfig(max_num_seqs=2))
    first = engine.submit(Request((1, 2), 1, eos_token_id=[]))
    engine.step()
    waiting = engine.submit(Request((3, 4), 3, eos_token_id=[]))
    with pytest.raises(ValueError, match=r"^request 1 is not over \(waiting\)$"):
        engine.release(waiting)
    engine.release(first)
    assert list(engine.results) == [waiting]
    engine.release(first)                          # twice, or an unknown id: nothing to do
    engine.release(99)
    assert list(engine.results) == [waiting]


def test_the_run_names_its_policy(tiny_model):
    for policy in ("continuous", "static"):
        run = Engine(tiny_model, EngineConfig(max_num_seqs=2, policy=policy)).run(
            [Request((1, 2), 1, eos_token_id=[])])
        assert run.policy == policy


def test_a_stopped_clock_times_each_verification_at_zero(tiny_model, monkeypatch):
    monkeypatch.setattr(engine_module, "time", SimpleNamespace(perf_counter=lambda: 1000.0))
    spec = SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_max=2)
    run = Engine(tiny_model, EngineConfig(max_num_seqs=2, speculative_config=spec),
                 history=True).run([Request((1, 2, 1, 2), 4, eos_token_id=[])])
    assert run.elapsed == 0.0 and run.decode_times
    assert {seconds for _, seconds in run.decode_times} == {0.0}




def test_each_record_is_stamped_with_the_clock_of_the_step_that_made_it(tiny_model):
    """A first token's time and an end's (returned then too, continuous) are the engine's
    clock as the step that made them reports it: the step's clock stops before its commit
    stamps them."""
    clocks, seen = [], []

    def on_step(engine):
        clocks.append(engine.clock)
        seen.append({r.id: (len(r.tokens), r.status) for r in engine.results.values()})
    engine = Engine(tiny_model, EngineConfig(max_num_seqs=2), history=True)
    run = engine.run([Request((1, 2, 3), n, eos_token_id=[]) for n in (1, 3, 2)], on_step)
    for r in run.results:
        first = next(i for i, step in enumerate(seen) if step[r.id][0] == 1)
        last = next(i for i, step in enumerate(seen) if step[r.id][1] == "finished")
        assert r.first_token == clocks[first] and r.ended == r.returned == clocks[last]
    assert run.elapsed == clocks[-1] == engine.clock


def test_the_memory_history_reads_each_steps_books_as_its_commit_left_them(checkpoint_dir):
    """Speculating, with drafts rejected: each step's entry holds the sequence at the tokens
    it kept, all but its last (no draft slot past them: the commit trimmed them back first),
    and the step that made its last token still holds it (it retires after the entry)."""
    model = mt.load(checkpoint_dir("qwen2-close-calls"))   # its next token is not its last
    spec = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=3)
    engine = Engine(model, EngineConfig(max_num_seqs=2, speculative_config=spec), history=True)
    prompt, made = (332, 467, 257, 310, 497), []    # its 10th token: a draft of 4, 3 rejected
    run = engine.run([Request(prompt, 16, eos_token_id=[])],
                     on_step=lambda e: made.append(len(e.results[0].tokens)))
    counters = engine.speculator.counters
    assert counters.draft_tokens > counters.accepted_tokens   # some draft slots went back
    assert [(m.sequences, m.tokens_logical) for m in run.memory] == \
        [(1, len(prompt) + k - 1) for k in made]
