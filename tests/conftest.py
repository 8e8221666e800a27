"""Shared test fixtures: tiny random checkpoints of every shape the loader supports, the one
comparison helper (shape, then dtype, then values), and the one way to run a script.

scripts/ is on the import path (setup.cfg's pythonpath), so a test imports a script's helpers
by the script's name."""
import copy
import importlib
import os
import time
from dataclasses import replace
from pathlib import Path

# pytest -n N (setup.cfg's -n auto: one worker per core) runs N processes at once: each, and each
# process a test starts, on one BLAS thread, as make -j runs one job per core (a BLAS thread
# waiting for a busy core stalls the product). Before NumPy loads its BLAS, which reads these.
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if WORKERS > 1:
    for name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(name, "1")

import numpy as np
import pytest
import threadpoolctl

from minitransformer import load
from minitransformer.kernels import threads

# Every test runs its products whole on one thread, whatever the machine's cores, unless it asks
# for more (step_threads): what a test computes never follows the cores it ran on. A process a
# test starts takes its own setting (the cores it may use, or the MT_THREADS it is given).
threads.set_count(1, "the tests", blas=False)
from minitransformer.checkpoints.synth import llama_config, make_checkpoint, qwen2_config

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

# A model of close calls, for the fuzz (not one of tiny_model's): the tied models above mostly
# repeat their last token, by a margin of about a quarter of their largest logit, so a wrong
# logit seldom changes one of their tokens. This one has an untied head over 512 tokens (its
# median top-two gap is a few hundredths of its largest logit) and a final norm whose gain is
# scaled by CLOSE_CALLS_GAIN: logits that small make a logit error of a given size change a
# token that many times more often. Rounding shrinks with them (NEAR_TIE is relative).
CLOSE_CALLS = {"qwen2-close-calls": (qwen2_config(vocab_size=512, tie_word_embeddings=False),
                                     "bfloat16")}
CLOSE_CALLS_GAIN = 1 / 16


def write_checkpoint(path, name, seed) -> Path:
    """Write the checkpoint of a model of SHAPES or CLOSE_CALLS -> its path."""
    from minitransformer.checkpoints.synth import random_weights
    from minitransformer.formats.safetensors_io import write_tensors
    config, dtype = (SHAPES | CLOSE_CALLS)[name]
    path = make_checkpoint(path, config, seed=seed, dtype=dtype)
    if name in CLOSE_CALLS:
        weights = random_weights(config, seed)
        weights["model.norm.weight"] *= CLOSE_CALLS_GAIN
        write_tensors(path / "model.safetensors", weights, dtype)
    return path


# Each model's weights come from its own seed, whatever test makes it first: a test run alone
# and the same test in the whole suite see the same model (they did not when the seed was the
# order of making). The seeds are the ones the whole suite's order gave: no weight changed.
SEEDS = {name: seed for seed, name in enumerate(sorted(SHAPES) + sorted(CLOSE_CALLS), start=1)}


# The BLAS pools loaded with NumPy, and the thread count each started with.
BLAS = threadpoolctl.ThreadpoolController().select(user_api="blas").lib_controllers
if WORKERS > 1:                 # NumPy may have been loaded before the line above ran
    for lib in BLAS:
        lib.set_num_threads(int(os.environ["OPENBLAS_NUM_THREADS"]))
BLAS_THREADS = [lib.num_threads for lib in BLAS]


@pytest.fixture(autouse=True)
def blas_threads_kept():
    """Every test starts at the BLAS thread count the session started with, and fails if it
    leaves another: a script run in this process (run_script) with --threads fixes the count
    for the rest of the process, and the tests after it (a tuning key, a timing) would run
    under a count that depends on the order."""
    yield
    left = [lib.num_threads for lib in BLAS]
    for lib, count in zip(BLAS, BLAS_THREADS, strict=True):
        lib.set_num_threads(count)
    assert left == BLAS_THREADS, f"the test left BLAS at {left} threads, not {BLAS_THREADS}"


