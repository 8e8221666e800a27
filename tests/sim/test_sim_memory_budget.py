"""Experiment 24: the chapter's memory-budget figures, reproduced exactly from the assumptions."""
import dataclasses

import pytest

from minitransformer.checkpoints.synth import qwen25_05b_config
from sim.arch import parameter_count
from sim.kv_memory import GB
from sim.memory_budget import (
    FP16,
    INT4,
    INT8,
    MODELS,
    SEVEN_B,
    THIRTEEN_B,
    Assumptions,
    ModelSpec,
    Precision,
    budget,
    budget_table,
    weight_bytes,
)

QWEN25_05B = qwen25_05b_config()  # the chapter's model: 24 layers, 14 q heads, 2 kv heads


def test_chapter_figures():
    assert round(weight_bytes(SEVEN_B, FP16) / GB, 1) == 13.0
    on_8 = budget(8, THIRTEEN_B, INT4)
    assert round(on_8.weight_bytes / GB, 1) == 6.2
    assert on_8.max_tokens == 337
    seven, thirteen = budget(16, SEVEN_B, INT8), budget(16, THIRTEEN_B, INT8)
    assert (seven.max_tokens, thirteen.max_tokens) == (65_378, 3_136)
    assert round((thirteen.weight_bytes - seven.weight_bytes) / GB, 1) == 5.6  # extra weights
    assert seven.max_tokens // thirteen.max_tokens == 20                     # "20x gap"
    assert (seven.kv_bytes_per_token, thirteen.kv_bytes_per_token) == (128 * 1024, 800 * 1024)


@pytest.mark.parametrize("change", [
    {"reserve_gb": 1.4}, {"reserve_gb": 1.6}, {"gb": 10**9}, {"kv_bytes_per_elem": 1},
])
def test_every_assumption_is_load_bearing(change):
    # each documented assumption, moved a little, breaks at least one quoted figure
    other = dataclasses.replace(Assumptions(), **change)
    quoted = [(8, THIRTEEN_B, INT4, 337), (16, SEVEN_B, INT8, 65_378),
              (16, THIRTEEN_B, INT8, 3_136)]
    assert any(budget(c, m, p, other).max_tokens != n for c, m, p, n in quoted)


def test_plain_4_bits_would_not_give_the_chapters_6_2_gb():
    plain = Precision("int4-plain", 4)
    assert round(weight_bytes(THIRTEEN_B, plain) / GB, 1) == 6.1


def test_every_row_is_consistent():
    rows = budget_table()
    assert len(rows) == 3 * 3 * 3
    for r in rows:
        card = r.card_gb * GB
        assert r.weight_bytes + r.left_bytes + 1.5 * GB == card
        if r.left_bytes <= 0:
            assert r.max_tokens == 0
        else:  # the floor: one more token would not fit
            assert r.max_tokens * r.kv_bytes_per_token <= r.left_bytes
            assert (r.max_tokens + 1) * r.kv_bytes_per_token > r.left_bytes
    assert all(r.max_tokens == 0 for r in rows if r.model == "70B")  # 70B fits nowhere here


def test_an_int8_cache_nearly_doubles_the_resident_tokens():
    """q8_0: 34 bytes per 32 numbers (32 int8 codes + a 2-byte scale), so 7B's 128 KB/token
    become 68 KB, and every row holds floor(left / that) tokens."""
    rows = budget_table()
    seven = next(r for r in rows if r.model == "7B")
    assert seven.kv_int8_bytes_per_token == 2 * 32 * 8 * (128 // 32) * 34 == 69_632
    for r in rows:
        assert r.kv_int8_bytes_per_token * 32 == r.kv_bytes_per_token * 17   # 34/32 vs 2
        assert r.max_tokens_int8 == max(r.left_bytes, 0) // r.kv_int8_bytes_per_token
        assert r.max_tokens <= r.max_tokens_int8 <= 2 * r.max_tokens + 1
    on_16 = next(r for r in rows if (r.card_gb, r.model, r.precision) == (16, "7B", "int8"))
    assert on_16.max_tokens == 65_378 and on_16.max_tokens_int8 == 123_064


def test_your_own_card_and_model():
    spec = ModelSpec.from_config(QWEN25_05B, "qwen2.5-0.5b")
    assert spec.parameters == parameter_count(QWEN25_05B)
    row = budget(4, spec, FP16)
    assert row.kv_bytes_per_token == 12_288
    assert row.left_bytes == 4 * GB - 2 * 494_032_768 - 1.5 * GB
    assert row.max_tokens == row.left_bytes // 12_288
    assert budget(12.5, SEVEN_B, INT4).card_gb == 12.5


def test_bad_inputs():
    with pytest.raises(ValueError, match="card_gb"):
        budget(0, SEVEN_B, FP16)
    with pytest.raises(ValueError, match="bits per weight"):
        budget(8, SEVEN_B, Precision("zero", 0))
    assert MODELS[0] is SEVEN_B
