"""Experiment 23: distillation's soft labels, and what the temperature does to them.

The teacher's next-token distribution for a prompt (default "She poured the milk into the"):
the top tokens at T = 1 and T = 2, and the ratio of the top token's probability to the third's
at each (the chapter: jug 0.1355, cup 0.1051, bowl 0.0605, large 0.0380, milk 0.0360; top /
third 2.24 at T = 1, 1.50 at T = 2, its square root). Then the distillation loss
T^2 KL(p_T || q_T) of a student against this teacher over every position of the prompt, at a
few temperatures, with the size of its gradient with and without the T^2. The student is the
teacher's own first half of layers (an untrained half-depth starting point).

Then the claim put to work (minitransformer/drafts/students.py; train_draft.py trains them
alone): drafts distilled from the teacher on its soft labels (T = 1 and T = 2) and on its hard
labels, from the same start with the same budget, judged on held-out text by their KL to the
teacher, top-1 agreement and acceptance rate as a speculative draft, with held-out KL against
training steps (trained once, then cached).

On the default model (random weights) the labels mean nothing; the arithmetic is the same. With
--model pointing at a trained checkpoint (stories260K, Qwen2.5-0.5B) they are real.
"""
import argparse

import numpy as np

from _common import (
    add_draft_arguments,
    add_model_argument,
    add_threads_argument,
    distilled_drafts,
    draft_settings,
    load_model,
    model_name,
    numbers,
    timing_header,
)
from _table import Table

import minitransformer as mt
from minitransformer.drafts.distill import (
    distillation_grad,
    distillation_loss,
    rank_ratio,
    soft_labels,
    top_tokens,
)
from minitransformer.drafts.students import SCORED_BY_EXP21, STUDENTS, Distilled, source
from minitransformer.speculative import first_layers
from minitransformer.tokenizer import encode_prompt


def continuation(tokenizer, ids, new) -> str:
    """The text token(s) `new` add after the prompt (keeps the leading space a lone token
    loses when decoded on its own)."""
    new = [int(t) for t in np.atleast_1d(new)]
    before, after = tokenizer.decode(ids), tokenizer.decode(list(ids) + new)
    return after[len(before):] if after.startswith(before) else tokenizer.decode(new)


def word(model, ids, token) -> str:
    """The whole word a (sub-word) token starts, completed greedily: ' p' -> ' pot'."""
    more = mt.generate(model, list(ids) + [int(token)], 4, eos_token_id=[])
    text = continuation(model.tokenizer, ids, [int(token)] + more)
    cut = len(text) - len(text.lstrip())                       # keep the leading space
    return text[:cut] + text[cut:].split(" ")[0].split("\n")[0]


def training_table(target, d: Distilled) -> Table:
    s = d.settings
    L = target.config.num_hidden_layers
    table = Table(f"Distilled drafts: the first {s.layers} of {L} layers of "
                  f"{model_name(target)}, the last one's MLP trained", experiment=23,
                  chapter=False, columns=[
                      ("draft", ""), ("train loss", ".4f"), ("held-out KL", ".4f"),
                      ("top-1 agreement", ".3f"), ("alpha sampling", ".3f"),
                      ("alpha greedy", ".3f")])
    start = ("the untrained cut" if s.start == "own" else f"layer {s.layers - 1}'s MLP block "
             f"replaced by a copy of layer {L - 1}'s")
    table.header(f"same start ({start}), same {s.steps} Adam steps of {s.batch} "
                 f"positions (lr {s.lr:g}), same batches; only the labels differ",
                 f"training: tokens {d.train_range[0]:,}..{d.train_range[1]:,} of {source(s)}"
                 + ("" if s.text else f" (after the {SCORED_BY_EXP21:,} experiment 21 scores)")
                 + f"; held out: tokens {d.held_range[0]:,}..{d.held_range[1]:,}, never "
                 "trained on")
    for name, f in d.figures.items():
        table.row(name, d.losses.get(name), f["kl"], f["top1"], f["alpha"], f["greedy"])
    table.note("train loss: each student's own loss (T^2 KL or cross-entropy), mean of its "
               f"last {s.eval_every} steps",
               f"held-out KL: KL(teacher || draft) at T = 1 over {s.held_tokens} positions; "
               "top-1: the argmaxes agree there",
               "alpha sampling: mean sum min(p, q), the per-token acceptance under Leviathan's "
               "rule; alpha greedy: agreement with the teacher's own greedy continuations of "
               f"{s.prompts} held-out prompts ({s.prompts * s.new_tokens} tokens)",
               *verdict(d.figures))
    return table


# (figure, what it is, True when higher is better)
MEASURES = [("kl", "held-out KL", False), ("alpha", "alpha sampling", True),
            ("top1", "top-1", True), ("greedy", "alpha greedy", True)]


def verdict(figures) -> list:
    """The comparison as measured: the better soft student against the hard one, per measure,
    and why soft labels may lose where they do."""
    best = min((n for n in STUDENTS if n != "hard"), key=lambda n: figures[n]["kl"])
    soft, hard = figures[best], figures["hard"]
    wins = {label: (soft[key] > hard[key]) == higher and soft[key] != hard[key]
            for key, label, higher in MEASURES}

    def better(key, label):
        return "equal" if soft[key] == hard[key] else "soft" if wins[label] else "hard"
    lines = [f"soft ({best}) against hard: " + "; ".join(
        f"{label} {soft[key]:.4f} against {hard[key]:.4f} ({better(key, label)}"
        f"{'' if soft[key] == hard[key] else ' better'})" for key, label, _ in MEASURES)]
    lost = [label for label, won in wins.items() if not won]
    if not lost:
        lines.append("soft labels beat hard labels on every measure here")
        return lines
    lines.append(f"soft labels do NOT beat hard labels here on {', '.join(lost)}. Why that may "
                 "be: the student (one MLP block on a few layers) stays far from the teacher; "
                 "the T^2 KL spends its few parameters on the whole distribution, the tail "
                 "included, while cross-entropy on the argmax spends them on the one token "
                 "top-1 and a greedy draft are judged by; and a few minutes of training is far "
                 "from convergence")
    return lines


