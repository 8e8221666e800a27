"""minitransformer's logits against Hugging Face transformers' own, in the default run (no torch).

scripts/dev/make_golden.py (optional, needs torch + transformers) built each case's random
checkpoint with minitransformer.checkpoints.synth, ran it through HF's Qwen2/Llama in float32 with
eager attention and stored the logits in tests/fixtures/hf_golden.{json,npz}. Here the same
checkpoints are rebuilt from their seeds and run through minitransformer: the logits must agree to
float32 rounding (100 eps of the logit scale) and the greedy argmax exactly. The cases cover GQA,
MHA and MQA; Qwen2's q/k/v bias, Llama with and without q/k/v/o bias; tied and untied heads; bf16,
fp16 and fp32 storage; rope_theta 100 to 1e6; a head_dim that is not hidden / heads. The
sliding-window cases also go through the paged engine: their prompt's logprobs in chunks
against HF's logits, and a generation far past the window against recomputing's.
"""
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

import minitransformer as mt
import minitransformer.model
from conftest import assert_same
from minitransformer.checkpoints.synth import make_checkpoint

FIXTURES = Path(__file__).resolve().parent / "fixtures"
MANIFEST = json.loads((FIXTURES / "hf_golden.json").read_text())
CASES = {case["name"]: case for case in MANIFEST["cases"]}
EPS = np.finfo(np.float32).eps


@pytest.fixture(scope="module")
def golden():
    """HF's logits: "<case>/<prompt index>" -> float32 (T, V)."""
    with np.load(FIXTURES / MANIFEST["logits_file"]) as stored:
        return {key: stored[key] for key in stored.files}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Case name -> path of its checkpoint, regenerated from the recorded config/seed/dtype."""
    root = tmp_path_factory.mktemp("golden")
    return {name: make_checkpoint(root / name, case["config"], seed=case["seed"],
                                  dtype=case["dtype"]) for name, case in CASES.items()}


def tolerance(reference) -> float:
    """Float32 rounding, scaled to the logits' size: both sides compute in float32."""
    return 100 * EPS * float(np.abs(reference).max())


@pytest.mark.parametrize("name", sorted(CASES))
def test_synth_rebuilds_the_fixture_checkpoint(name, checkpoints):
    digest = hashlib.sha256((checkpoints[name] / "model.safetensors").read_bytes()).hexdigest()
    assert digest == CASES[name]["safetensors_sha256"], (
        f"{name}: minitransformer.checkpoints.synth no longer writes the checkpoint the golden "
        "logits were made from; if that change is intended, rerun scripts/dev/make_golden.py")


@pytest.mark.parametrize("name", sorted(CASES))
def test_logits_match_hugging_face(name, checkpoints, golden):
    model = mt.load(checkpoints[name])
    for i, ids in enumerate(CASES[name]["prompts"]):
        ref = golden[f"{name}/{i}"]                                   # (T, V)
        ours = mt.logits(model, ids)
        assert_same(ours, ref, rtol=100 * EPS, atol=tolerance(ref))
        assert_same(ours.argmax(axis=-1), ref.argmax(axis=-1))        # greedy choice, exactly


ROPE = minitransformer.model.rope  # the real one, kept before the test below replaces it


def interleaved_rope(x, cos, sin):
    """The classic porting bug: llama2.c's adjacent pairs (2i, 2i+1) instead of (i, i + d/2)."""
    d = x.shape[-1]
    pairs = np.concatenate([np.arange(0, d, 2), np.arange(1, d, 2)])  # (2i, 2i+1) -> (i, i+d/2)
    return ROPE(x[..., pairs], cos, sin)[..., np.argsort(pairs)]


def test_the_fixture_catches_a_wrong_rope(checkpoints, golden, monkeypatch):
    """A comparison that cannot fail proves nothing: break RoPE and every case must notice."""
    monkeypatch.setattr(minitransformer.model, "rope", interleaved_rope)
    for name, case in CASES.items():
        model = mt.load(checkpoints[name])
        ids, ref = case["prompts"][-1], golden[f"{name}/{len(case['prompts']) - 1}"]
        assert np.abs(mt.logits(model, ids) - ref).max() > 10 * tolerance(ref), name


WINDOWED = sorted(name for name, case in CASES.items() if case["config"].get("sliding_window"))


@pytest.mark.parametrize("budget", [5, 16], ids=["chunks-under-the-window", "over-it"])
@pytest.mark.parametrize("name", WINDOWED)
def test_the_paged_engine_scores_a_windowed_prompt_as_hugging_face(name, budget, checkpoints,
                                                                   golden):
    """The sliding-window cases through the paged engine, their 33-token prompt in chunks of
    at most `budget` tokens over blocks of 4: every prompt token's logprob is the one HF's
    logits give it (the window of 8 applied in the pool's attention, a full layer's left
    whole)."""
    from minitransformer.serve.config import EngineConfig
    from minitransformer.serve.engine import Engine
    from minitransformer.serve.records import Request
    model = mt.load(checkpoints[name])
    ids, ref = CASES[name]["prompts"][-1], golden[f"{name}/{len(CASES[name]['prompts']) - 1}"]
    engine = Engine(model, EngineConfig(max_num_seqs=1, block_size=4,
                                        max_num_batched_tokens=budget))
    (result,) = engine.run([Request(tuple(ids), 0, prompt_logprobs=0)]).results
    assert result.prefill_chunks == -(-len(ids) // budget)
    shifted = ref - ref.max(axis=-1, keepdims=True)
    expected = (shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True)))[:-1]  # (T-1, V)
    np.testing.assert_allclose([t.logprob for t in result.prompt_logprobs[1:]],
                               expected[np.arange(len(ids) - 1), ids[1:]],
                               atol=tolerance(ref))


@pytest.mark.parametrize("name", WINDOWED)
def test_the_paged_engine_generates_a_windowed_checkpoints_tokens(name, checkpoints):
    """The sliding-window cases' 33-token prompt and 40 new tokens, far past the window of 8,
    through the paged engine (blocks of 4, chunks of at most 6 tokens, prompt lookup drafting
    3), twice (the second run finds the first's blocks cached): greedy tokens are
    recomputing's, by the near-tie policy, and each one's logprob within float32 rounding of
    its (the tokens of a random model hardly depend on attention; a window one too wide moves
    the logprobs)."""
    from conftest import assert_like_solo
    from minitransformer.serve.config import EngineConfig, SpeculativeConfig
    from minitransformer.serve.engine import Engine
    from minitransformer.serve.records import Request
    model = mt.load(checkpoints[name])
    ids = CASES[name]["prompts"][-1]
    engine = Engine(model, EngineConfig(max_num_seqs=2, block_size=4, max_num_batched_tokens=6,
                                        speculative_config=SpeculativeConfig(
                                            num_speculative_tokens=3, prompt_lookup_max=3)))
    steps = mt.generate(model, ids, 40, cache=False, eos_token_id=[], logprobs=1)
    expected = [s.token for s in steps]
    for result in engine.run([Request(tuple(ids), 40, eos_token_id=[], logprobs=1)] * 2).results:
        assert_like_solo(model, result.tokens, expected, ids, eos_token_id=[])
        same = next((i for i, (a, b) in enumerate(zip(result.tokens, expected, strict=True))
                     if a != b), 40)
        np.testing.assert_allclose([t.logprob for t in result.logprobs[:same]],
                                   [s.logprob for s in steps[:same]], atol=1e-5)
