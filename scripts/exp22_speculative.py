"""Experiment 22, the measured half: speculative decoding on this CPU, and what it gains.

The drafts: prompt lookup (proposals copied from earlier in the text, minitransformer/lookup.py:
no draft model, c = 0), quantized copies of the target (--schemes; their matmuls run on the
codes, quant/matmul.py) and the target's own first half of layers (an early-exit draft).
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
   --repeats rounds; every run's tokens compared with plain greedy's (==).
"""
import argparse

import numpy as np

from _common import (add_model_argument, add_schemes_argument, add_threads_argument,
                     load_model, mt, positive_int, progress, run, say, timing_header)
from minitransformer.kvcache import KVCache
from minitransformer.lookup import PromptLookup, replay
from minitransformer.measure import time_together
from minitransformer.model import forward, head
from minitransformer.shape import decode_read_bytes
from minitransformer.speculative import first_layers, speculative_generate
from quant.evaluate import agreement, reference_tokens
from quant.qmodel import SCHEMES, quantize_model
from sim.speculative import best_gamma, expected_tokens, replayed_speedup, speedup

# Written for this project: a passage to be copied (the task where prompt lookup shines).
PASSAGE = ("The lighthouse stood on a rock at the mouth of the bay. Every evening the keeper "
           "climbed its one hundred and twelve steps, trimmed the wick, polished the lens and "
           "lit the lamp. Ships far out at sea saw the light turn once every ten seconds and "
           "knew where the rocks were. In the morning he put the lamp out, wrote the weather "
           "in his book, and went down the steps to make his breakfast.")
TASK = "Rewrite the following passage exactly, word for word:\n\n"


def rewrite_prompt(model, passage=PASSAGE) -> list[int]:
    """The rewrite task as token ids: through the chat template when the model has one."""
    if model.tokenizer is None:
        raise ValueError(f"{model.path}: no tokenizer.json, cannot encode the task")
    if model.tokenizer.chat_template:
        return model.tokenizer.chat_prompt([{"role": "user", "content": TASK + passage}])
    return model.tokenizer.encode(TASK + passage + "\n\n")


def step_costs(model, ids, largest: int, repeat: int) -> dict:
    """{n: time of one pass over n + 1 new positions / time of a one-token step}, n = 1..largest.

    Each pass runs on a cache holding `ids` and is rolled back after (KVCache.trim), head
    included: verification reads the logits of every position it checks."""
    kv = KVCache.allocate(model.config, 1, len(ids) + largest + 1)
    forward(model, np.array([ids[:-largest - 1]]), kv)
    tail = np.array([ids[-largest - 1:]])

    def step(k):
        return lambda: head(model, forward(model, tail[:, :k], kv))
    times = time_together([step(k) for k in range(1, largest + 2)], repeat=repeat,
                          after=[(lambda k=k: kv.trim(k)) for k in range(1, largest + 2)])
    return {n: times[n].best / times[0].best for n in range(1, largest + 1)}


def draft_cost(target, draft, ids, repeat) -> float:
    """c: one decode step of the draft over one of the target, timed side by side."""
    def step(model):
        kv = KVCache.allocate(model.config, 1, len(ids) + 1)
        forward(model, np.array([ids[:-1]]), kv)
        return (lambda: head(model, forward(model, np.array([ids[-1:]]), kv)),
                lambda: kv.trim(1))
    (t_target, undo_t), (t_draft, undo_d) = step(target), step(draft)
    times = time_together([t_target, t_draft], repeat=repeat, after=[undo_t, undo_d])
    return times[1].best / times[0].best


