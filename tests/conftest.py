"""Shared test fixtures: tiny random checkpoints of every shape the loader supports, the one
comparison helper (shape, then dtype, then values), and the one way to run a script.

scripts/ is on the import path (setup.cfg's pythonpath), so a test imports a script's helpers
by the script's name."""
import importlib
import time
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


@pytest.fixture
def run_script(capsys):
    """run_script(name, *args, status=0) -> (stdout, stderr) of scripts/<name>.py, run in this
    process as its __main__ runs it (through _common.run: a library error is one 'error:' line
    on stderr and exit status 2). The exit status must be `status`. A test starts a process of
    its own only where the process is the point (the status and stderr a shell sees)."""
    from _common import run

    def run_one(name, *args, status=0):
        module = importlib.import_module(name.removesuffix(".py"))
        capsys.readouterr()  # what came before is not this script's
        with pytest.raises(SystemExit) as done:
            run(lambda: module.main([str(a) for a in args]))
        out, err = capsys.readouterr()
        assert (done.value.code or 0) == status, f"{name} exited {done.value.code}: {err[-2000:]}"
        return out, err
    return run_one


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


# ---------------------------------------------------------------- batched tokens vs alone
# The exactness policy of batching (serve/engine.py, "Exactness"). batch_invariant=True: a batched
# request gets exactly the tokens generate gives it alone (==). The default fast batching multiplies
# the batch as one flat matrix, which moves logits in their last bits (on the tiny models, about
# 1e-6); a token may then differ only at a step where the solo run was that close to choosing
# another: greedy, its top two logits within NEAR_TIE; sampled, its draw within NEAR_TIE of a
# boundary of the cumulative distribution. From there on the two runs are different sequences.
NEAR_TIE = 1e-4
NEAR_TIES = []  # (prompt length, step, margin) of every divergence allowed, reported at the end
CHECKED = []    # every fast-mode comparison made, so the report says how many were made


def solo_margins(model, prompt, tokens, settings, seed):
    """How close the solo run came, at each step, to choosing another token -> (n,) floats.

    Logits of one full forward over prompt + tokens (within float rounding of the cached run),
    the repetition penalty applied; the draws replayed from the request's seed.
    """
    from minitransformer.generate import logits as full_logits
    from minitransformer.sampling import apply_repetition_penalty, probabilities
    seen = list(prompt)
    every = full_logits(model, seen + list(tokens))[len(prompt) - 1:]       # (n(+1), V)
    rng, margins = np.random.default_rng(seed), []
    for step, token in enumerate(tokens):
        logits = apply_repetition_penalty(every[step], seen, settings.repetition_penalty)
        if settings.greedy:
            top_two = np.sort(logits)[-2:]
            margins.append(float(top_two[1] - top_two[0]))
        else:
            cumulative = np.cumsum(probabilities(logits, settings))
            point = rng.random() * cumulative[-1]
            margins.append(float(np.abs(cumulative - point).min()))
        seen.append(token)
    return np.array(margins)


def assert_like_solo(model, tokens, solo_tokens, prompt, settings=None, seed=None,
                     batch_invariant=False, tolerance=NEAR_TIE):
    """Batched tokens against generate's tokens for the same request alone, by the policy."""
    from minitransformer.sampling import SamplingSettings
    tokens, solo_tokens = list(tokens), list(solo_tokens)
    if batch_invariant:
        assert tokens == solo_tokens
        return
    CHECKED.append(len(tokens))
    if tokens == solo_tokens:
        return
    step = next(i for i, (a, b) in enumerate(zip(tokens + [None], solo_tokens + [None]))
                if a != b)
    assert step < min(len(tokens), len(solo_tokens)), \
        f"same tokens up to step {step}, then one run stopped and the other did not"
    margin = solo_margins(model, prompt, solo_tokens[:step + 1], settings or SamplingSettings(),
                          seed)[step]
    assert margin <= tolerance, (f"token {step} differs from the solo run's, whose margin there "
                                 f"was {margin:.2e} > {tolerance:.0e}: not a near tie")
    NEAR_TIES.append((len(prompt), step, margin))


def pytest_terminal_summary(terminalreporter):
    if CHECKED:
        terminalreporter.write_line(
            f"fast batching: {len(CHECKED)} batched requests ({sum(CHECKED)} tokens) compared "
            f"with generate alone; {len(NEAR_TIES)} diverged, each at a near tie "
            f"(margin <= {NEAR_TIE:.0e}) {NEAR_TIES if NEAR_TIES else ''}")


def fake_clock(*readings):
    """A clock that returns the given readings, one per call."""
    it = iter(readings)
    return lambda: next(it)


def clock_of_durations(*durations):
    """A fake clock whose successive timed calls last the given durations."""
    readings, now = [], 0.0
    for d in durations:
        readings += [now, now + d]
        now += d + 1
    return fake_clock(*readings)


def wait_for(condition, timeout=20.0):
    """Poll a condition another thread makes true; fail after timeout seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)
