"""Shared test fixtures: tiny random checkpoints of every shape the loader supports, and the
one comparison helper (shape, then dtype, then values)."""
from pathlib import Path

import numpy as np
import pytest

from minitransformer import load
from minitransformer.synth import llama_config, make_checkpoint, qwen2_config

STORIES = Path(__file__).resolve().parents[2] / "shared" / "models" / "stories260K"

# name -> (config, storage dtype). Covers GQA/MHA/MQA, bias on/off, tied/untied, bf16/fp16/fp32,
# rope_theta and a head_dim that is not hidden / heads.
SHAPES = {
    "qwen2-gqa-tied-bf16": (qwen2_config(), "bfloat16"),
    "qwen2-mha-untied": (qwen2_config(num_key_value_heads=4, tie_word_embeddings=False), "float32"),
    "qwen2-mqa-fp16": (qwen2_config(num_key_value_heads=1, rope_theta=1e6), "float16"),
    "llama-gqa": (llama_config(num_attention_heads=8, num_key_value_heads=2, head_dim=8),
                  "float32"),
    "llama-bias-headdim": (llama_config(attention_bias=True, head_dim=16), "bfloat16"),
}


@pytest.fixture(scope="session")
def checkpoint_dir(tmp_path_factory):
    """name -> path of a generated checkpoint (made once per session)."""
    root = tmp_path_factory.mktemp("checkpoints")
    made = {}

    def make(name):
        if name not in made:
            config, dtype = SHAPES[name]
            made[name] = make_checkpoint(root / name, config, seed=len(made) + 1, dtype=dtype)
        return made[name]
    return make


@pytest.fixture(scope="session", params=sorted(SHAPES))
def tiny_model(request, checkpoint_dir):
    """Each tiny random model in turn, loaded."""
    return load(checkpoint_dir(request.param))


@pytest.fixture(scope="session")
def stories():
    """The real pretrained stories260K when ../shared is beside the repository; else skip."""
    if not (STORIES / "model.safetensors").is_file():
        pytest.skip("../shared/models/stories260K is not present")
    return load(STORIES)


def assert_same(actual, expected, rtol=None, atol=None):
    """Shape, then dtype, then values: == for integers, a dtype-scaled allclose for floats."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape, f"shape {actual.shape} != {expected.shape}"
    assert actual.dtype == expected.dtype, f"dtype {actual.dtype} != {expected.dtype}"
    if np.issubdtype(actual.dtype, np.floating):
        eps = np.finfo(actual.dtype).eps
        np.testing.assert_allclose(actual, expected, rtol=100 * eps if rtol is None else rtol,
                                   atol=100 * eps if atol is None else atol)
    else:
        np.testing.assert_array_equal(actual, expected)
