"""Make the golden logits the default test run compares against (tests/test_golden.py).

Optional: needs torch and transformers (pip install -e '.[reference]'); nothing else in the
repository imports them. Run it again only when the cases below change, or when
tests/test_golden.py reports that minitransformer.checkpoints.synth now makes different
checkpoints.

For each case it writes a random checkpoint with
``minitransformer.checkpoints.synth.make_checkpoint`` (deterministic: numpy's seeded generator),
loads it with Hugging Face transformers in float32 with the eager attention (the plain
softmax(QK^T/sqrt(d))V), checks that every parameter HF holds is bit-for-bit the tensor
minitransformer loads (so a weight HF silently initialised itself cannot slip into the fixture),
and stores HF's logits for a few prompts.

    tests/fixtures/hf_golden.json   the cases: config dict, seed, storage dtype, prompts,
                                    sha256 of the checkpoint's model.safetensors, versions
    tests/fixtures/hf_golden.npz    HF's float32 logits (T, V), key "<case>/<prompt index>"

stdout: one row per case (its logit scale, its smallest top-1/top-2 gap, and how far
minitransformer is from HF, for information; the test is what enforces it).
"""
import argparse
import hashlib
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: _common, _table

from _common import run

import minitransformer as mt
from minitransformer.backend import to_numpy
from minitransformer.checkpoints.synth import (
    llama_config,
    make_checkpoint,
    mistral_config,
    qwen2_config,
    qwen3_config,
)

OUT = Path(__file__).resolve().parents[2] / "tests" / "fixtures"
PROMPT_LENGTHS = (1, 7, 33)

# Each family's switches, in the combinations real checkpoints use and a few they might:
# GQA / MHA / MQA; Qwen2's q/k/v bias, Llama with and without attention_bias (q/k/v/o);
# tied and untied heads; bf16, fp16 and fp32 storage; rope_theta from 100 to 1e6; head_dim
# equal to hidden / heads and not.
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
CASES = [
    ("qwen2-gqa-tied-fp32", qwen2_config(vocab_size=128), "float32"),
    ("qwen2-mha-untied-bf16", qwen2_config(num_key_value_heads=4, tie_word_embeddings=False,
                                           rope_theta=1_000_000.0), "bfloat16"),
    ("qwen2-mqa-headdim16-fp32", qwen2_config(num_key_value_heads=1, head_dim=16,
                                              num_hidden_layers=3, rope_theta=100.0), "float32"),
    ("llama-gqa8x2-untied-fp32", llama_config(num_attention_heads=8, num_key_value_heads=2,
                                              vocab_size=128), "float32"),
    ("llama-bias-mqa-tied-bf16", llama_config(attention_bias=True, num_key_value_heads=1,
                                              tie_word_embeddings=True, head_dim=12,
                                              rope_theta=500_000.0), "bfloat16"),
    ("llama-mha-headdim32-fp16", llama_config(hidden_size=64, num_key_value_heads=4, head_dim=32,
                                              rms_norm_eps=1e-6), "float16"),
    # Llama 3.x's rope scaling over a trained context of 64 (d = 16: one pair kept, two
    # blended, five slowed), and linear scaling; Qwen3's q/k norms, tied and untied, with and
    # without attention_bias.
    ("llama3-rope-gqa-fp32", llama_config(head_dim=16, rope_scaling=LLAMA3_ROPE), "float32"),
    ("llama-linear-rope-bf16", llama_config(rope_scaling={"rope_type": "linear", "factor": 4.0},
                                            rope_theta=500_000.0), "bfloat16"),
    ("qwen3-gqa-headdim16-tied-fp32", qwen3_config(), "float32"),
    ("qwen3-bias-untied-bf16", qwen3_config(attention_bias=True, tie_word_embeddings=False,
                                            num_key_value_heads=1, rope_theta=1_000_000.0),
     "bfloat16"),
    # Sliding windows of 8 under the 33-token prompt: every Mistral layer; Qwen2's from
    # max_window_layers on (layer 0 full, layers 1-2 windowed).
    ("mistral-window8-fp32", mistral_config(), "float32"),
    ("qwen2-window8-from-layer1-fp32", qwen2_config(use_sliding_window=True, sliding_window=8,
                                                    max_window_layers=1, num_hidden_layers=3),
     "float32"),
]


