"""What a run hands back besides the tokens, and the records it keeps: on_step's argument,
the records forgotten once the run is over, releasing a record (what it forgets, the refusal
of one not over, in its words), the policy it names, and under a stopped clock a run of zero
seconds with its prefill, decode and verification timings. Found by mutation testing of
serve/engine.py (docs/testing.md); the other tests found so sit in their promises' files."""
from types import SimpleNamespace

import pytest

from minitransformer.serve import engine as engine_module
from minitransformer.serve.config import EngineConfig
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
    from minitransformer.serve.config import SpeculativeConfig
    monkeypatch.setattr(engine_module, "time", SimpleNamespace(perf_counter=lambda: 1000.0))
    spec = SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_max=2)
    run = Engine(tiny_model, EngineConfig(max_num_seqs=2, speculative_config=spec),
                 history=True).run([Request((1, 2, 1, 2), 4, eos_token_id=[])])
    assert run.elapsed == 0.0 and run.decode_times
    assert {seconds for _, seconds in run.decode_times} == {0.0}


