"""Fused q/k/v and gate/up (fused.py): the same numbers as the checkpoint's matrices, held once."""
from dataclasses import replace
from pathlib import Path

import numpy as np

from minitransformer.backend import to_device, to_numpy
from minitransformer.linear import linear
from minitransformer.loader import load_weights
from minitransformer.model import Model
from minitransformer.shape import tensor_shapes
from minitransformer.speculative import first_layers
from quant.qmodel import quantize_model


def test_the_stacks_hold_the_checkpoint_s_matrices_once(tiny_model):
    c, w = tiny_model.config, tiny_model.weights
    assert set(w) == set(tensor_shapes(c))            # every checkpoint name, no fused ones
    stored = {name: to_numpy(a) for name, a in  # what the checkpoint holds, unfused
              load_weights(Path(tiny_model.path), c).items()}
    for i, layer in enumerate(tiny_model.layers):
        p = f"model.layers.{i}."
        q, k, v = (stored[f"{p}self_attn.{m}_proj.weight"] for m in "qkv")
        assert np.array_equal(to_numpy(layer.qkv), np.concatenate([q, k, v]))
        gate, up = stored[p + "mlp.gate_proj.weight"], stored[p + "mlp.up_proj.weight"]
        assert np.array_equal(to_numpy(layer.gate_up), np.concatenate([gate, up]))
        for name in ("self_attn.k_proj.weight", "mlp.up_proj.weight"):  # views, not copies
            assert np.array_equal(to_numpy(w[p + name]), stored[p + name])
            assert w[p + name].base is (layer.qkv if "attn" in name else layer.gate_up)
        if c.qkv_bias:
            assert np.array_equal(to_numpy(layer.qkv_bias), np.concatenate(
                [stored[f"{p}self_attn.{m}_proj.bias"] for m in "qkv"]))


def test_a_model_made_from_another_shares_or_restacks(tiny_model):
    draft = first_layers(tiny_model, 1)                     # same weights: shared, not copied
    assert draft.layers[0].qkv is tiny_model.layers[0].qkv and len(draft.layers) == 1
    name = "model.layers.0.self_attn.v_proj.weight"
    edited = replace(tiny_model, weights={**tiny_model.weights,
                                          name: tiny_model.weights[name] * 2})
    assert edited.layers[0].qkv is not tiny_model.layers[0].qkv  # a changed part: new stack
    assert np.array_equal(to_numpy(edited.weights[name]), 2 * to_numpy(tiny_model.weights[name]))
    assert np.array_equal(to_numpy(tiny_model.weights[name]) * 2,  # the old model is untouched
                          to_numpy(edited.layers[0].qkv[-len(edited.weights[name]):]))


def test_quantized_parts_stay_apart_and_multiply_as_one(tiny_model):
    q = quantize_model(tiny_model, "int8-row")
    stacked = q.layers[0].gate_up
    x = to_device(np.random.default_rng(0).standard_normal(
        (2, 3, tiny_model.config.hidden_size), dtype=np.float32))
    gate, up = (q.weights[f"model.layers.0.mlp.{m}_proj.weight"] for m in ("gate", "up"))
    expected = np.concatenate([to_numpy(linear(x, gate)), to_numpy(linear(x, up))], axis=-1)
    assert np.array_equal(to_numpy(linear(x, stacked)), expected)
    assert isinstance(q, Model) and len(stacked.parts) == 2


def test_every_matrix_multiplied_is_laid_out_as_mt_layout_says():
    """fuse lays out the stacks, o, down and the head (blas.arrange): under MT_LAYOUT every one
    of them in that layout (what bench_serving's before server runs), the same values."""
    import os
    import subprocess
    import sys
    code = ("from minitransformer.kernels.blas import layout\n"
            "from minitransformer.checkpoints.synth import qwen2_config, random_model\n"
            "m = random_model(qwen2_config())\n"
            "l = m.layers[0]\n"
            "print(sorted({layout(w) for w in (l.qkv, l.o, l.gate_up, l.down,"
            " m.weights['model.embed_tokens.weight'])}))\n")
    for fixed in ("row-major", "column-major"):
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=120, env=dict(os.environ, MT_LAYOUT=fixed))
        assert done.returncode == 0, done.stderr
        assert done.stdout.split("\n")[0] == repr([fixed])
