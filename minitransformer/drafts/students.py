"""Three drafts distilled side by side from one start: soft labels against hard, and a cache.

The draft is the target's first `layers` layers with the last one's MLP block trained
(training.py); the rest is the target's own, frozen. The block starts as a copy of the
target's last MLP block (start "own": the cut's own block, the untrained cut). Three students
from that one start see the same batches with the same Adam: one learns the teacher's soft
labels at T = 1, one at T = 2 (distill.py's T^2-scaled KL), one its hard labels (cross-entropy
on the argmax). Training text: a stretch of the 1911 Britannica article on Shakespeare after
the 2,049 tokens experiment 21 scores (or the start of a text file); held-out text: its last
tokens, never trained on. On the held-out text each student's KL to the teacher, top-1
agreement, and the acceptance rate alpha it reaches as a draft: sampling (sum of min(p, q))
and greedy (agreement with the teacher's own greedy continuations of held-out prompts).

The teacher's pass over the text and the trained students are cached under weights/drafts/
(one file each per model and setting), so experiments 22 and 23 reuse them: ``distilled``.
Leaves out: printing (the scripts' tables), other student shapes than training.py's.
"""
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from minitransformer.backend import to_numpy
from minitransformer.checkpoints.synth import weights_dir, writable
from minitransformer.drafts import training as tr
from minitransformer.measure.quality import agreement, reference_tokens
from minitransformer.measure.text import TextUnavailable, britannica_text
from minitransformer.measure.timing import quiet
from minitransformer.speculative import first_layers

VERSION = "draft-distillation-v1"      # bump when the training changes what it produces
SCORED_BY_EXP21 = 2049                 # experiment 21's tokens: the start of the article
WINDOW = 256                           # each window of text is one sequence from position 0
PROMPT = 64                            # tokens of each held-out prompt for greedy alpha
STUDENTS = {"soft, T = 1": tr.Labels("soft", 1.0), "soft, T = 2": tr.Labels("soft", 2.0),
            "hard": tr.Labels("hard")}
START = "start: the last layer's MLP block"
SHORT = {"cut": "untrained cut", "soft1": "soft, T = 1", "soft2": "soft, T = 2", "hard": "hard"}


@dataclass(frozen=True)
class Settings:
    layers: int = 6            # the draft: the target's first `layers`, the last one's MLP trained
    steps: int = 200
    batch: int = 32
    lr: float = 2e-3
    train_tokens: int = 4096   # positions of training text (steps * batch may pass over them again)
    held_tokens: int = 512     # held-out positions, for KL, top-1 and sampling alpha
    prompts: int = 2           # held-out prompts whose greedy continuation gives greedy alpha
    new_tokens: int = 32       # greedy tokens per prompt
    eval_every: int = 25
    seed: int = 0
    start: str = "last"        # the trained block starts as: "own" layer's, or the "last" one's
    text: str = ""             # a text file to train and test on; "": the Britannica article


@dataclass(frozen=True)
class Distilled:
    settings: Settings
    params: dict               # student name -> trained piece (training.PIECE names)
    figures: dict              # 'untrained cut' and each student -> kl, top1, alpha, greedy
    curve: list                # [step, {student: held-out KL}] from step 0 (the start)
    losses: dict               # student -> its training loss over the last eval_every steps
    train_range: tuple         # token positions of the article trained on, and held out
    held_range: tuple


def students_file(target, settings: Settings) -> Path:
    """Where the trained students of this target and settings are cached."""
    return cache_file(target, settings.__dict__, "students")


def distilled(target, settings: Settings, retrain: bool = False, progress=quiet) -> Distilled:
    """The three students for this target and settings: from the cache (students_file), else
    trained now and cached."""
    file = students_file(target, settings)
    if file.is_file() and not retrain:
        return load(file, settings)
    result = distil(target, settings, progress)
    save(file, result)
    return result


