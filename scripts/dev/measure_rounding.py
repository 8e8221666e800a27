"""How far the logits of one sequence move between call shapes: the figure the tests' near-tie
window (tests/conftest.py, NEAR_TIE) is derived from.

The same sequences are computed five ways, each step's logits compared with those of one full
forward pass over the sequence so far (``minitransformer.logits``, the pass the near-tie rule
reads its margins from):

    solo cached     generate's shapes: the prompt in one pass, then one token at a time over
                    a KVCache
    fast batched    the engine's default decode, the batch as one flat matrix per projection
                    (4 slots, no prefix cache, prompts whole)
    cached prefix   the engine with prefix caching: a prompt's shared blocks computed inside
                    an earlier request's pass
    chunked         the engine with chunked prefill (a budget of 5 tokens a step)
    batch-invariant the engine's exact mode (per-row products): the bits of a solo run

The models: the tiny random ones of tests/conftest.py and the pretrained stories260K (when
../shared/models has it), whose five layers round more. Printed per model: the largest
|logit difference| of each shape, the logits' scale (the largest |logit| seen) and the largest
difference over its step's largest |logit| (the figure NEAR_TIE is a multiple of). Run it
under each kernel (OPENBLAS_CORETYPE=Haswell, Sandybridge, ...; docs/testing.md has the
tables). The engine's logits are read where it picks a token from them (``Recording``).
"""
import argparse
import os
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: _common, _table

from _common import progress

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
import minitransformer as mt
from conftest import CLOSE_CALLS, SHAPES, STORIES, solo_cached, write_checkpoint
from minitransformer.measure.timing import blas_kernel
from minitransformer.sampling import SamplingSettings
from minitransformer.serve.config import EngineConfig
from minitransformer.serve.engine import Engine
from minitransformer.serve.records import Request

BASE = EngineConfig(max_num_seqs=4, block_size=4, enable_prefix_caching=False)
ENGINES = {"fast batched": BASE,
           "cached prefix": replace(BASE, enable_prefix_caching=True),
           "chunked": replace(BASE, max_num_batched_tokens=5),
           "batch-invariant": replace(BASE, batch_invariant=True)}
SHAPE_NAMES = ("solo cached", *ENGINES)


class Recording(Engine):
    """The engine, keeping every logits vector it picked a token from: (id, step, logits)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen = []

    def _sample(self, live, logits, token=None):
        self.seen.append((live.result.id, len(live.result.tokens), np.array(logits)))
        super()._sample(live, logits, token)


def workload(vocab_size, requests, new_tokens, seed) -> list:
    """Requests sharing prompt prefixes (so the prefix cache hits), greedy and sampled."""
    rng = np.random.default_rng(seed)
    stem = rng.integers(0, vocab_size, 9).tolist()
    sampled = SamplingSettings(do_sample=True, temperature=0.8)
    return [Request(tuple(stem[:int(rng.integers(0, 10))]
                          + rng.integers(0, vocab_size, int(rng.integers(1, 12))).tolist()),
                    new_tokens, sampling=sampled if i % 2 else SamplingSettings(),
                    seed=i, eos_token_id=[])
            for i in range(requests)]


def one_pass(model, prompt, tokens) -> np.ndarray:
    """The logits each token was picked from, by one full forward pass -> (n, V)."""
    return mt.logits(model, list(prompt) + list(tokens))[len(prompt) - 1:len(prompt) - 1
                                                         + len(tokens)]


def differences(logits, reference) -> tuple:
    """(n, V) against the one-pass (n, V) -> (largest |difference|, largest |difference| over
    its step's largest |logit|)."""
    difference = np.abs(logits - reference).max(axis=-1)                 # (n,)
    return float(difference.max()), float((difference / np.abs(reference).max(axis=-1)).max())


def rounding_of(model, requests) -> dict:
    """-> {shape: (largest |logit difference| from one pass, largest relative to the step's
    largest |logit|)}, plus 'scale': the largest |logit|."""
    reference, figures = {}, {}
    for name, config in ENGINES.items():
        engine = Recording(model, config)
        run = engine.run(requests)
        for result in run.results:
            if result.id not in reference:
                reference[result.id] = one_pass(model, result.request.prompt, result.tokens)
        figures[name] = tuple(map(max, zip(*(
            differences(logits, reference[rid][step]) for rid, step, logits in engine.seen),
            strict=True)))
        if name == "fast batched":
            figures["solo cached"] = tuple(map(max, zip(*(
                differences(solo_cached(model, list(r.request.prompt), r.tokens),
                            reference[r.id]) for r in run.results), strict=True)))
    figures["scale"] = max(float(np.abs(z).max()) for z in reference.values())
    return figures


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=12, help="requests per workload")
    parser.add_argument("--tokens", type=int, default=16, help="new tokens per request")
    parser.add_argument("--workloads", type=int, default=3, help="workloads (seeds) per model")
    known = [*SHAPES, *CLOSE_CALLS] + ["stories260K"] * (STORIES / "model.safetensors").is_file()
    parser.add_argument("--models", default=",".join(known),
                        help="the test models (default: %(default)s; stories260K when "
                             "../shared/models has it)")
    args = parser.parse_args(argv)
    if min(args.requests, args.tokens, args.workloads) < 1:
        parser.error("--requests, --tokens and --workloads must be >= 1")
    names = [n for n in args.models.split(",") if n]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        parser.error(f"unknown model(s) {', '.join(unknown) or '(none)'}; "
                     f"choose from {', '.join(known)}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, name in enumerate(names, 1):
            model = mt.load(STORIES if name == "stories260K" else
                            write_checkpoint(os.path.join(tmp, name), name, seed=1))
            runs = [rounding_of(model, workload(model.config.vocab_size, args.requests,
                                            args.tokens, seed))
                    for seed in range(args.workloads)]
            rows.append((name, {k: max(r[k] for r in runs) for k in runs[0]}))
            progress(i, len(names), name)
    print(f"Logits of one sequence under each call shape against one full forward pass "
          f"(kernel {blas_kernel()}; {args.workloads} workloads x {args.requests} requests x "
          f"{args.tokens} tokens per model): the largest |difference|, and the largest over "
          f"its step's largest |logit|")
    print()
    print(f"{'model':<22}" + "".join(f"{c:>16}" for c in SHAPE_NAMES)
          + f"{'|logit| max':>13}{'relative':>10}")
    for name, f in rows:
        relative = max(f[c][1] for c in SHAPE_NAMES)
        print(f"{name:<22}" + "".join(f"{f[c][0]:>16.2e}" for c in SHAPE_NAMES)
              + f"{f['scale']:>13.4f}{relative:>10.2e}")
    worst = max(f[c][0] for _, f in rows for c in SHAPE_NAMES)
    relative = max(f[c][1] for _, f in rows for c in SHAPE_NAMES)
    print()
    print(f"largest over all: {worst:.2e} absolute; {relative:.2e} of the step's largest "
          f"|logit| ({relative / np.finfo(np.float32).eps:.1f} float32 eps)")


if __name__ == "__main__":
    from _common import run
    run(main)