def curve_table(d: Distilled) -> Table:
    names = list(STUDENTS)
    table = Table("Held-out KL to the teacher against training steps", experiment=23,
                  chapter=False, columns=[("step", "d")] + [(f"KL {n}", ".4f") for n in names])
    table.header("KL(teacher || draft) at T = 1 on the held-out text; step 0 is the start, "
                 "the same for all")
    for step, kls in d.curve:
        table.row(step, *[kls[n] for n in names])
    table.plot("step", [f"KL {n}" for n in names], "held-out KL to the teacher, soft and "
               "hard students", logy=True, xlabel="training step",
               ylabel="KL(teacher || draft) (nats per token)")
    return table


def labels_table(teacher, ids, z, args) -> Table:
    """The teacher's top tokens after the prompt at T = 1 and T = 2; z its logits (T, V)."""
    p1, p2 = soft_labels(z[-1], 1.0), soft_labels(z[-1], 2.0)        # (V,) each
    top1, _ = top_tokens(p1, args.top)
    top2, _ = top_tokens(p2, args.top)

    table = Table(f"Experiment 23: soft labels, next token after {args.prompt!r}",
                  experiment=23, columns=[("rank", "d"), ("T = 1", ""), ("p", ".4f"),
                                          ("T = 2", ""), ("p at T = 2", ".4f"),
                                          ("the word it starts (greedy)", "")])
    table.random_weights(teacher)
    for rank, (a, b) in enumerate(zip(top1, top2, strict=True), 1):
        table.row(rank, repr(continuation(teacher.tokenizer, ids, a)), float(p1[a]),
                  repr(continuation(teacher.tokenizer, ids, b)), float(p2[b]),
                  repr(word(teacher, ids, a)))
    r1, r2 = rank_ratio(p1), rank_ratio(p2)
    table.note(f"top / third: {r1:.2f} at T = 1, {r2:.2f} at T = 2 "
               f"(square root of {r1:.2f} = {np.sqrt(r1):.2f}); same order: "
               f"{'yes' if top1.tolist() == top2.tolist() else 'no'}",
               f"hard label: {continuation(teacher.tokenizer, ids, top1[0])!r}; the soft label "
               f"spreads {1 - p1[top1[0]]:.4f} of the mass over the other tokens at T = 1, "
               f"{1 - p2[top2[0]]:.4f} at T = 2")
    return table


def loss_table(teacher, ids, z, temperatures) -> Table:
    """The distillation loss of the teacher's first half of layers, with its gradient's size."""
    student = first_layers(teacher, max(1, teacher.config.num_hidden_layers // 2))
    s = mt.logits(student, ids)                                       # (T, V) student logits
    table = Table(f"Distillation loss over the prompt's {len(ids)} positions, student = the "
                  f"teacher's first {student.config.num_hidden_layers} of "
                  f"{teacher.config.num_hidden_layers} layers", experiment=23, chapter=False,
                  columns=[("T", "g"), ("KL(p_T || q_T)", ".5f"), ("T^2 KL (loss)", ".5f"),
                           ("|grad|", ".5f"), ("|grad| without T^2", ".6f")])
    for T in temperatures:
        loss = distillation_loss(s, z, T)
        grad = float(np.linalg.norm(distillation_grad(s, z, T)))
        table.row(T, loss / T**2, loss, grad, grad / T**2)
    return table


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_argument(parser, default="smollm2")
    parser.add_argument("--prompt", default="She poured the milk into the", help="prompt text")
    parser.add_argument("--top", type=int, default=5, help="tokens shown (default: 5)")
    parser.add_argument("--temperatures", type=numbers, default="1,2,4,8",
                        help="temperatures of the loss table, comma-separated")
    parser.add_argument("--no-training", action="store_true",
                        help="leave out the distilled drafts (drafts/students.py)")
    add_threads_argument(parser)
    add_draft_arguments(parser)
    args = parser.parse_args(argv)
    header = timing_header(args)
    temperatures = args.temperatures
    if not all(0 < t < float("inf") for t in temperatures):
        parser.error(f"every temperature must be a finite number > 0, got {args.temperatures}")

    teacher = load_model(args.model)
    ids = encode_prompt(teacher, args.prompt)
    if not 3 <= args.top <= teacher.config.vocab_size:
        parser.error(f"--top must be in [3, {teacher.config.vocab_size}]")
    z = mt.logits(teacher, ids)                                       # (T, V) teacher logits
    labels_table(teacher, ids, z, args).show()
    loss_table(teacher, ids, z, temperatures).show()

    settings = draft_settings(args)
    if args.no_training or teacher.config.num_hidden_layers <= settings.layers:
        return 0
    d = distilled_drafts(teacher, settings, args.retrain)
    training_table(teacher, d).header(header).random_weights(teacher).show()
    curve_table(d).show()
    return 0


if __name__ == "__main__":
    from _common import run
    run(main)