def cache_file(target, settings: dict, what: str) -> Path:
    """weights/drafts/<model>-<what>-<layers>-layers-<digest of model and settings>.npz"""
    path = Path(target.path or "model")
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    key = json.dumps([VERSION, str(path.resolve()), [f.stat().st_size for f in files if
                      f.exists()], settings], sort_keys=True)
    digest = hashlib.sha1(key.encode()).hexdigest()[:12]
    return weights_dir() / "drafts" / (f"{path.name}-{what}-{settings['layers']}-layers-"
                                       f"{digest}.npz")


def save_npz(file: Path, arrays: dict) -> None:
    writable(file.parent)                 # one line naming the folder where it cannot be
    partial = file.with_suffix(".partial.npz")
    np.savez(partial, **arrays)
    partial.rename(file)  # a complete file or none: an interrupted run leaves no bad cache


def text_ranges(n_tokens: int, settings: Settings):
    """Token ranges of the article: training after experiment 21's tokens, held out at the end.
    """
    skip = 0 if settings.text else SCORED_BY_EXP21
    train = (skip, skip + settings.train_tokens)
    held = (n_tokens - settings.held_tokens - settings.prompts * PROMPT, n_tokens)
    if held[0] < train[1]:
        raise ValueError(f"{source(settings)} gives {n_tokens} tokens: too few for "
                         f"{settings.train_tokens} training and {held[1] - held[0]} held-out "
                         f"(use --train-tokens and --held-tokens)")
    return train, held


def inputs_over(target, k, ids, tick):
    """Windows of WINDOW tokens through the target -> the draft's inputs and the teacher's
    final hidden states, (len(ids), D) each."""
    parts = []
    for a in range(0, len(ids), WINDOW):
        parts.append(tr.draft_inputs(target, k, ids[a:a + WINDOW]))
        tick(f"{a + len(ids[a:a + WINDOW])} positions")
    return (np.concatenate([h for h, _ in parts]), np.concatenate([f for _, f in parts]))


def training_text(s: Settings) -> str:
    if s.text:
        return Path(s.text).read_text(encoding="utf-8")
    try:
        return britannica_text()
    except TextUnavailable as e:
        raise ValueError(str(e)) from None


