"""Experiment 22, the measured half: speculative decoding on this CPU, and what it gains.

The drafts: prompt lookup (proposals copied from earlier in the text, minitransformer/lookup.py:
no draft model, c = 0), quantized copies of the target (--schemes; their matmuls run on the
codes, quant/matmul.py), the target's own first half of layers (an early-exit draft), and
drafts distilled from the target (minitransformer/drafts/students.py: its first few layers,
the last one's MLP trained on the target's soft or hard labels), beside the untrained cut of
the same depth.
The task has repetition, where copying pays: the model is asked to rewrite a given passage.

1. v(n): one target pass over n + 1 new positions (n proposals and the last token), in
   single-token decode steps, measured side by side. The chapter's formula takes v = 1 (a GPU
   step reads the weights once either way); on a CPU a pass over more rows costs more.
2. Plain greedy generation: the reference tokens, and the time to beat.
3. Per draft: alpha and c, then the predicted speedup of every gamma, and the gamma with the
   best one. Model drafts: alpha = agreement with greedy's tokens (teacher-forced), c = a draft
   step over a target step, measured; speedup = E(alpha, gamma) / (gamma c + v(gamma)). Prompt
   lookup: its rounds replayed on greedy's tokens (exact, since the kept tokens are greedy's),
   each round priced at the v of its proposals.
4. Measured: speculative generation at the chosen gamma against plain greedy, side by side,
   --repeats rounds, each round plain greedy once and then every draft (all compared with the
   same plain runs); every run's tokens compared with plain greedy's (==).
"""
import argparse

import numpy as np

from _common import (
    Progress,
    add_draft_arguments,
    add_model_argument,
    add_schemes_argument,
    add_threads_argument,
    distilled_drafts,
    draft_settings,
    load_model,
    model_name,
    positive_int,
    positive_ints,
    run,
    say,
    timing_header,
)
from _table import Table
from bench_spec_serving import crossover, prime, prompts, side_by_side

import minitransformer as mt
from minitransformer.drafts.students import SHORT, drafts_of
from minitransformer.kvcache import KVCache
from minitransformer.lookup import PASSAGE, PromptLookup, rewrite_prompt
from minitransformer.measure.quality import agreement, reference_tokens
from minitransformer.measure.sanity import (
    NOISE_FLOOR,
    conclude,
    merged,
    recheck,
    rests_on,
    speedup_bound,
    unsteady,
    unsteady_line,
)
from minitransformer.measure.timing import step_with_rollback, time_together, verification_timings
from minitransformer.model import forward
from minitransformer.serve.config import SpeculativeConfig
from minitransformer.shape import decode_read_bytes
from minitransformer.speculative import first_layers, speculative_generate
from quant.qmodel import SCHEMES, quantize_model
from sim.speculative import (
    batched_speedup,
    best_gamma,
    best_lookup_gamma,
    expected_tokens,
    fit_weight_rows,
    speedup,
)


def disagree(t_plain, t_spec):
    """A message if either side's repeats disagree beyond the stated spread, quoting the two
    speedups the table prints (from the fastest runs and from the medians)."""
    doubts = unsteady_line(["plain", "speculative"], [t_plain, t_spec], scale=1, unit="s",
                           fmt=".2f")
    if not doubts:
        return None
    return (f"speedup {t_plain.best / t_spec.best:.2f}x from the fastest runs, "
            f"{t_plain.median / t_spec.median:.2f}x from the medians: {doubts}; too noisy to "
            "conclude")


def v_falls(passes) -> dict:
    """v(n) must not fall as n grows (a pass over more positions does more work): {n: message}
    for each v(n) below v(n - 1) beyond the noise floor, quoting v as the header prints it."""
    v = [1.0] + [t.best / passes[0].best for t in passes[1:]]
    return {n: f"v({n}) = {v[n]:.2f} below v({n - 1}) = {v[n - 1]:.2f}: a pass over more "
               "positions cannot be cheaper" for n in range(1, len(v))
            if v[n] < v[n - 1] * (1 - NOISE_FLOOR)}


def v_of(passes) -> dict:
    """{n: v(n)}, n = 1..len(passes) - 1: a pass over n + 1 positions over one decode step."""
    return {n: passes[n].best / passes[0].best for n in range(1, len(passes))}