@pytest.fixture(autouse=True)
def threads_kept():
    """Every test ends at the threads setting the session began with (threads.py): a script
    or command run in this process with --threads sets it for the rest of the process."""
    from minitransformer.kernels import threads
    before = threads.count(), threads.SET_BY
    yield
    if (threads.count(), threads.SET_BY) != before:
        threads.set_count(*before, blas=False)   # BLAS's own: blas_threads_kept


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def step_threads(request, monkeypatch):
    """The test at 1 and at 2 threads, whatever the machine's cores: threads.py's setting and
    BLAS's own threads both, and at 2 every product of a step split in 2 parts across the
    pool (MT_SPLIT=parts: not left to what this machine measures)."""
    from minitransformer.kernels import blas, threads
    before = threads.count(), threads.SET_BY
    threads.set_count(request.param, "the test")
    monkeypatch.setattr(blas, "FIXED_SPLIT", "parts" if request.param > 1 else "whole")
    yield request.param
    threads.set_count(*before, blas=False)
    for lib, n in zip(BLAS, BLAS_THREADS, strict=True):
        lib.set_num_threads(n)


@pytest.fixture(autouse=True)
def rows_expected_kept():
    """Every test ends with the row counts blas.py lays weights out for as the session began: a
    server started in this process (http.serve) adds its max_num_seqs for the rest of the
    process, and a model loaded after it would be laid out, and multiplied, otherwise than one
    loaded before (the same weights, other last bits)."""
    from minitransformer.kernels import blas
    before = set(blas.rows_run)
    yield
    blas.rows_run.clear()
    blas.rows_run.update(before)


@pytest.fixture(scope="session")
def checkpoint_dir(tmp_path_factory):
    """name -> path of a generated checkpoint (made once per session, from SEEDS[name])."""
    root = tmp_path_factory.mktemp("checkpoints")
    made = {}

    def make(name):
        if name not in made:
            made[name] = write_checkpoint(root / name, name, seed=SEEDS[name])
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


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct, loaded once per session, when imported into weights/; else skip."""
    from minitransformer.checkpoints.real_model import NAME, is_imported
    from minitransformer.checkpoints.synth import weights_dir
    path = weights_dir() / NAME
    if not is_imported(path):
        pytest.skip(f"{path} not imported (python3 scripts/import_gguf.py --smollm2)")
    return load(path)


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
        # --threads holds for the rest of a script's process; here, for the script alone
        with pytest.raises(SystemExit) as done, threadpoolctl.threadpool_limits(None):
            run(lambda: module.main([str(a) for a in args]))
        out, err = capsys.readouterr()
        assert (done.value.code or 0) == status, f"{name} exited {done.value.code}: {err[-2000:]}"
        return out, err
    return run_one


# --- fixtures more than one test file uses -------------------------------------------------
# Here, where pytest finds them for every test file below: a fixture imported into a test file
# would be a second definition of it there. A file with a fixture of the same name (a `model`
# of its own) overrides these.

@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """The server tests' model (tests/serve/test_server_*.py): a tiny Qwen2 with a real
    byte-level BPE tokenizer and a chat template (servers.TEMPLATE)."""
    import json

    from minitransformer.checkpoints.synth import train_tokenizer
    from servers import TEMPLATE
    path = make_checkpoint(tmp_path_factory.mktemp("served"), qwen2_config(vocab_size=320),
                           tokenizer=train_tokenizer(300))
    settings = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps(settings | {"chat_template":
                                                                       TEMPLATE}))
    return load(path)


@pytest.fixture(scope="module")
def served(model):
    """(online engine, url, OpenAI client) of a server of `model` in this process, one per test
    file (servers.Background)."""
    from minitransformer.serve.config import EngineConfig
    from minitransformer.serve.engine import Engine
    from minitransformer.serve.http import create_app
    from minitransformer.serve.online import OnlineEngine
    from servers import NAME, Background, openai
    online = OnlineEngine(Engine(model, EngineConfig(max_num_seqs=4, num_gpu_blocks_override=48,
                                                     block_size=4,  # 192 tokens
                                                     batch_invariant=True),
                                 history=True))   # records read back
    server = Background(create_app(online, NAME))
    yield online, server.url, openai.OpenAI(base_url=server.url + "/v1", api_key="none",
                                            max_retries=0)
    server.stop()
    online.close()


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    """(metadata entries, tensors) of a valid GGUF file (tests/gguf_files.py): qwen2 (CONFIG),
    a tokenizer, F32 and Q8_0 weights, no general.alignment (the default 32)."""
    from gguf_files import CONFIG, gguf_parts, write_gguf
    from minitransformer.checkpoints.synth import random_weights, train_tokenizer
    path = tmp_path_factory.mktemp("gguf") / "valid.gguf"
    weights = random_weights(CONFIG)
    types = {name: "Q8_0" if name.endswith("up_proj.weight") else "F32" for name in weights}
    write_gguf(path, CONFIG, weights, types=types, tokenizer=train_tokenizer(300))
    entries, tensors = gguf_parts(path)
    assert all(e[0] != "general.alignment" for e in entries)
    return entries, tensors


@pytest.fixture(scope="module")
def kquant_parts(tmp_path_factory):
    """(metadata entries, tensors) of a valid GGUF file of K_CONFIG with the K_TYPES matrices
    (tests/gguf_files.py)."""
    from gguf_files import K_CONFIG, K_TYPES, gguf_parts, write_gguf
    from minitransformer.checkpoints.synth import random_weights
    path = tmp_path_factory.mktemp("gguf") / "kquants.gguf"
    weights = random_weights(K_CONFIG)
    types = {f"model.layers.0.{m}.weight": t for m, t in K_TYPES.items()}
    write_gguf(path, K_CONFIG, weights, types={n: types.get(n, "F32") for n in weights})
    return gguf_parts(path)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A tiny target and a different draft over 6 tokens (untied heads, so they disagree), for
    speculative decoding's tests (tests/test_speculative.py, tests/serve/)."""
    config = qwen2_config(vocab_size=6, hidden_size=32, intermediate_size=64,
                          num_hidden_layers=1, tie_word_embeddings=False)
    root = tmp_path_factory.mktemp("pair")
    return (load(make_checkpoint(root / "target", config, seed=1)),
            load(make_checkpoint(root / "draft", config, seed=2)))


