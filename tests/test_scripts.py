"""The experiment scripts not covered elsewhere run end to end on a tiny checkpoint.

These are smoke tests with teeth: each script must exit cleanly, and where its table carries an
exact figure (the chapter's budget and speculative formulas, identical tokens) the figure is
checked. Timings are printed by the scripts, never asserted here.
"""
import json

import pytest

import run_all


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A Qwen2 checkpoint with the project's real tokenizer, small enough for seconds."""
    from minitransformer.synth import make_checkpoint, qwen2_config, train_tokenizer
    tokenizer = train_tokenizer()
    config = qwen2_config(vocab_size=tokenizer.get_vocab_size(), max_position_embeddings=512,
                          eos_token_id=0)
    return str(make_checkpoint(tmp_path_factory.mktemp("tiny"), config, tokenizer=tokenizer))


def test_exp01_identical_tokens(tiny, run_script):
    out, _ = run_script("exp01_kv_cache", "--model", tiny, "--max-new-tokens", 12)
    assert "tokens identical: 12 of 12  -> identical output" in out


def test_formula_scripts_print_the_chapter_figures(tiny, run_script):
    out, _ = run_script("exp24_memory_budget")
    assert "337" in out and "65,378" in out and "3,136" in out and "13.0 GB" in out
    out, _ = run_script("exp22_speculative_formula")
    assert "-> 3.40x" in out and "-> 0.79x" in out
    out, _ = run_script("exp10_mha_gqa_mqa", "--chapter-model")
    assert "86,016 B/token" in out and "7.00x" in out
    out, _ = run_script("exp09_users_tokens", "--chapter-model")
    assert out.count("805,306,368") == 3
    out, _ = run_script("exp11_7b_context")
    assert "131,072 B/token" in out
    assert "MAC" in run_script("exp03_macs", "--model", tiny)[0]


def test_batching_scripts_run_and_feed_each_other(tiny, tmp_path, run_script):
    costs = tmp_path / "costs.json"
    run_script("exp12_batched_decode", "--model", tiny, "--batch-sizes", "1,2,4", "--context", 8,
               "--repeat", 2, "--save-step-costs", costs)
    assert set(json.loads(costs.read_text())) == {"1", "2", "4"}
    out, _ = run_script("exp13_batching_sim", "--step-costs", costs, "--slots", 4,
                        "--requests", 8, "--median", 4, "--max-len", 12, "--total", 40)
    assert "measured" in out and "continuous" in out
    out, _ = run_script("exp13_engine", "--model", tiny, "--requests", 8, "--median", 4,
                        "--max-len", 12, "--total", 40, "--prompt-len", 6, "--check")
    assert "continuous vs static" in out
    out, _ = run_script("exp14_paged_cache", "--model", tiny, "--block-sizes", "4,16")
    assert "paged" in out
    out, _ = run_script("bench_engine", "--model", tiny, "--requests", 4, "--prompt-len", "4-8",
                        "--new-tokens", "4-8", "--slots", 2)
    assert "4/4" in out


def test_bench_decode_runs_and_checks_its_bits(tiny, run_script):
    out, _ = run_script("bench_decode", "--model", tiny, "--context", 8, "--repeat", 2,
                        "--buffer-mb", 16)
    assert "against the memory-bandwidth floor" in out and "/ floor" in out
    assert "bit for bit" in out  # batch-invariant rows: each exactly B = 1's logits
    assert "Quantized decode" in out and "NF4 (block 64)" in out
    assert "prompt lookup on a rewrite task" in out and "yes" in out.split("rewrite task")[-1]


def test_run_all_runs_a_selection(tiny, capfd):
    """run_all starts each script as a process: its tables reach the file descriptor."""
    assert run_all.main(["--model", tiny, "--only", "exp(09|24)"]) == 0
    out = capfd.readouterr().out
    assert "Experiment 9: KV cache for users x tokens" in out and "Experiment 24" in out
