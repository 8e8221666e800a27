"""Experiments 15 to 21 run end to end on a tiny checkpoint and print their tables' shape."""
import re

import pytest

from exp21_quantized_quality import swaps
from minitransformer.checkpoints.synth import make_checkpoint, qwen2_config, train_tokenizer


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("scriptmodel")
    # 512 positions: the activation PROMPT is 264 tokens with this small tokenizer
    config = qwen2_config(vocab_size=320, num_hidden_layers=3, max_position_embeddings=512)
    path = make_checkpoint(root / "model", config, seed=7,
                           tokenizer=train_tokenizer(vocab_size=300))
    text = root / "text.txt"
    text.write_text("The boats came home to the harbour at dusk, one by one. " * 30)
    return path, text


@pytest.mark.parametrize("script, args, expected", [
    ("exp15_weight_memory.py", [], ["INT4 group-128", "expected B", "NF4 (block 64)"]),
    ("exp16_quant_error.py", [], ["INT8 per-row", "worst matrix", "mean error /"]),
    ("exp17_weight_outliers.py", [], ["mean |w|", "weights beyond 6 sigma", "INT4: step",
                                      "chosen as the worst INT4 per-tensor error"]),
    ("exp17_weight_outliers.py", ["--matrix", "model.layers.1.mlp.up_proj.weight"],
     ["model.layers.1.mlp.up_proj.weight", "chosen as asked (--matrix)"]),
    ("exp18_activation_outliers.py", ["--layer", 1],
     ["median dim", "log2 bins", " - ", "without position 0"]),
    ("exp19_int8_activation_levels.py", [], ["single tensor-wide scale", "distinct level"]),
    ("exp20_outlier_techniques.py", [], ["LLM.int8 decomposition", "GPTQ / AWQ"]),
])
def test_script_prints_its_table(tiny, run_script, script, args, expected):
    out, _ = run_script(script, "--model", tiny[0], *args)
    for text in expected:
        assert text in out


def test_exp16_rows_follow_the_schemes(tiny, run_script):
    out, _ = run_script("exp16_quant_error.py", "--model", tiny[0], "--schemes", "int8-row,nf4")
    rows = [line.split("  ")[0] for line in out.splitlines()]
    assert "INT8 per-row" in rows and "NF4 (block 64)" in rows and "INT4 per-tensor" not in rows


def test_exp21_quality_table(tiny, run_script):
    out, _ = run_script("exp21_quantized_quality.py", "--model", tiny[0], "--text", tiny[1],
              "--tokens", 64, "--window", 32, "--questions", 2, "--max-new-tokens", 3,
              "--positions", 8, "--schemes", "int8-row,nf4", "--llm-int8", 6)
    lines = [line for line in out.splitlines() if "/8" in line]
    assert [line.split()[0] for line in lines] == ["fp32", "INT8", "NF4", "INT8"]
    assert "8/8" in lines[0]  # the full-precision model agrees with itself everywhere
    assert "perplexity: 64 tokens" in out
    assert "95% Wilson interval" in out and "repetition penalty off:" in out
    assert len(re.findall(r"\b\d/2 \[\d\.\d\d, \d\.\d\d\]", lines[0])) == 2
    # beside each perplexity its ratio to fp32's (paired over the same tokens: the ratio of the
    # two perplexities), inside its interval; the fp32 row is the reference
    cells = [re.search(r"\s([\d,.]+)\s+(-|([\d.]+) \[([\d.]+), ([\d.]+)\])\s", line).groups()
             for line in lines]
    assert cells[0][1] == "-"
    ppl = [float(c[0].replace(",", "")) for c in cells]
    for c, p in zip(cells[1:], ppl[1:], strict=True):
        r, low, high = map(float, c[2:])
        assert low <= r <= high and r == pytest.approx(p / ppl[0], abs=1e-3 + 1e-3 * r)


def test_exp21_chat_needs_a_chat_template(tiny, run_script):
    _, err = run_script("exp21_quantized_quality", "--model", tiny[0], "--text", tiny[1],
                        "--chat", status=2)
    assert "has no chat template" in err


def test_exp21_names_the_schemes_that_swap():
    line = swaps([("fp32", 12, 12), ("NF4", 11, 9), ("INT4 g128", 10, 10)], 1.1)
    assert "NF4 and INT4 g128 (11 vs 10 with rp 1.1, 9 vs 10 off)" in line
    assert "fp32 and" not in line and "and fp32" not in line
    assert "no two schemes" in swaps([("fp32", 3, 3), ("NF4", 2, 2)], 1.1)