# A story model has no chat template; this one makes a conversation one running story.
STORY_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['content'] }}"
                  "{% if not loop.last %} {% endif %}{% endfor %}")


@pytest.fixture(scope="module")
def story_chat_model(tmp_path_factory, stories):
    """stories260K with a chat template added to its tokenizer_config.json (the command line's
    tests: tests/test_cli.py, tests/test_ctrl_c.py)."""
    import json
    import shutil

    path = tmp_path_factory.mktemp("stories-chat")
    for file in Path(stories.path).iterdir():
        shutil.copy(file, path / file.name)
    settings = json.loads((path / "tokenizer_config.json").read_text())
    settings["chat_template"] = STORY_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(settings))
    return load(path)


@pytest.fixture(scope="module")
def tiny_chat_model(tmp_path_factory):
    """A tiny random Qwen2 with a byte-level tokenizer and a chat template (always present; the
    command line's tests)."""
    import json

    from minitransformer.checkpoints.synth import train_tokenizer

    path = make_checkpoint(tmp_path_factory.mktemp("tiny-chat"), qwen2_config(vocab_size=320),
                           tokenizer=train_tokenizer(300))
    settings = json.loads((path / "tokenizer_config.json").read_text())
    settings["chat_template"] = "<|endoftext|>" + STORY_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(settings))
    return load(path)


# A test comparing a command's text with generate's does so by ==. The route a product of a few
# rows takes into BLAS is measured once per process (blas.py), and the routes sum in different
# orders (stories260K's logits differ by up to 1.1e-5 between them), so two processes left to
# measure agree only by luck. Both sides take the flat route: the same BLAS calls on the same
# shapes, the same bits, the same tokens, and == is exact. The command gets ONE_ROUTE in its
# environment; the test's own process, flat_products (pytest.mark.usefixtures("flat_products")).
ONE_ROUTE = {"MT_PRODUCTS": "flat"}


