"""Experiments 2, 4, 5, 6, 7: the measured KV-cache experiments compute the right things.

Times are never asserted (speed lives in the scripts' printed ratios); what is asserted is what
is exact: the same tokens and outputs both ways, the score bytes, the number of steps, that the
allocator's peak contains the score matrix, and the shape of each printed table.
"""
import numpy as np
import pytest

import exp02_attention_scaling as exp02
import exp04_cache_memory as exp04
import exp05_prefill_vs_decode as exp05
import exp07_decode_cost as exp07
import minitransformer as mt
from minitransformer.backend import BACKEND, to_numpy
from minitransformer.kvcache import KVCache
from minitransformer.measure.timing import step_with_rollback
from minitransformer.model import forward

numpy_only = pytest.mark.skipif(BACKEND != "numpy", reason="byte counts below are tracemalloc's")


def table_rows(out, header_start):
    """The lines of the table whose header line starts with `header_start`, up to a blank."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith(header_start))
    rows = []
    for line in lines[start + 1:]:
        if not line.strip():
            break
        rows.append(line.split())
    return rows


def test_exp02_both_ways_give_the_attention_of_the_newest_position():
    n, d = 50, 8
    q, k, v = (np.random.default_rng(i).standard_normal((n, d)).astype(np.float32)
               for i in range(3))
    scores = q[-1] @ k.T / np.sqrt(d)                     # (n,): the newest query sees all
    weights = np.exp(scores - scores.max())
    expected = (weights / weights.sum()) @ v              # independent of model.plain_attention
    recompute, cached, tiled = exp02.step_both_ways(q, k, v)
    np.testing.assert_allclose(to_numpy(recompute()), expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(to_numpy(cached()), expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(to_numpy(tiled()), expected, rtol=1e-5, atol=1e-6)


@numpy_only
def test_exp02_peak_holds_the_score_matrix_one_way_only():
    r = exp02.attention_row(256, 64, warmup=0, repeat=1)
    assert (r["scores_recompute"], r["scores_cached"]) == (256 * 256 * 4, 256 * 4)
    assert r["peak_recompute"] >= r["scores_recompute"]   # the n x n matrix was really made
    assert r["peak_cached"] < r["scores_recompute"] // 10  # and the cached step never made it
    assert r["scores_tiled"] == 64 * 64 * 4                # tiles of 64 x 64 scores
    assert r["peak_tiled"] < r["scores_recompute"]         # the n x n scores never made
    assert r["max_diff"] < 1e-5 and r["max_diff_tiled"] < 1e-5


def test_exp02_table(checkpoint_dir, run_script):
    out, _ = run_script("exp02_attention_scaling", "--model", checkpoint_dir("llama-gqa"),
                        "--lengths", 16, 32, "--repeat", 1, "--warmup", 0)
    assert "(d = 8)" in out
    rows = table_rows(out, "n ")
    assert [r[0] for r in rows] == ["16", "32"]
    assert [(r[6], r[7]) for r in rows] == [("1,024", "64"), ("4,096", "128")]  # n*n*4, n*4
    assert [r[10] for r in rows] == ["1,024", "4,096"]    # a tile: n x n while n < 64


@numpy_only
def test_exp04_same_tokens_and_recompute_holds_more(tiny_model):
    prompt = [1, 2, 3, 4]
    runs, counter = exp04.peaks_both_ways(tiny_model, prompt, 60)
    (slow, peak_slow), (fast, peak_fast) = runs["recompute"], runs["cache"]
    assert slow == fast == mt.generate(tiny_model, prompt, 60, eos_token_id=[])
    assert len(fast) == 60
    # The cache's own bytes are inside the cached run's peak ...
    c = tiny_model.config
    assert peak_fast >= 64 * 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 4
    # ... and the last recompute pass alone makes (H, S, S) float32 scores, S = 63.
    assert peak_slow >= c.num_attention_heads * 63 * 63 * 4
    assert peak_slow > peak_fast
    assert "tracemalloc" in counter


def test_exp04_table_and_errors(checkpoint_dir, run_script):
    path = checkpoint_dir("qwen2-gqa-tied-bf16")  # 256 positions
    out, _ = run_script("exp04_cache_memory", "--model", path, "--prompt-tokens", 8,
                        "--new-tokens", 12, "--prefill-model", path, "--prefill-tokens", 200)
    assert "no cache (full recompute)" in out and "KV cache (prefill + decode)" in out
    assert "tokens identical: 12 of 12" in out
    peaks = {line.split()[2]: int(line.split()[-1].replace(",", ""))
             for line in out.splitlines() if line.startswith("200-token prefill")}
    assert peaks["plain"] > 4 * 200 * 200 * 4 > peaks["tiled"]  # 4 heads' (200, 200) scores
    assert "scores alone are 4 x 200 x 200 x 4 = 640,000 B per layer" in out
    out, err = run_script("exp04_cache_memory", "--model", path, "--prompt-tokens", 200,
                          "--new-tokens", 100, status=2)
    assert out == "" and "256" in err
    out, err = run_script("exp04_cache_memory", "--model", path, "--new-tokens", 12,
                          "--prefill-model", path, "--prefill-tokens", 300, status=2)
    assert out == "" and "--prefill-tokens 300 exceeds the prefill model's 256 positions" in err


def test_exp05_timed_loop_generates_what_generate_does(tiny_model):
    prompt = [5, 6, 7]
    prefill, steps, tokens = exp05.one_run(tiny_model, prompt, 10)
    assert len(steps) == 9 and prefill > 0 and all(s > 0 for s in steps)
    assert tokens == mt.generate(tiny_model, prompt, 10, eos_token_id=[])


def test_exp05_table(checkpoint_dir, run_script):
    out, _ = run_script("exp05_prefill_vs_decode", "--model", checkpoint_dir("llama-gqa"),
                        "--prompt-tokens", 12, "--new-tokens", 6, "--repeat", 2, "--warmup", 0)
    rows = table_rows(out, "phase ")
    assert rows[0][:5] == ["prefill,", "12", "prompt", "tokens", "12"]
    assert rows[1][:4] == ["decode,", "5", "steps", "5"]
    assert all(float(x) > 0 for r in rows for x in r[-3:])


def test_exp06_table_skips_lengths_beyond_the_model(checkpoint_dir, run_script):
    path = checkpoint_dir("llama-gqa")
    out, _ = run_script("exp06_prefill_cost", "--model", path, "--lengths", 4, 16, 999,
                        "--repeat", 1, "--warmup", 0)
    rows = table_rows(out, "P ")
    assert [r[0] for r in rows] == ["4", "16"]
    assert all(float(r[1]) > 0 for r in rows)
    # nothing left to measure: an argparse error, not max([])
    out, err = run_script("exp06_prefill_cost", "--model", path, "--lengths", 999, status=2)
    assert out == "" and "--lengths" in err and "Traceback" not in err


def test_exp07_timed_step_sees_exactly_c_cached_tokens(tiny_model):
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    cache = KVCache.allocate(tiny_model.config, batch=1, max_len=len(ids))
    forward(tiny_model, np.array([ids[:7]]), cache)                 # C = 7
    expected = int(np.argmax(mt.logits(tiny_model, ids)[-1]))       # full recompute of C + 1
    step, rollback = step_with_rollback(tiny_model, cache, [[ids[7]]])
    for _ in range(3):  # repeated, as the timing loop does: the same step each time
        assert int(np.argmax(step()[0, -1])) == expected
        assert cache.lengths.tolist() == [8]
        rollback()
        assert cache.lengths.tolist() == [7]
    timings = exp07.step_times(tiny_model, [3, 9], warmup=1, repeat=2)
    assert [t.repeat for t in timings] == [2 * t.rounds for t in timings]  # rounds of 2, pooled


def test_exp07_table(checkpoint_dir, run_script):
    out, _ = run_script("exp07_decode_cost", "--model", checkpoint_dir("qwen2-mha-untied"),
                        "--lengths", 4, 16, 300, "--repeat", 1, "--warmup", 0)
    assert [r[0] for r in table_rows(out, "C ")] == ["4", "16"]  # 300 >= the 256 positions
    # one timed repeat on a shared machine: the growth is concluded, or said not to be
    assert "C 4 -> 16 (4x the history)" in out or \
        "the step's growth: not concluded, the machine was too noisy" in out


def test_exp02_and_exp04_without_model_use_the_default_model(checkpoint_dir, monkeypatch,
                                                              run_script):
    # --model defaults to the name 'default', which must be resolved, not read as a path
    monkeypatch.setattr("minitransformer.checkpoints.synth.default_model",
                        lambda: checkpoint_dir("llama-gqa"))
    out, _ = run_script("exp02_attention_scaling", "--lengths", 16, "--repeat", 1, "--warmup", 0)
    assert "(d = 8)" in out
    out, _ = run_script("exp04_cache_memory", "--prompt-tokens", 4, "--new-tokens", 3,
                        "--prefill-tokens", 0)
    assert "tokens identical: 3 of 3" in out