def main(argv=None):
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
    args = parser.parse_args(argv)
    header = timing_header(args)

    target = load_model(args.model)
    ids = rewrite_prompt(target)
    n, G = args.new_tokens, args.max_gamma
    say(f"[1/4] plain greedy: {n} tokens after a {len(ids)}-token prompt ...")
    plain = reference_tokens(target, ids, n)
    say(f"[2/4] v(n): verification passes over 2..{G + 1} positions ...")
    v = step_costs(target, ids + plain, G, args.repeats)
    target_bytes = decode_read_bytes(target.config, target.weights)

    say("[3/4] drafts: alpha, c, predicted speedup per gamma ...")
    lookup = PromptLookup()
    rows = []   # (label, draft, alpha, c (time), c (bytes), gamma, predicted tokens/pass, pred.)
    per_gamma = {g: replayed_speedup(replay(ids + plain, len(ids), g, lookup), v)
                 for g in range(1, G + 1)}
    g = max(per_gamma, key=per_gamma.get)
    rounds = replay(ids + plain, len(ids), g, lookup)
    kept, judged = sum(k for _, k in rounds), sum(k + (k < p) for p, k in rounds)
    rows.append(("prompt lookup", lookup, kept / judged if judged else float("nan"), 0.0, 0.0,
                 g, (kept + len(rounds)) / len(rounds), per_gamma[g]))
    drafts = [(SCHEMES[s].label, lambda s=s: quantize_model(target, s)) for s in args.schemes]
    if not args.no_layers_draft and target.config.num_hidden_layers > 1:
        L = target.config.num_hidden_layers
        drafts.append((f"first {L // 2} of {L} layers", lambda: first_layers(target, L // 2)))
    for i, (label, make) in enumerate(drafts, 1):
        draft = make()
        alpha = agreement(draft, ids, plain) / n
        c = draft_cost(target, draft, ids + plain[:1], args.repeats)
        c_bytes = decode_read_bytes(draft.config, draft.weights) / target_bytes
        g = best_gamma(alpha, c, v)
        rows.append((label, draft, alpha, c, c_bytes, g, expected_tokens(alpha, g),
                     speedup(alpha, g, c, v[g])))
        progress(i, len(drafts), f"{label}: alpha {alpha:.3f}, c {c:.2f}, best gamma {g}")

    say(f"[4/4] measured: each draft at its gamma against plain greedy, {args.repeats} rounds")
    measured, same_everywhere = [], True
    for i, row in enumerate(rows, 1):
        label, draft, g = row[0], row[1], row[5]
        results = {}

        def spec():
            results["spec"] = speculative_generate(target, draft, ids, n, gamma=g,
                                                   eos_token_id=[])
        t_plain, t_spec = time_together(
            [lambda: mt.generate(target, ids, n, eos_token_id=[]), spec],
            warmup=0, repeat=args.repeats)
        r = results["spec"]
        same = r.tokens == plain
        same_everywhere &= same
        measured.append((r, t_plain.best / t_spec.best, t_plain.median / t_spec.median, same))
        progress(i, len(rows), f"{label}, gamma {g}: {t_plain.best / t_spec.best:.2f}x, "
                 f"tokens {'identical' if same else 'DIFFERENT'}")

    print(f"Experiment 22 (measured): speculative decoding, {target.path}")
    print(f"task: rewrite a {len(PASSAGE.split())}-word passage; {len(ids)}-token prompt, "
          f"{n} new tokens, greedy; {header}")
    print()
    print("v(n): one target pass over n + 1 positions, in one-token decode steps "
          "(the chapter's formula: 1)")
    print("  " + "  ".join(f"n={k}: {x:.2f}" for k, x in v.items()))
    print()
    print("c: a draft step over a target step, as time here and as weight bytes read")
    print("gamma: the draft length with the best predicted speedup on these costs")
    print(f"{'':<24}{'':>7}{'c':>6}{'c':>7}{'':>6}{'tokens / pass':>16}{'speedup':>26}")
    print(f"{'draft':<24}{'alpha':>7}{'time':>6}{'bytes':>7}{'gamma':>6}{'pred.':>8}{'meas.':>8}"
          f"{'pred.':>8}{'meas.':>9}{'median':>9}{'same':>6}")
    for (label, _, alpha, c, c_bytes, g, tpp, pred), (r, best, median, same) in zip(rows,
                                                                                   measured):
        print(f"{label:<24}{alpha:>7.3f}{c:>6.2f}{c_bytes:>7.3f}{g:>6}{tpp:>8.2f}"
              f"{r.tokens_per_pass:>8.2f}{pred:>7.2f}x{best:>8.2f}x{median:>8.2f}x"
              f"{'yes' if same else 'NO':>6}")
    print()
    print("alpha: per-proposal acceptance (lookup: kept / (kept + rejections) in its rounds; "
          "models: agreement with greedy)")
    print("pred.: lookup from its rounds replayed on greedy's tokens, each priced at v; models "
          "E(alpha, gamma) / (gamma c + v(gamma))")
    print("meas.: best of the rounds (median beside); the machine may have been shared")
    print(f"tokens identical to plain greedy in every run: {'yes' if same_everywhere else 'NO'}")
    return 0 if same_everywhere else 1


if __name__ == "__main__":
    run(main)