@pytest.fixture
def flat_products(monkeypatch):
    """This process multiplies as the commands it runs do (ONE_ROUTE)."""
    from minitransformer.kernels import blas

    monkeypatch.setattr(blas, "FIXED", ONE_ROUTE["MT_PRODUCTS"])


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
# The exactness policy of batching (docs/serving.md, "Exactness"). batch_invariant=True: a batched
# request gets exactly the tokens generate gives it alone (==). The default fast batching multiplies
# the batch as one flat matrix, a cached prefix was computed inside another sequence's pass, a
# chunked prefill computes the prompt in pieces, and a cached decode is not a recompute: each moves
# logits in their last bits. A token may then differ only at a step where the reference run was
# that close to choosing another: where moving every logit by at most NEAR_TIE x the step's
# largest |logit| could change its choice (greedy: its top two logits; sampled: its draw and a
# boundary of the cumulative distribution, or a top-k / top-p cut, both through the logits). The
# rest of the request is then checked against the reference run continued from the token taken.
#
# The window is 4x the largest rounding measured: scripts/dev/measure_rounding.py computes the test
# models' sequences under each call shape (cached decode, fast batched decode, cached prefix,
# chunked prefill, batch-invariant decode) and compares each step's logits with one full forward
# pass over the sequence (docs/testing.md has its tables). On the tiny models the largest
# |difference| is 5.6e-7 of the step's largest |logit| (4.7 float32 eps; 3.0e-7 absolute on
# logits up to 0.84, 9.3e-9 on the close-calls model's logits up to 0.035: the difference
# follows the logits' scale, so the window is relative to it), under SkylakeX (OpenBLAS's own
# choice on this AVX-512 EPYC, OPENBLAS_CORETYPE unset), OPENBLAS_CORETYPE=Haswell, Sandybridge
# and Prescott, and MT_PRODUCTS=rows, flat, slices and dots (the 5.6e-7 is dots': 5.62e-7; and
# 4.7e-7 for test_quant_model's nf4, int8-row and int4-row models, cached decode against one
# pass). The pretrained stories260K, five layers of logits up to 23, rounds more: 4.6e-6.
NEAR_TIE = 4 * 5.6e-7
STORIES_NEAR_TIE = 4 * 4.6e-6
# The draw compares a float32 cumulative sum with the point drawn: within a few of its units in
# the last place of 1.0 the order is float32 rounding of the sum itself, whatever the logits.
CDF_ROUNDING = 8 * float(np.finfo(np.float32).eps)
NEAR_TIES = []  # (prompt length, step, relative margin) of every divergence allowed, reported
CHECKED = []    # every fast-mode comparison made, so the report says how many were made


def logit_margin(logits, seen, settings, rng) -> float:
    """How close one step came to choosing another token: the smallest change of every logit
    (at most this much each) that could change the choice, over the step's largest |logit|.

    Greedy: half the gap of the top two. Sampled (one draw from ``rng``, as the run drew it):
    moving each logit by at most e moves log(C / (1 - C)) of every boundary C of the cumulative
    distribution, and of the mass before each top-p candidate, by at most 2 e / temperature, and
    a top-k cut only where the k-th and next logits are within 2 e. A repetition penalty
    scales a change by at most the penalty (or its inverse, below 1).
    """
    from minitransformer.sampling import apply_repetition_penalty, probabilities
    z = apply_repetition_penalty(np.asarray(logits, dtype=np.float64), seen,
                                 settings.repetition_penalty)
    stretch = max(settings.repetition_penalty, 1 / settings.repetition_penalty)
    scale = float(np.abs(logits).max()) or 1.0
    if settings.greedy:
        top_two = np.sort(z)[-2:]
        return float(top_two[1] - top_two[0]) / 2 / stretch / scale
    cumulative = np.cumsum(probabilities(z.astype(np.float32), settings))
    point = rng.random() * cumulative[-1]
    if np.abs(cumulative - point).min() <= CDF_ROUNDING:
        return 0.0
    half_t = float(settings.temperature) / 2
    margins = [half_t * np.abs(log_odds(cumulative) - log_odds(point)).min()]
    if 0 < settings.top_k < z.size:
        ordered = np.sort(z)[::-1]
        margins.append((ordered[settings.top_k - 1] - ordered[settings.top_k]) / 2)
    if settings.top_p < 1.0:
        p = np.sort(probabilities(z.astype(np.float32), replace(settings, top_p=1.0)))[::-1]
        before = np.cumsum(p) - p
        margins.append(half_t * np.abs(log_odds(before) - log_odds(settings.top_p)).min())
    return float(min(margins)) / stretch / scale


def log_odds(c):
    """log(c / (1 - c)); the ends 0 and 1 (no boundary there) go to infinity."""
    c = np.asarray(c, dtype=np.float64)
    inside = (c > 0) & (c < 1)
    safe = np.where(inside, c, 0.5)
    return np.where(inside, np.log(safe) - np.log1p(-safe), np.copysign(np.inf, c - 0.5))


