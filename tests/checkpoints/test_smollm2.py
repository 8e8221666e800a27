"""The real model, SmolLM2-135M-Instruct, against transformers' reading of the same GGUF file.

Skipped when the model has not been fetched (python3 scripts/import_gguf.py --smollm2).
scripts/dev/make_smollm2_golden.py stored transformers' token ids, top-10 last-position logits
and greedy tokens (tests/fixtures/smollm2_golden.json); transformers has its own GGUF reader,
torch dequantizers and q/k un-permutation, so agreement checks the whole import.
"""
import json
from pathlib import Path

import numpy as np
import pytest

import minitransformer as mt
from minitransformer.checkpoints.real_model import WHEEL_SHA256

GOLDEN = json.loads((Path(__file__).parents[1] / "fixtures" / "smollm2_golden.json").read_text())
TIE = 1e-3  # top-two gap under which float32 order may pick either (50x the logit error)


@pytest.fixture(scope="module")
def model(smollm2):
    return smollm2


def test_fixture_is_of_this_wheel():
    assert GOLDEN["wheel_sha256"] == WHEEL_SHA256


@pytest.mark.parametrize("case", GOLDEN["cases"], ids=lambda c: c["prompt"][:20])
def test_tokens_and_logits_match_transformers(model, case):
    ids = model.tokenizer.encode(case["prompt"])
    assert ids == case["ids"]
    last = mt.logits(model, ids)[-1]
    top = np.argsort(-last)[: GOLDEN["top_k"]]
    reference = np.array(case["top_logits"], dtype=np.float32)
    # float32 through 30 layers, summed in another order: measured 1e-5..2e-5 on logits of ~20
    np.testing.assert_allclose(last[case["top_ids"]], reference, rtol=0, atol=1e-4)
    assert list(top[:3]) == case["top_ids"][:3]


@pytest.mark.parametrize("case", GOLDEN["cases"], ids=lambda c: c["prompt"][:20])
def test_greedy_tokens_match_transformers(model, case):
    """Equal up to the first near-tie of the reference (gap < TIE), all of them if none."""
    steps = next((i for i, g in enumerate(case["greedy_gaps"]) if g < TIE),
                 len(case["greedy"]))
    assert steps >= 4  # the comparison covers real text, not a single token
    assert mt.generate(model, case["ids"], steps) == case["greedy"][:steps]


def test_capital_of_germany_is_berlin(model):
    ids = model.tokenizer.encode("The capital of Germany is")
    assert model.tokenizer.decode(mt.generate(model, ids, 1)) == " Berlin"


def test_chat_template_matches_transformers(model):
    assert model.tokenizer.chat_prompt(GOLDEN["chat"]["messages"]) == GOLDEN["chat"]["ids"]