def sha256(file: Path) -> str:
    return hashlib.sha256(file.read_bytes()).hexdigest()


def hf_model(path):
    """The checkpoint as HF builds it: float32 (bf16/fp16 upcast exactly), eager attention."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    dtype_kw = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"  # renamed in 4.56
    model, info = AutoModelForCausalLM.from_pretrained(
        path, attn_implementation="eager", output_loading_info=True, **{dtype_kw: torch.float32})
    problems = {k: v for k, v in info.items() if v}
    if problems:
        raise RuntimeError(f"{path}: HF did not load the checkpoint as written: {problems}")
    return model.eval()


def check_same_weights(hf, ours) -> None:
    """Every HF parameter equals minitransformer's loaded tensor exactly (same upcast)."""
    theirs = {k: v.detach().numpy() for k, v in hf.state_dict().items()
              if not k.endswith("rotary_emb.inv_freq")}
    if ours.config.tie_word_embeddings:
        theirs.pop("lm_head.weight")  # HF's tied head is the embedding itself
    if set(theirs) != set(ours.weights):
        raise RuntimeError(f"tensor names differ: {sorted(set(theirs) ^ set(ours.weights))}")
    for name, value in theirs.items():
        if not np.array_equal(value, to_numpy(ours.weights[name])):
            raise RuntimeError(f"{name}: HF holds different values than minitransformer loads")


def hf_logits(hf, ids) -> np.ndarray:
    import torch

    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float().numpy()  # (T, V)


def top2_gap(logits) -> float:
    """The smallest distance between the best and second-best logit over positions."""
    top = np.sort(logits, axis=-1)[:, -2:]
    return float((top[:, 1] - top[:, 0]).min())


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT, help="fixture folder (%(default)s)")
    args = parser.parse_args()

    import torch
    import transformers

    torch.manual_seed(0)  # nothing random should run in HF; this makes sure of it
    manifest = {"generator": "scripts/dev/make_golden.py", "torch": torch.__version__,
                "transformers": transformers.__version__, "numpy": np.__version__,
                "logits_file": "hf_golden.npz", "cases": []}
    arrays = {}
    print(f"{'case':28} {'storage':>8} {'max|logit|':>10} {'min gap':>9} {'|ours-HF|':>10}")
    for n, (name, config, dtype) in enumerate(CASES, 1):
        print(f"{n}/{len(CASES)} {name}", file=sys.stderr)
        seed = n
        rng = np.random.default_rng(1000 + n)
        prompts = [rng.integers(0, config["vocab_size"], t).tolist() for t in PROMPT_LENGTHS]
        with tempfile.TemporaryDirectory() as tmp:
            path = make_checkpoint(Path(tmp) / name, config, seed=seed, dtype=dtype)
            hf, ours = hf_model(path), mt.load(path)
            check_same_weights(hf, ours)
            digest = sha256(path / "model.safetensors")
            refs = [hf_logits(hf, ids) for ids in prompts]
        diff = max(float(np.abs(mt.logits(ours, ids) - r).max())
                   for ids, r in zip(prompts, refs, strict=True))
        scale = max(float(np.abs(r).max()) for r in refs)
        gap = min(top2_gap(r) for r in refs)
        # The test checks greedy argmax exactly and allows 100 float32 eps (times the scale) of
        # rounding; a top-2 gap within 10x of that would make the argmax a coin toss.
        if gap < 1000 * np.finfo(np.float32).eps * scale:
            raise RuntimeError(f"{name}: top-2 gap {gap:.2e} is too close to a tie; change a seed")
        for i, r in enumerate(refs):
            arrays[f"{name}/{i}"] = r.astype(np.float32)
        manifest["cases"].append({"name": name, "config": config, "seed": seed, "dtype": dtype,
                                  "safetensors_sha256": digest, "prompts": prompts})
        print(f"{name:28} {dtype:>8} {scale:10.4f} {gap:9.2e} {diff:10.2e}")
    args.out.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(args.out / "hf_golden.npz", **arrays)
    (args.out / "hf_golden.json").write_text(json.dumps(manifest, indent=1) + "\n")
    size = sum((args.out / f).stat().st_size for f in ("hf_golden.npz", "hf_golden.json"))
    print(f"wrote {args.out}/hf_golden.{{json,npz}} ({size / 1024:.0f} KiB)", file=sys.stderr)


if __name__ == "__main__":
    run(main)