def test_exp21_says_when_the_text_is_too_short(tiny, run_script):
    _, err = run_script("exp21_quantized_quality", "--model", tiny[0], "--text", tiny[1],
                        "--tokens", 100000, status=2)
    assert "are needed; use --tokens or a longer --text" in err


def test_exp21_kv_cache_quality_table(tiny, run_script):
    out, _ = run_script("exp21_kv_cache_quality", "--model", tiny[0], "--text", tiny[1],
                        "--tokens", 40, "--schemes", "int8-row", "--kv-dtypes", "q8_0", "q4_0")
    rows = [line.split() for line in out.splitlines() if "/40 [" in line]
    assert [r[0] for r in rows] == ["fp32"] * 3 + ["INT8"] * 3
    caches = [next(c for c in r if c in ("f32", "q8_0", "q4_0")) for r in rows]
    assert caches == ["f32", "q8_0", "q4_0"] * 2          # fp32 then INT8 weights
    assert "40/40 [" in " ".join(rows[0])                 # the f32 cache agrees with itself
    assert "1.0000 [1.0000, 1.0000]" in " ".join(rows[0])
    assert all(r[-2] == f"{b:,}" for r, b in zip(rows, [3 * 2 * 2 * 8 * 4, 3 * 2 * 2 * 10,
                                                         3 * 2 * 2 * 6] * 2, strict=True))
    assert "llama.cpp: -ctk / -ctv q8_0 and q4_0" in out


def test_exp21_k_quant_rows_are_the_same_decoded_once(tiny, monkeypatch):
    """Experiment 21 evaluates a k-quant model with its blocks decoded once: the row it prints
    is the one decoding the blocks at every product gives (bytes held: the blocks alone)."""
    import argparse

    import exp21_quantized_quality as exp21
    from minitransformer.loader import load
    from minitransformer.measure.quality import reference_tokens, tokens_of
    from quant.qmodel import quantize_model
    model = load(tiny[0])
    ids = tokens_of(model, tiny[1].read_text(), 33)
    args = argparse.Namespace(window=16, questions=2, max_new_tokens=3, chat=False)
    prefix = [1, 2, 3]
    reference = reference_tokens(model, prefix, 6)
    q = quantize_model(model, "q6_k")

    def row():
        label, ppl, scores, agree, proj, total = exp21.evaluate(
            "Q6_K", q, ids, args, prefix, reference, 1.1)
        return label, ppl.value, ppl.per_token.tolist(), scores, agree, proj, total
    decoded = row()
    monkeypatch.setattr(exp21, "decoded_once", lambda m: m)
    assert row() == decoded and decoded[5] == sum(w.nbytes for w in q.weights.values()
                                                 if hasattr(w, "blocks"))


def test_exp21_decodes_on_one_blas_thread_and_gives_the_threads_back(tiny, monkeypatch):
    """The battery runs on DECODE_THREADS BLAS threads (its products of a few rows: a second
    thread spins more than it works); perplexity and agreement on the process's, as before."""
    import argparse

    from threadpoolctl import threadpool_info, threadpool_limits

    import exp21_quantized_quality as exp21
    from minitransformer.loader import load
    from minitransformer.measure.quality import battery, tokens_of

    def blas_threads():
        return max(p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas")
    seen = {}

    def spy(name, fn):
        def run(*args, **kwargs):
            seen.setdefault(name, set()).add(blas_threads())
            return fn(*args, **kwargs)
        monkeypatch.setattr(exp21, name, run)
    for name, fn in (("battery", battery), ("perplexity", exp21.perplexity),
                     ("agreement", exp21.agreement)):
        spy(name, fn)
    model = load(tiny[0])
    ids = tokens_of(model, tiny[1].read_text(), 17)
    args = argparse.Namespace(window=16, questions=1, max_new_tokens=2, chat=False)
    with threadpool_limits(2, user_api="blas"):
        exp21.evaluate("fp32", model, ids, args, [1, 2, 3], [4, 5], 1.1)
        assert blas_threads() == 2                                   # given back
    assert seen == {"battery": {exp21.DECODE_THREADS}, "perplexity": {2}, "agreement": {2}}
