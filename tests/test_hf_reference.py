"""Live comparison with Hugging Face transformers, when torch and transformers are installed.

Skipped otherwise (the default run has tests/test_golden.py against stored HF logits instead).
Checks, on the golden cases' shapes and on the real stories260K when ../shared has it:
logits for fresh prompts, greedy ``generate`` token for token (cache and no cache against HF's
own greedy search), and the sampling rules against HF's logits processors: repetition penalty,
temperature, top-k and top-p give the same support and the same probabilities.
"""
import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
import torch
import transformers
from transformers.generation.logits_process import (
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

import minitransformer as mt
from conftest import STORIES, assert_same
from minitransformer.checkpoints.synth import make_checkpoint
from minitransformer.sampling import SamplingSettings, apply_repetition_penalty, probabilities

EPS = np.finfo(np.float32).eps
CASES = {c["name"]: c for c in json.loads(
    (Path(__file__).resolve().parent / "fixtures" / "hf_golden.json").read_text())["cases"]}


def hf_model(path):
    """HF's model in float32 with eager attention; every tensor must come from the checkpoint."""
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    dtype_kw = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"  # renamed in 4.56
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        path, attn_implementation="eager", output_loading_info=True, **{dtype_kw: torch.float32})
    assert not any(info.values()), f"HF did not load {path} as written: {info}"
    return model.eval()


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].numpy()                  # (T, V)


def hf_greedy(hf, ids, n, repetition_penalty=1.0):
    """HF's own greedy search, new tokens only (it stops at eos as ours does)."""
    x = torch.tensor([ids])
    with torch.no_grad():
        out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n,
                          do_sample=False, repetition_penalty=repetition_penalty,
                          pad_token_id=hf.generation_config.eos_token_id)
    return out[0, len(ids):].tolist()


@pytest.fixture(scope="module", params=sorted(CASES) + ["stories260K"])
def pair(request, tmp_path_factory):
    """(our model, HF's model, a prompt) for one golden case's shape or stories260K."""
    if request.param == "stories260K":
        if not (STORIES / "model.safetensors").is_file():
            pytest.skip("../shared/models/stories260K is not present")
        ours = mt.load(STORIES)
        return ours, hf_model(STORIES), ours.tokenizer.encode("Once upon a time, a little dog")
    case = CASES[request.param]
    path = make_checkpoint(tmp_path_factory.mktemp("hf") / case["name"], case["config"],
                           seed=case["seed"], dtype=case["dtype"])
    ids = np.random.default_rng(7).integers(0, case["config"]["vocab_size"], 50).tolist()
    return mt.load(path), hf_model(path), ids


def test_logits_match_hf_live(pair):
    ours, hf, ids = pair
    ref = hf_logits(hf, ids)
    assert_same(mt.logits(ours, ids), ref, rtol=100 * EPS,
                atol=100 * EPS * float(np.abs(ref).max()))


# A random tied model mostly repeats one token (its own embedding scores highest); a strong
# penalty moves it on, and checks that the penalty sees the prompt and the new tokens as HF's does.
@pytest.mark.parametrize("penalty", [1.0, 3.0])
def test_greedy_generate_matches_hf(pair, penalty):
    ours, hf, ids = pair
    expected = hf_greedy(hf, ids, 12, penalty)
    settings = SamplingSettings(repetition_penalty=penalty)
    assert mt.generate(ours, ids, 12, sampling=settings) == expected
    assert mt.generate(ours, ids, 12, cache=False, sampling=settings) == expected


SETTINGS = [  # (temperature, top_k, top_p, repetition_penalty)
    (1.0, 0, 1.0, 1.3), (0.7, 0, 1.0, 1.0), (1.0, 20, 1.0, 1.0), (1.0, 0, 0.9, 1.0),
    (0.6, 50, 0.8, 1.2), (1.5, 5, 0.5, 0.8), (1.0, 1, 1.0, 1.0), (0.9, 0, 0.05, 1.0),
]


@pytest.mark.parametrize("temperature,top_k,top_p,penalty", SETTINGS)
def test_sampling_rules_match_hf_processors(temperature, top_k, top_p, penalty):
    """Our penalty + probabilities() against HF's processors in generate()'s order."""
    rng = np.random.default_rng(3)
    processors = [RepetitionPenaltyLogitsProcessor(penalty), TemperatureLogitsWarper(temperature)]
    processors += [TopKLogitsWarper(top_k)] if top_k else []
    processors += [TopPLogitsWarper(top_p)] if top_p < 1 else []
    settings = SamplingSettings(True, temperature, top_k, top_p, penalty)
    for _ in range(20):
        logits = (3 * rng.standard_normal(1000)).astype(np.float32)        # (V,)
        previous = rng.integers(0, 1000, 30)                                # repeats included
        scores = torch.tensor(logits[None])
        for process in processors:
            scores = process(torch.tensor(previous[None]), scores)
            if isinstance(process, RepetitionPenaltyLogitsProcessor):
                penalized = apply_repetition_penalty(logits, previous.tolist(), penalty)
                np.testing.assert_array_equal(penalized, scores[0].numpy())  # same float ops
        expected = torch.softmax(scores, dim=-1)[0].numpy()
        ours = probabilities(penalized, settings)
        assert_same(ours > 0, expected > 0)                                 # the same support
        assert_same(ours, expected, rtol=1e-5, atol=1e-7)