def decode_step(model, ids) -> tuple:
    """(step, rollback): the decode step of ids[-1] on a cache prefilled with ids[:-1]."""
    kv = KVCache.allocate(model.config, 1, len(ids) + 1)
    forward(model, np.array([ids[:-1]]), kv)
    return step_with_rollback(model, kv, np.array([ids[-1:]]))         # (1, 1)


def draft_cost(target_step, draft, ids, repeat) -> float:
    """c: one decode step of the draft over one of the target, timed side by side.
    target_step: decode_step(target, ids), prefilled once for every draft (the same prompt)."""
    (t_target, undo_t), (t_draft, undo_d) = target_step, decode_step(draft, ids)
    times = time_together([t_target, t_draft], repeat=repeat, after=[undo_t, undo_d])
    return times[1].best / times[0].best


def distilled_choice(text):
    """argparse type: --distilled, names from students.SHORT, or 'none'."""
    names = [] if text == "none" else [n for n in text.split(",") if n]
    unknown = [n for n in names if n not in SHORT]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown distilled draft(s) {', '.join(unknown)}; "
                                         f"choose from {', '.join(SHORT)}, or none")
    return names


def parser_of() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_argument(parser, default="smollm2")
    add_schemes_argument(parser, default=["int8-row", "int4-g128", "nf4"])
    add_threads_argument(parser)
    parser.add_argument("--new-tokens", type=positive_int, default=96,
                        help="tokens generated (default: %(default)s)")
    parser.add_argument("--max-gamma", type=positive_int, default=8,
                        help="largest draft length considered (default: %(default)s)")
    parser.add_argument("--repeats", type=positive_int, default=3,
                        help="timed rounds of each generation, side by side (default: %(default)s)")
    parser.add_argument("--no-layers-draft", action="store_true",
                        help="leave out the first-half-of-layers draft")
    parser.add_argument("--distilled", type=distilled_choice, default=list(SHORT),
                        help="distilled drafts (drafts/students.py; trained once, then cached): "
                             f"comma-separated from {', '.join(SHORT)}, or none "
                             "(default: all)")
    parser.add_argument("--serving-batches", type=positive_ints, default=None, metavar="B,..",
                        help="also serve the rewrite task with prompt lookup in the engine at "
                             "these batch sizes, beside the formula's prediction (default: "
                             "the prediction only)")
    add_draft_arguments(parser)
    return parser


