"""Experiment 1: slow vs fast generation.

The same prompt is generated greedily twice: by full recompute (every step runs the whole
sequence through the model) and with a KV cache (one prefill pass over the prompt, then
one-token decode steps). The tokens are compared one by one; the wall time of each way and the
speedup are printed. The chapter: identical output, 9x faster over 48 tokens (40-token
prompt) on a laptop GPU.

Both runs generate exactly --max-new-tokens tokens (end-of-sequence does not stop them), so the
two times cover the same work. The two ways are timed side by side, --repeat times each (the
fastest and the median printed); a cached run slower than the recompute is measured again and
flagged if it persists. --attention tiled runs both ways with the tiled attention;
--kv-cache-dtype makes the cached way hold its cache in that format (a quantized cache changes
the numbers, so its tokens may differ: the table says so, and only f32 must be identical).
"""
import argparse

from _common import (
    Progress,
    add_cache_arguments,
    add_model_argument,
    add_threads_argument,
    add_timing_arguments,
    load_model,
    positive_int,
    timing_header,
)
from _table import Table, is_random

import minitransformer as mt
from minitransformer.measure.sanity import conclude, recheck, slower, unsteady_line
from minitransformer.measure.timing import time_together
from minitransformer.tokenizer import encode_prompt

PROMPT = ("The key and value vectors of position seven are computed from the input at position "
          "seven and the positions before it. When position eight arrives, nothing about "
          "position seven has changed, so")


def both_ways(model, ids, n, repeat, kv_dtype="f32", attention="plain"):
    """-> ({'recompute' | 'cache': tokens}, [Timing recompute, Timing cache]), side by side."""
    tokens = {}
    progress = Progress(2 * repeat, "generations", more=2 * repeat)

    def generation(name, cache):
        def run():
            tokens[name] = mt.generate(model, ids, n, cache=cache, eos_token_id=[],
                                       kv_dtype=kv_dtype if cache else "f32",
                                       attention=attention)
        return run

    timings, warning = recheck(
        lambda _: time_together([generation("recompute", False), generation("cache", True)],
                                warmup=0, repeat=repeat,
                                after=[lambda: progress("no cache (recompute)"),
                                       lambda: progress("KV cache")]),
        lambda t: slower(t[1], t[0], "the cached generation", "the recompute")
        or unsteady_line(["no cache", "KV cache"], t, scale=1, unit="s", fmt=".3f"))
    return tokens, timings, warning


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_argument(parser)
    parser.add_argument("--prompt", default=PROMPT,
                        help="prompt text (default: a 40-odd token passage on Qwen's tokenizer)")
    parser.add_argument("--max-new-tokens", type=positive_int, default=48)
    add_timing_arguments(parser, repeat=2, runs="generations each way, side by side,")
    add_cache_arguments(parser)
    add_threads_argument(parser)
    args = parser.parse_args(argv)

    ran_on = timing_header(args)
    model = load_model(args.model)
    ids = encode_prompt(model, args.prompt)
    n = args.max_new_tokens
    mt.generate(model, ids[:4], 2)  # warm-up: first-call allocations out of the timings
    tokens, (t_slow, t_fast), warning = both_ways(model, ids, n, args.repeat,
                                                  args.kv_cache_dtype, args.attention)
    slow, fast = tokens["recompute"], tokens["cache"]
    same = sum(a == b for a, b in zip(slow, fast, strict=True))

    table = Table(f"Experiment 1: slow vs fast generation ({len(ids)}-token prompt, {n} new "
                  "tokens, greedy)", experiment=1,
                  columns=[("method", ""), ("time s", ".3f"), ("med s", ".3f"),
                           ("tokens/s", ".1f")])
    table.header(f"time: fastest and median of {t_slow.repeat} generations each way, side by "
                 f"side; {args.attention} attention, {args.kv_cache_dtype} cache", ran_on)
    table.row("no cache (full recompute)", t_slow.best, t_slow.median, n / t_slow.best)
    table.row("KV cache (prefill + decode)", t_fast.best, t_fast.median, n / t_fast.best,
              warning=warning)
    exact = args.kv_cache_dtype == "f32"   # a quantized cache changes the numbers
    table.note(f"tokens identical: {same} of {n}  -> "
               f"{'identical output' if same == n else 'DIFFERENT'}"
               + ("" if exact else f" ({args.kv_cache_dtype} cache: not required to match)"),
               conclude("speedup", f"speedup: {t_slow.best / t_fast.best:.1f}x",
                        {"no cache": (t_slow, None), "KV cache": (t_fast, warning)}), "",
               f"prompt : {model.tokenizer.decode(ids)!r}",
               f"output : {model.tokenizer.decode(fast)!r}")
    if is_random(model):
        table.note("(the default model's weights are random, so its text is nonsense: the point "
                   "is that both ways agree)")
    table.show()
    return 0 if same == n or not exact else 1


if __name__ == "__main__":
    from _common import run
    run(main)
