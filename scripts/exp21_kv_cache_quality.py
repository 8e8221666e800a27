"""Experiment 21, the cache's side: what a quantized KV cache costs the model, alone and on top of
quantized weights.

For each weight scheme (fp32, INT8 per-row, NF4) and each cache format (f32, f16, llama.cpp's
q8_0 and q4_0 blocks, minitransformer/kvquant.py), one prefill of --tokens tokens of experiment
21's text goes through a KV cache of that format, so that every attention reads its keys and
values as the cache holds them, and gives:

    perplexity  exp(mean negative log-likelihood of each next token)
    vs f32      the perplexity ratio against the same weights with the f32 cache, with a 95%
                interval: the per-token differences of log-likelihood are paired (same text,
                same weights), mean +- 1.96 standard errors, exponentiated
    agree       positions where the greedy pick (argmax) equals the one with the f32 cache,
                same weights and prefix, with its 95% Wilson interval
    B/token     the cache's bytes per token for this model (measured: experiments 8 and 10)

The defaults score 1,024 tokens (twelve passes of that length: minutes on a CPU); the main job
runs --tokens 256, where the intervals say how little a small sample decides.
"""
import argparse
import math

from _common import Progress, add_model_argument, add_schemes_argument, load_model, model_name, say
from _table import Table

from minitransformer.kvquant import KV_DTYPES, cache_bytes_per_token
from minitransformer.measure.quality import (
    next_token_scores,
    paired_ratio,
    tokens_of,
    wilson_interval,
)
from minitransformer.measure.text import evaluation_text
from quant.qmodel import SCHEMES, quantize_model

WEIGHTS = ("int8-row", "nf4")   # beside fp32: the chapter's best INT8 and its best 4-bit scheme
LLAMA_CPP = ("llama.cpp: -ctk / -ctv q8_0 and q4_0 store K and V in these block formats (34 and "
             "18 bytes per 32 numbers), and it has required flash attention (-fa) for a "
             "quantized V cache; we cite no quality figure of its own for the choice: its "
             "llama-perplexity, run with and without -ctk/-ctv, measures what this table does")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_argument(parser, default="smollm2")
    parser.add_argument("--tokens", type=int, default=1024,
                        help="tokens of the text scored (default: 1024; the model's positions "
                             "cap it)")
    add_schemes_argument(parser, default=list(WEIGHTS))
    parser.add_argument("--kv-dtypes", nargs="+", default=list(KV_DTYPES), choices=KV_DTYPES,
                        help="cache formats (f32, the reference, always runs)")
    parser.add_argument("--text", default=None, metavar="FILE",
                        help="evaluation text (default: experiment 21's, the 1911 Britannica "
                             "article on Shakespeare)")
    args = parser.parse_args(argv)
    text, source = evaluation_text(args.text)
    model = load_model(args.model)
    n = args.tokens
    if not 3 <= n + 1 <= model.config.max_position_embeddings:  # 2 scores: an interval
        parser.error(f"--tokens must be in 2..{model.config.max_position_embeddings - 1}")
    try:
        ids = tokens_of(model, text, n + 1)
    except ValueError as e:
        raise ValueError(f"the text: {e}; use a smaller --tokens")
    formats = ["f32"] + [t for t in args.kv_dtypes if t != "f32"]
    weights = [("fp32", None)] + [(SCHEMES[s].label, s) for s in args.schemes]
    quality_table(model, score(model, ids, weights, formats), n, source).show()
    return 0


def score(model, ids, weights, formats) -> list:
    """Each weight scheme through each cache format -> rows (weights, cache, perplexity, its
    ratio to the f32 cache's with its interval, greedy picks agreeing with the f32 cache's)."""
    rows, done = [], Progress(len(weights) * len(formats), "passes")
    for label, scheme in weights:
        if scheme is not None:
            say(f"quantizing the weights: {label} ...")
        w = model if scheme is None else quantize_model(model, scheme)
        base = None
        for kv_dtype in formats:
            nll, picks = next_token_scores(w, ids, kv_dtype)
            if base is None:
                base = (nll, picks)
            ratio = paired_ratio(nll, base[0])
            agree = int((picks == base[1]).sum())
            rows.append((label, kv_dtype, math.exp(nll.mean()), ratio, agree))
            done(f"{label} weights, {kv_dtype} cache: perplexity {math.exp(nll.mean()):.3f}")
    return rows


def quality_table(model, rows, n: int, source: str) -> Table:
    table = Table(f"Experiment 21, the KV cache: quality by cache format, {model_name(model)}",
                  experiment=21, chapter=False,
                  columns=[("weights", ""), ("cache", ""), ("perplexity", ".3f"),
                           ("vs f32 cache [95%]", ""), ("agree [95%]", ""),
                           ("B/token", ",d"), ("vs f32 B", ".3f")])
    table.header(f"{n:,} tokens of {source}, one prefill through a cache of each format "
                 "(attention reads what it holds)",
                 "vs f32 cache: perplexity ratio to the same weights with the f32 cache, paired "
                 "per-token interval; agree: greedy picks equal to the f32 cache's, same weights, "
                 "with the 95% Wilson interval")
    table.random_weights(model)
    f32_bytes = cache_bytes_per_token(model.config, "f32")
    for label, kv_dtype, ppl, (r, low, high), agree in rows:
        a_low, a_high = wilson_interval(agree, n)
        per_token = cache_bytes_per_token(model.config, kv_dtype)
        table.row(label, kv_dtype, ppl, f"{r:.4f} [{low:.4f}, {high:.4f}]",
                  f"{agree}/{n} [{a_low:.3f}, {a_high:.3f}]", per_token, per_token / f32_bytes)
    table.note("q8_0 / q4_0: 32 int8 or 4-bit codes and one float16 scale per 32 numbers of a "
               "head's key or value vector (minitransformer/kvquant.py)", LLAMA_CPP)
    return table


if __name__ == "__main__":
    from _common import run
    run(main)
