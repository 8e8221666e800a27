"""What the engine hands its user besides the tokens: the blocks a request may hold
(pool_need), the run's records (on_step's argument, the prefill timings, the clock of a stopped
clock's steps), releasing a record (what it forgets, the refusal of one not over, in its
words), each sample's choice number, a request's own eos ids and its repetition penalty, a
step's decodes and prompts in ONE forward pass, a static padding row beside a later chunk, the
attention asked for, the memory check in the pool's own format, speculation's draft loaded
by its path, no block named with caching off and its timings, and the words of two refusals
(a config of another type, an empty pool). Found by mutation testing of serve/engine.py
(docs/testing.md)."""
from types import SimpleNamespace

import numpy as np
import pytest

from minitransformer.generate import generate
from minitransformer.sampling import SamplingSettings
from minitransformer.serve import engine as engine_module
from minitransformer.serve.config import EngineConfig
from minitransformer.serve.engine import Engine
from minitransformer.serve.records import Request


@pytest.mark.parametrize("prompt, new, n, need", [
    (7, 1, 1, 2),    # 8 tokens: 2 blocks of 4
    (7, 1, 3, 4),    # the prompt's last block and its first token, then a copy per sample
    (8, 1, 3, 5),    # 9 tokens: 3 blocks, and each of the 2 other samples its own copy
    (3, 10, 2, 4),   # the longest sequence, 13 tokens, outweighs the copies
    (4, 1, 1, 2),    # the first new token opens a block of its own
])
def test_pool_need_is_the_longest_sequence_or_the_prompt_with_each_samples_copy(
        tiny_model, prompt, new, n, need):
    engine = Engine(tiny_model, EngineConfig(max_num_seqs=4, block_size=4, num_gpu_blocks_override=32))
    assert engine.pool_need(prompt, new, n) == need


def test_a_request_of_n_samples_is_refused_when_their_copies_do_not_fit(tiny_model):
    """7 prompt tokens, 3 samples, 1 new token each: 4 blocks of 4, one more than the pool's
    3, so every sample is rejected (one sample alone fits)."""
    config = EngineConfig(max_num_seqs=3, block_size=4, num_gpu_blocks_override=3)
    run = Engine(tiny_model, config).run([Request(tuple(range(1, 8)), 1, n=3,
                                                  eos_token_id=[])])
    assert [r.status for r in run.results] == ["rejected"] * 3
    assert run.results[0].reason == "needs up to 4 blocks of 4 tokens; the pool has 3"
    alone = Engine(tiny_model, config).run([Request(tuple(range(1, 8)), 1, eos_token_id=[])])
    assert alone.results[0].status == "finished"


def test_each_sample_records_which_choice_it_is(tiny_model):
    run = Engine(tiny_model, EngineConfig(max_num_seqs=3)).run(
        [Request((1, 2, 3), 2, n=3, seed=5, sampling=SamplingSettings(temperature=1.0),
                 eos_token_id=[])])
    assert [r.choice for r in run.results] == [0, 1, 2]


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


def test_a_requests_own_eos_ids_end_it(tiny_model):
    """Greedy tokens of a prompt without stopping, then the same request with its third token
    as its eos id: it ends there, that token included, as generate does."""
    free = Engine(tiny_model).run([Request((1, 2, 3), 6, eos_token_id=[])]).results[0].tokens
    eos = free[2]
    stop = next(i for i, t in enumerate(free) if t == eos)
    run = Engine(tiny_model).run([Request((1, 2, 3), 6, eos_token_id=[eos])])
    assert run.results[0].tokens == free[:stop + 1]


def test_a_repetition_penalty_is_applied_as_generate_applies_it(tiny_model):
    """A heavy penalty changes greedy tokens (checked), and the engine's are generate's."""
    s = SamplingSettings(repetition_penalty=50.0)
    plain = Engine(tiny_model).run([Request((1, 2, 1, 2), 8, eos_token_id=[])])
    run = Engine(tiny_model).run([Request((1, 2, 1, 2), 8, sampling=s, eos_token_id=[])])
    want = generate(tiny_model, np.array([1, 2, 1, 2]), 8, sampling=s, eos_token_id=[])
    assert run.results[0].tokens != plain.results[0].tokens
    assert run.results[0].tokens == [int(t) for t in want]


def test_an_empty_pool_refuses_the_first_request_in_words(tiny_model):
    """Submission rejects what the pool can never hold, so the scheduler stands in for a plan
    that admits nothing with nothing running: the step raises, saying so."""
    engine = Engine(tiny_model, EngineConfig(max_num_seqs=1, block_size=4, num_gpu_blocks_override=1))
    engine.submit(Request((1, 2), 1, eos_token_id=[]))
    engine.scheduler.schedule = lambda now, wants=None: SimpleNamespace(decode=None, prefill=[],
                                                                     moves=[])
    with pytest.raises(RuntimeError,
                       match="^nothing running and the first request cannot be admitted$"):
        engine.step()


