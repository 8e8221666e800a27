"""KV-cache byte counts (experiments 8-11) and the config reader they share (sim/arch.py)."""
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from minitransformer.checkpoints.synth import qwen25_05b_config
from minitransformer.config import ModelConfig
from sim.arch import arch, kv_dims, parameter_count, read_config_json
from sim.kv_memory import (
    GB,
    KB,
    MB,
    attention_variants,
    cache_bytes,
    context_table,
    crossing_tokens,
    kv_bytes_per_token,
    users_tokens_table,
)
from sim.memory_budget import FP16, SEVEN_B, THIRTEEN_B, weight_bytes

QWEN25_05B = qwen25_05b_config()  # the chapter's model: 24 layers, 14 q heads, 2 kv heads
STORIES = Path(__file__).resolve().parents[3] / "shared" / "models" / "stories260K"


def test_chapter_model_bytes_per_token():
    # 2 x 24 x 2 x 64 x 2; the config has no head_dim, so 896 / 14 must be derived
    assert kv_dims(QWEN25_05B) == (24, 2, 64)
    assert kv_bytes_per_token(QWEN25_05B) == 12_288
    assert cache_bytes(QWEN25_05B, 1, 295) == 3_624_960  # the measured (1, 2, 295, 64) fp16
    assert kv_bytes_per_token(QWEN25_05B, bytes_per_elem=4) == 2 * 12_288


def test_only_total_resident_tokens_matter():
    rows = users_tokens_table(QWEN25_05B, [(32, 2048), (64, 1024), (128, 512), (1, 295)])
    assert [r.total_tokens for r in rows] == [65_536] * 3 + [295]
    assert [r.nbytes for r in rows[:3]] == [768 * MB] * 3
    assert rows[3].nbytes == 295 * 12_288


def test_mha_gqa_mqa():
    rows = attention_variants(QWEN25_05B)
    assert [(r.name, r.kv_heads) for r in rows] == [("MHA", 14), ("GQA (configured)", 2),
                                                     ("MQA", 1)]
    assert [r.bytes_per_token for r in rows] == [86_016, 12_288, 6_144]
    assert rows[0].bytes_per_token == 84 * KB and rows[0].vs_configured == 7.0


def test_variants_of_an_mha_model_have_no_duplicate_row():
    mha = dict(QWEN25_05B, num_key_value_heads=14)
    assert [(r.name, r.kv_heads) for r in attention_variants(mha)] == [
        ("MHA (configured)", 14), ("MQA", 1)]


def test_seven_and_thirteen_b_per_token():
    assert kv_bytes_per_token(SEVEN_B) == 128 * KB
    assert kv_bytes_per_token(THIRTEEN_B) == 800 * KB


def test_one_users_cache_outgrows_7b_fp16_weights_before_128k_tokens():
    weights = weight_bytes(SEVEN_B, FP16)
    assert round(weights / GB, 1) == 13.0
    n = crossing_tokens(SEVEN_B, weights)
    assert cache_bytes(SEVEN_B, 1, n - 1) <= weights < cache_bytes(SEVEN_B, 1, n)
    assert n == 106_812 < 128_000
    rows = context_table(SEVEN_B, [n - 1, n, 128_000], weights)
    assert [r.vs_weights > 1 for r in rows] == [False, True, True]
    assert rows[2].nbytes == 128_000 * 128 * KB


def test_config_as_dict_object_or_path_agree(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN25_05B))
    as_object = SimpleNamespace(**QWEN25_05B)
    for config in (QWEN25_05B, as_object, tmp_path, tmp_path / "config.json", str(tmp_path)):
        assert kv_bytes_per_token(config) == 12_288
        assert arch(config) == arch(QWEN25_05B)


def test_hf_defaults_head_dim_and_kv_heads():
    explicit = {"num_hidden_layers": 2, "num_key_value_heads": 3, "head_dim": 5}
    assert kv_dims(explicit) == (2, 3, 5)  # the three formula fields alone are enough
    mha = {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 32}
    assert kv_dims(mha) == (2, 4, 8)       # no kv heads: MHA; no head_dim: 32 / 4


@pytest.mark.parametrize("config, word", [
    ({"num_key_value_heads": 2, "head_dim": 64}, "num_hidden_layers"),
    ({"num_hidden_layers": 2, "head_dim": 64}, "num_key_value_heads"),
    ({"num_hidden_layers": 2, "num_key_value_heads": 2}, "head_dim"),
    ({"num_hidden_layers": 0, "num_key_value_heads": 2, "head_dim": 64}, "num_hidden_layers"),
    ({"num_hidden_layers": 2.5, "num_key_value_heads": 2, "head_dim": 64}, "num_hidden_layers"),
])
def test_bad_configs_name_the_field(config, word):
    with pytest.raises(ValueError, match=word):
        kv_bytes_per_token(config)


def test_bad_arguments_and_paths(tmp_path):
    with pytest.raises(ValueError, match="users"):
        cache_bytes(QWEN25_05B, -1, 10)
    with pytest.raises(ValueError, match="bytes_per_elem"):
        kv_bytes_per_token(QWEN25_05B, 0)
    with pytest.raises(ValueError, match="no model config"):
        read_config_json(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        read_config_json(tmp_path)
    with pytest.raises(ValueError, match="multiple"):
        arch(dict(QWEN25_05B, num_key_value_heads=3))


def test_parameter_count():
    # Qwen2.5-0.5B as its model card counts it: 494,032,768 (tied head, q/k/v biases)
    assert parameter_count(QWEN25_05B) == 494_032_768
    a = arch(QWEN25_05B)
    projections = a.num_hidden_layers * (2 * 896 * 896 + 2 * 896 * 128 + 3 * 896 * 4864)
    assert round(projections / 1e6, 1) == 357.8  # the chapter's 168 matrices
    untied = dict(QWEN25_05B, tie_word_embeddings=False)
    assert parameter_count(untied) - parameter_count(QWEN25_05B) == 151_936 * 896


def test_the_cores_model_config_object(tmp_path):
    # ModelConfig has attention_bias=False for Qwen2 (the bias comes with the type) and a
    # filled-in head_dim; the counts must come out as from the raw dict
    config = ModelConfig.from_dict(QWEN25_05B)
    assert parameter_count(config) == 494_032_768
    assert kv_bytes_per_token(config) == 12_288
    llama = ModelConfig.from_dict(dict(QWEN25_05B, model_type="llama", architectures=[],
                                       attention_bias=True))
    assert parameter_count(llama) == 494_032_768 + 24 * 896  # + an o_proj bias per layer


def test_parameter_count_against_a_real_checkpoint():
    if not STORIES.is_dir():
        pytest.skip("../shared/models/stories260K not present")
    safetensors = pytest.importorskip("safetensors.numpy")
    tensors = safetensors.load_file(str(STORIES / "model.safetensors"))
    assert parameter_count(read_config_json(STORIES)) == sum(t.size for t in tensors.values())