def solo_margins(model, prompt, tokens, settings, rng):
    """How close the reference run came, at each step, to choosing another token -> (n,) relative
    margins (``logit_margin``). Logits of one full forward over prompt + tokens (within float
    rounding of any cached run); the draws taken from ``rng`` (the run's own generator, advanced
    one draw per sampled step)."""
    from minitransformer.generate import logits as full_logits
    seen = list(prompt)
    every = full_logits(model, seen + list(tokens))[len(prompt) - 1:]       # (n(+1), V)
    margins = []
    for step, token in enumerate(tokens):
        margins.append(logit_margin(every[step], seen, settings, rng))
        seen.append(token)
    return np.array(margins)


def solo_cached(model, prompt, tokens) -> np.ndarray:
    """The logits generate picks each of tokens from (prompt whole, then one token at a time
    over a contiguous KVCache) -> (n, V): the solo run's very bits."""
    from minitransformer.generate import last_logits
    from minitransformer.kvcache import KVCache
    kv = KVCache.allocate(model.config, 1, len(prompt) + len(tokens))
    rows = [last_logits(model, np.array([prompt]), kv)[0]]
    for token in tokens[:-1]:
        rows.append(last_logits(model, np.array([[token]]), kv)[0])
    return np.array(rows)


def solo_continuation(model, prompt, n, settings, rng, eos) -> list:
    """The reference run continued from prompt (the request's prompt and the tokens so far): at
    most n tokens, each from one full forward pass, chosen by generate's rule with the run's own
    generator, stopping after an eos id."""
    from minitransformer.generate import logits as full_logits
    from minitransformer.sampling import next_token
    seen, made = list(prompt), []
    while len(made) < n and not (made and made[-1] in eos):
        made.append(next_token(full_logits(model, seen)[-1], seen, settings, rng))
        seen.append(made[-1])
    return made


def assert_like_solo(model, tokens, solo_tokens, prompt, settings=None, seed=None,
                     batch_invariant=False, tolerance=NEAR_TIE, eos_token_id=None):
    """Tokens from one call shape (batched, chunked, cached) against the reference run's for the
    same request (generate alone), by the policy. eos_token_id as generate's (None: the model's)."""
    from minitransformer.generate import eos_ids, seeded_rng
    from minitransformer.sampling import GREEDY
    settings = settings or GREEDY
    tokens, reference = list(tokens), list(solo_tokens)
    if batch_invariant:
        assert tokens == reference
        return
    CHECKED.append(len(tokens))
    rng, done = seeded_rng(seed), 0            # the reference's generator; tokens checked
    limit, eos = max(len(tokens), len(reference)), eos_ids(model, eos_token_id)
    while tokens[done:] != reference:
        rest = tokens[done:]
        # the first step they differ at, None past the end of either: the shorter one (its None)
        # ends the pairing
        step = next(i for i, (a, b) in enumerate(zip(rest + [None], reference + [None],
                                                    strict=False))
                    if a != b)
        assert step < min(len(rest), len(reference)), \
            f"same tokens up to step {done + step}, then one run stopped and the other did not"
        margin = solo_margins(model, list(prompt) + tokens[:done], reference[:step + 1],
                              settings, rng)[step]
        assert margin <= tolerance, (
            f"token {done + step} differs from the reference run's, whose margin there was "
            f"{margin:.2e} of its largest |logit| > {tolerance:.1e}: not a near tie")
        NEAR_TIES.append((len(prompt), done + step, margin))
        done += step + 1
        reference = solo_continuation(model, list(prompt) + tokens[:done], limit - done,
                                      settings, copy.deepcopy(rng), eos)


def pytest_sessionfinish(session):
    """An xdist worker hands its near-tie counts to the controller, which reports them all."""
    if hasattr(session.config, "workeroutput"):
        # as plain Python numbers: execnet's wire takes no NumPy scalar (a margin is one)
        session.config.workeroutput["near_tie"] = (
            [int(n) for n in CHECKED],
            [(int(length), int(step), float(margin)) for length, step, margin in NEAR_TIES])


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    checked, near_ties = getattr(node, "workeroutput", {}).get("near_tie", ([], []))
    CHECKED.extend(checked)
    NEAR_TIES.extend(map(tuple, near_ties))


def pytest_terminal_summary(terminalreporter):
    if CHECKED:
        terminalreporter.write_line(
            f"near-tie rule: {len(CHECKED)} requests ({sum(CHECKED)} tokens) compared with "
            f"their reference run; {len(NEAR_TIES)} diverged, each at a near tie (margin <= "
            f"{NEAR_TIE:.1e} of the step's largest |logit|) {NEAR_TIES if NEAR_TIES else ''}")


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