def drafts_to_try(target, args) -> list:
    """[(label, a function making the draft Model)]: the quantized copies, the first half of
    the layers, the distilled drafts."""
    drafts = [(SCHEMES[s].label, lambda s=s: quantize_model(target, s)) for s in args.schemes]
    L = target.config.num_hidden_layers
    if not args.no_layers_draft and L > 1:
        drafts.append((f"first {L // 2} of {L} layers", lambda: first_layers(target, L // 2)))
    settings = draft_settings(args)
    if args.distilled and L > settings.layers:
        drafts += drafts_of(target, distilled_drafts(target, settings, args.retrain),
                            args.distilled)
    return drafts


def predicted(target, ids, plain, v, args) -> list:
    """Per draft: (label, draft, alpha, c (time), c (bytes), gamma, predicted tokens/pass,
    predicted speedup), prompt lookup first."""
    lookup = PromptLookup()
    g, rounds, speedup_at_g = best_lookup_gamma(ids + plain, len(ids), v, lookup)
    kept, judged = sum(k for _, k in rounds), sum(k + (k < p) for p, k in rounds)
    rows = [("prompt lookup", lookup, kept / judged if judged else float("nan"), 0.0, 0.0,
             g, (kept + len(rounds)) / len(rounds), speedup_at_g)]
    target_bytes = decode_read_bytes(target.config, target.weights)
    target_step = decode_step(target, ids + plain[:1])
    drafts = drafts_to_try(target, args)
    progress = Progress(len(drafts), "drafts")
    for label, make in drafts:
        draft = make()
        alpha = agreement(draft, ids, plain) / len(plain)
        c = draft_cost(target_step, draft, ids + plain[:1], args.repeats)
        c_bytes = decode_read_bytes(draft.config, draft.weights) / target_bytes
        g = best_gamma(alpha, c, v)
        rows.append((label, draft, alpha, c, c_bytes, g, expected_tokens(alpha, g),
                     speedup(alpha, g, c, v[g])))
        progress(f"{label}: alpha {alpha:.3f}, c {c:.2f}, best gamma {g}")
    return rows


def races(target, ids, plain, rows, repeats) -> list:
    """Every draft at its gamma against plain greedy, side by side: each round runs plain
    greedy once and then every draft's speculative generation (plain greedy is the common
    baseline, timed once a round rather than once a draft) -> per row (result, speedup from the
    fastest runs, from the medians, tokens identical, warning). Rows whose speedup beats its
    ceiling, or whose repeats disagree, are measured again (every row, in the same rounds)."""
    n, results = len(plain), {}
    progress = Progress(len(rows) * repeats, "speculative runs", more=len(rows))  # per round

    def spec(i, row):
        label, draft, _, _, _, g, _, _ = row

        def run():
            results[i] = speculative_generate(target, draft, ids, n, gamma=g, eos_token_id=[])
        return run

    def ran(row):  # untimed, after each speculative run
        return lambda: progress(f"{row[0]}, gamma {row[5]}")

    def flagged(timings):  # a speedup above what the kept tokens allow: a disturbed plain run
        t_plain, specs = timings[0], timings[1:]    # or repeats that disagree: a busy machine
        return {i: m for i, (row, t) in enumerate(zip(rows, specs, strict=True))
                if (m := speedup_bound(t_plain.best / t.best, results[i].tokens_per_pass,
                                       row[5], row[3]) or disagree(t_plain, t))}
    fns = [lambda: mt.generate(target, ids, n, eos_token_id=[])] + [
        spec(i, row) for i, row in enumerate(rows)]
    timings, warnings = recheck(lambda previous: time_together(
        fns, warmup=0, repeat=repeats, after=[None] + [ran(row) for row in rows]), flagged)
    t_plain = timings[0]
    return [(results[i], t_plain.best / t.best, t_plain.median / t.median,
             results[i].tokens == plain, (warnings or {}).get(i))
            for i, t in enumerate(timings[1:])]


def table_of(target, ids, plain, verification, rows, measured, header) -> Table:
    """verification: (passes, warnings) of v(n), as main measured them."""

    def x(value):
        return f"{value:.2f}x"

    (passes, v_warnings), v = verification, v_of(verification[0])
    G, n = len(passes) - 1, len(plain)
    table = Table(f"Experiment 22 (measured): speculative decoding, {model_name(target)}",
                  experiment=22, columns=[
                      ("draft", ""), ("alpha", ".3f"), ("c time", ".2f"), ("c bytes", ".3f"),
                      ("gamma", "d"), ("tokens/pass pred.", ".2f"), ("tokens/pass meas.", ".2f"),
                      ("speedup pred.", x), ("speedup meas.", x), ("median", x), ("same", "")])
    table.header(f"task: rewrite a {len(PASSAGE.split())}-word passage; {len(ids)}-token prompt, "
                 f"{n} new tokens, greedy", header,
                 "v(n): one target pass over n + 1 positions, in one-token decode steps "
                 "(the chapter's formula: 1)",
                 "  " + "  ".join(f"n={k}: {value:.2f}" for k, value in v.items()),
                 "  passes, fastest / median ms: " + "  ".join(
                     f"n={k}: {t.best * 1e3:.1f} / {t.median * 1e3:.1f}"
                     for k, t in enumerate(passes)),
                 *(f"  WARNING: {m}" for m in v_warnings.values()),
                 "c: a draft step over a target step, as time here and as weight bytes read",
                 conclude("gamma", "gamma: the draft length with the best predicted speedup on "
                          "these costs", rests_on([f"v({k})" for k in range(G + 1)], passes,
                                                  v_warnings, range(G + 1))))
    for (label, _, alpha, c, c_bytes, g, tpp, pred), (r, best, median, same, warning) in zip(
            rows, measured, strict=True):
        table.row(label, alpha, c, c_bytes, g, tpp, r.tokens_per_pass, pred, best, median,
                  "yes" if same else "NO", warning=warning)
    table.note("alpha: per-proposal acceptance (lookup: kept / (kept + rejections) in its "
               "rounds; models: agreement with greedy)",
               "pred.: lookup from its rounds replayed on greedy's tokens, each priced at v; "
               "models E(alpha, gamma) / (gamma c + v(gamma))",
               "meas.: best of the rounds (median beside), plain and speculative side by side; a "
               "measured speedup above tokens/pass / (gamma c + 1) is measured again, then "
               "flagged",
               "tokens identical to plain greedy in every run: "
               f"{'yes' if all(m[3] for m in measured) else 'NO'}")
    table.plot("draft", ["speedup pred.", "speedup meas."], "speculative decoding: predicted "
               "and measured speedup per draft", kind="bar",
               xlabel="draft", ylabel="speedup over plain greedy (x)")
    return table


def main(argv=None):
    args = parser_of().parse_args(argv)
    header = timing_header(args)
    target = load_model(args.model)
    ids = rewrite_prompt(target)
    n, G = args.new_tokens, args.max_gamma
    say(f"[1/4] plain greedy: {n} tokens after a {len(ids)}-token prompt ...")
    plain = reference_tokens(target, ids, n)
    say(f"[2/4] v(n): verification passes over 2..{G + 1} positions ...")
    passes, v_warnings = recheck(
        lambda _: verification_timings(target, ids + plain, G, args.repeats),
        lambda t: merged(v_falls(t), unsteady(range(G + 1), t, "pass over n = ")))
    say("[3/4] drafts: alpha, c, predicted speedup per gamma ...")
    rows = predicted(target, ids, plain, v_of(passes), args)
    say(f"[4/4] measured: every draft at its gamma against plain greedy, {args.repeats} rounds "
        "side by side")
    measured = races(target, ids, plain, rows, args.repeats)
    for row, (_, best, _, same, _) in zip(rows, measured, strict=True):
        say(f"  {row[0]}, gamma {row[5]}: {best:.2f}x, "
            f"tokens {'identical' if same else 'DIFFERENT'}")
    table_of(target, ids, plain, (passes, v_warnings), rows, measured, header).show()
    served = serving(target, ids, plain, v_of(passes), args)
    return 0 if all(m[3] for m in measured) and served else 1


def serving(target, ids, plain, v, args) -> bool:
    """The lookup in the serving engine: the formula's speedup per batch size (a pass over R
    rows costing W + R, W fitted to v(n): sim.speculative.batch_verify_cost) and, with
    --serving-batches, the engine's measured one beside it (bench_spec_serving) -> whether
    every stream got the same tokens both ways."""
    lookup = PromptLookup()
    g, rounds, _ = best_lookup_gamma(ids + plain, len(ids), v, lookup)
    tpp = sum(k + 1 for _, k in rounds) / len(rounds)
    W = fit_weight_rows(v)
    proposed = sum(p for p, _ in rounds) / len(rounds)
    batches = args.serving_batches or [1, 2, 4, 8, 16, 32, 64]
    predicted = {B: batched_speedup(tpp, proposed, B, W) for B in batches}
    table = Table("Experiment 22 (served): prompt lookup in the engine against batch size",
                  experiment=22, columns=[("streams", "d"), ("speedup pred.", ""),
                                          ("speedup meas.", ""), ("same", "")])
    measured, exact = {}, True
    if args.serving_batches:
        prime(target)
        config = SpeculativeConfig(num_speculative_tokens=g, prompt_lookup_max=lookup.max_ngram,
                                   prompt_lookup_min=lookup.min_ngram)
        ids = prompts(target, "rewrite", max(batches))
        progress = Progress(len(batches), "batch sizes")
        for B in batches:
            measured[B] = side_by_side(target, ids[:B], args.new_tokens, config, args.repeats)
            progress(f"{B} streams: {measured[B].speedup:.2f}x, same tokens "
                     f"{measured[B].same}/{B}")
            exact &= measured[B].same == B
    for B in batches:
        r = measured.get(B)
        table.row(B, f"{predicted[B]:.2f}x", "" if r is None else
                  f"{r.speedup:.2f}x" if r.same == B else "tokens differ",
                  "" if r is None else f"{r.same}/{B}")
    guess = next((B for B in batches if predicted[B] < 1), None)
    table.header(f"gamma {g}, {tpp:.2f} tokens and {proposed:.2f} proposals a pass (its rounds "
                 f"replayed); a pass over R rows costs W + R, W = {W:.2f} fitted to v(n)",
                 "measured: the engine's decode time, plain over speculating "
                 "(bench_spec_serving.py), same tokens or no figure")
    table.note("crossover (speedup below 1): predicted "
               + (f"{guess} streams" if guess else f"none up to {batches[-1]}")
               + ("; measured " + (f"{crossover(measured)} streams" if crossover(measured)
                                   else f"none up to {batches[-1]}") if measured else
                  "; --serving-batches 1,2,4,8,16 measures it"))
    table.show()
    return exact


if __name__ == "__main__":
    run(main)