def teacher_outputs(target, s: Settings, progress=quiet):
    """The text through the teacher, cached beside the drafts: -> dict with the draft's inputs
    h and the teacher's final hidden states for the training and held-out positions, the
    held-out prompts with the teacher's greedy continuations, and the token ranges used."""
    key = {k: getattr(s, k) for k in ("layers", "train_tokens", "held_tokens", "prompts",
                                      "new_tokens", "text")}
    file = cache_file(target, key, "teacher")
    if file.is_file():
        with np.load(file) as data:
            return {k: data[k] for k in data.files}
    if target.tokenizer is None:
        raise ValueError(f"{target.path}: no tokenizer.json, cannot tokenize the training text")
    ids = np.asarray(target.tokenizer.encode(training_text(s)))
    train_range, held_range = text_ranges(len(ids), s)
    train_ids = ids[slice(*train_range)]
    held_ids = ids[held_range[0]:held_range[0] + s.held_tokens]
    prompts = [ids[held_range[0] + s.held_tokens + i * PROMPT:][:PROMPT]
               for i in range(s.prompts)]
    windows = -(-len(train_ids) // WINDOW) + -(-len(held_ids) // WINDOW)
    tick = progress(windows, "teacher over the text")
    out = {"train_range": np.array(train_range), "held_range": np.array(held_range),
           "prompts": np.array(prompts)}
    out["h"], out["teacher"] = inputs_over(target, s.layers, train_ids, tick)
    out["h_held"], out["teacher_held"] = inputs_over(target, s.layers, held_ids, tick)
    tick = progress(s.prompts, "teacher's greedy continuations of held-out prompts")
    continuations = []
    for prompt in prompts:
        continuations.append(reference_tokens(target, prompt.tolist(), s.new_tokens))
        tick()
    out["continuations"] = np.array(continuations)
    save_npz(file, out)
    return out


def source(s: Settings) -> str:
    return s.text or "the 1911 Britannica article on Shakespeare"


def distil(target, s: Settings, progress=quiet) -> Distilled:
    t = teacher_outputs(target, s, progress)
    h, teacher, h_held, teacher_held = t["h"], t["teacher"], t["h_held"], t["teacher_held"]
    continuations = [(p.tolist(), c.tolist())
                     for p, c in zip(t["prompts"], t["continuations"], strict=True)]
    train_range, held_range = tuple(t["train_range"].tolist()), tuple(t["held_range"].tolist())
    frozen = tr.Frozen.of(target)
    z_held = tr.teacher_logits(frozen, teacher_held)                   # (held, V)
    held = tr.teacher_distributions(z_held)   # the teacher's side, once for every closeness

    def figures(params):
        draft = tr.draft_model(target, s.layers, params)
        kept = sum(agreement(draft, p, c) for p, c in continuations)
        return tr.closeness(params, frozen, h_held, z_held, teacher=held) | {
            "greedy": kept / (len(continuations) * s.new_tokens)}

    own = tr.start_params(target, s.layers - 1)
    assert np.array_equal(  # the cut's own block: the untrained cut, exactly
        to_numpy(tr.draft_model(target, s.layers, own).layers[-1].down),
        to_numpy(first_layers(target, s.layers).layers[-1].down))
    figures_of = {"untrained cut": figures(own)}
    start = own if s.start == "own" else tr.start_params(target,
                                                         target.config.num_hidden_layers - 1)
    if s.start != "own":
        figures_of[START] = figures(start)
    kl0 = figures_of[START if s.start != "own" else "untrained cut"]["kl"]
    curve = [[0, {name: kl0 for name in STUDENTS}]]
    running: dict[str, list[float]] = {name: [] for name in STUDENTS}
    tick, ticked = progress(s.steps, "training steps, three students side by side"), 0

    def on_step(step, params, losses):
        nonlocal ticked
        for name, loss in losses.items():
            running[name] = (running[name] + [loss])[-s.eval_every:]
        if step % s.eval_every == 0 or step == s.steps:
            kls = {name: tr.closeness(p, frozen, h_held, z_held, teacher=held)["kl"]
                   for name, p in params.items()}
            curve.append([step, kls])
            tick("held-out KL " + ", ".join(f"{n} {v:.3f}" for n, v in kls.items()),
                 done=step - ticked)
            ticked = step

    params = tr.train(STUDENTS, start, frozen, h, teacher,
                      tr.Schedule(s.steps, s.batch, s.lr, s.seed), on_step)
    tick = progress(len(STUDENTS), "held-out figures")
    for name, p in params.items():
        figures_of[name] = figures(p)
        tick(name)
    losses = {name: float(np.mean(v)) for name, v in running.items()}
    return Distilled(s, params, figures_of, curve, losses, train_range, held_range)


def save(file: Path, d: Distilled) -> None:
    arrays = {f"{i}/{k}": w for i, name in enumerate(STUDENTS) for k, w in d.params[name].items()}
    meta = {"figures": d.figures, "curve": d.curve, "losses": d.losses,
            "train_range": d.train_range, "held_range": d.held_range}
    save_npz(file, arrays | {"meta": np.array(json.dumps(meta))})


def load(file: Path, settings: Settings) -> Distilled:
    with np.load(file) as data:
        meta = json.loads(str(data["meta"]))
        params = {name: {k: data[f"{i}/{k}"] for k in tr.PIECE}
                  for i, name in enumerate(STUDENTS)}
    return Distilled(settings, params, meta["figures"], meta["curve"], meta["losses"],
                     tuple(meta["train_range"]), tuple(meta["held_range"]))


def drafts_of(target, d: Distilled, chosen) -> list:
    """-> [(label, a function making the draft Model)] for the chosen SHORT names ('cut': the
    untrained cut of the same depth, the trained drafts' common start)."""
    k, L = d.settings.layers, target.config.num_hidden_layers
    made: list[tuple[str, Callable]] = []
    for short in chosen:
        name = SHORT[short]
        if short == "cut":
            made.append((f"first {k} of {L} layers", lambda: first_layers(target, k)))
        else:
            made.append((f"first {k}, distilled ({name})",
                         lambda name=name: tr.draft_model(target, k, d.params[name])))
    return made