def test_pool_need_counts_one_sample_by_default(tiny_model):
    engine = Engine(tiny_model, EngineConfig(max_num_seqs=4, block_size=4,
                                             num_gpu_blocks_override=32))
    assert engine.pool_need(8, 1) == 3 and engine.pool_need(7, 1) == 2


def test_the_run_names_its_policy(tiny_model):
    for policy in ("continuous", "static"):
        run = Engine(tiny_model, EngineConfig(max_num_seqs=2, policy=policy)).run(
            [Request((1, 2), 1, eos_token_id=[])])
        assert run.policy == policy


def count_passes(monkeypatch) -> list:
    """The engine's forward passes, a 1 for each: its own (prompts, mixed steps) and its
    decodes' (last_logits)."""
    calls = []
    for name in ("forward", "last_logits"):
        real = getattr(engine_module, name)
        monkeypatch.setattr(engine_module, name,
                            lambda *a, real=real, **k: calls.append(1) or real(*a, **k))
    return calls


@pytest.mark.parametrize("prompts", [[(3, 4, 5)], [(3, 4, 5), (6, 7)]])
def test_a_decode_and_new_prompts_share_one_forward_pass(tiny_model, monkeypatch, prompts):
    """A running request decodes while one or two new prompts prefill: the step is ONE
    forward pass over them all (the default mode), and every request gets its tokens."""
    calls = count_passes(monkeypatch)
    engine = Engine(tiny_model, EngineConfig(max_num_seqs=1 + len(prompts)))
    a = engine.submit(Request((1, 2), 3, eos_token_id=[]))
    engine.step()
    new = [engine.submit(Request(prompt, 2, eos_token_id=[])) for prompt in prompts]
    calls.clear()
    engine.step()
    assert calls == [1]
    assert [len(engine.results[i].tokens) for i in (a, *new)] == [2] + [1] * len(prompts)


def test_a_static_padding_row_beside_a_later_chunk_holds_its_length(tiny_model):
    """Static batching, a budget of 4: the short request finishes at its first token and
    stays as a padding row while the long prompt prefills in chunks beside it, in the same
    passes; the padding row never grows, and the pool is whole at the end."""
    engine = Engine(tiny_model, EngineConfig(max_num_seqs=2, policy="static",
                                             max_num_batched_tokens=4))
    short = engine.submit(Request((1, 2), 1, eos_token_id=[]))
    long = engine.submit(Request(tuple(range(3, 17)), 2, eos_token_id=[]))
    lengths = []
    while engine.waiting or engine.running():
        engine.step()
        if short in engine.cache.books.seqs:
            lengths.append(engine.cache.books.seqs[short].length)
        engine.cache.books.check()
    assert len(lengths) >= 3 and set(lengths) == {2}
    assert len(engine.results[short].tokens) == 1 and len(engine.results[long].tokens) == 2
    assert engine.cache.books.num_free == engine.cache.books.num_blocks


def test_the_engine_and_its_pool_attend_as_configured(tiny_model):
    """Tiled attention asked for: the engine says so and its paged pool computes with it."""
    engine = Engine(tiny_model, EngineConfig(attention="tiled"))
    assert engine.attention == "tiled" and engine.cache.attention == "tiled"


def test_a_config_of_another_type_is_refused_naming_its_type(tiny_model):
    with pytest.raises(TypeError, match="^config: expected an EngineConfig, got dict$"):
        Engine(tiny_model, {"max_num_seqs": 2})


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


def test_a_stopped_clock_times_each_verification_at_zero(tiny_model, monkeypatch):
    from minitransformer.serve.config import SpeculativeConfig
    monkeypatch.setattr(engine_module, "time", SimpleNamespace(perf_counter=lambda: 1000.0))
    spec = SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_max=2)
    run = Engine(tiny_model, EngineConfig(max_num_seqs=2, speculative_config=spec),
                 history=True).run([Request((1, 2, 1, 2), 4, eos_token_id=[])])
    assert run.elapsed == 0.0 and run.decode_times
    assert {seconds for _, seconds in run.decode_times} == {0.0}


def test_the_memory_check_prices_the_pool_in_its_own_format(tiny_model, monkeypatch):
    """A backend with exactly the bytes a q4_0 pool of 64 blocks x 16 tokens and 2 slots
    needs: the engine of that pool is made, the same pool in f32 is refused."""
    from minitransformer.serve import paged
    per_token = paged.cache_bytes_per_token(tiny_model.config, "q4_0")
    need = 64 * 16 * per_token + 8 * 2
    assert paged.cache_bytes_per_token(tiny_model.config, "f32") > per_token
    monkeypatch.setattr(paged, "memory_bytes", lambda: (need, "physical memory"))
    sizes = dict(max_num_seqs=2, num_gpu_blocks_override=64, block_size=16)
    Engine(tiny_model, EngineConfig(kv_cache_dtype="q4_0", **sizes))
    with pytest.raises(ValueError, match="more than the"):
        Engine(tiny_model, EngineConfig(**sizes))

