"""Experiment 3: multiply-accumulates to generate T tokens from a cold start, with and without
the KV cache, counted from the model's config (no weights are read, nothing is timed).

Per step the cached way is linear in the context and the uncached way quadratic; summed over a
generation, O(T^2) against O(T^3), so the ratio grows without bound. What is and is not
counted is listed in sim/macs.py and printed under the table.
"""
import argparse
import time

from _common import add_chapter_model_argument, add_model_argument, model_config, positive_ints, say
from _table import Table

from sim.arch import arch
from sim.macs import compare


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_argument(parser)
    add_chapter_model_argument(parser)
    parser.add_argument("--tokens", type=positive_ints, default="64,128,256,512,1024,2048",
                        help="generation lengths T, comma-separated (default: %(default)s)")
    parser.add_argument("--prompt-len", type=int, default=1,
                        help="prompt tokens before the first generated one (default: 1)")
    args = parser.parse_args(argv)
    tokens = args.tokens

    source, config = model_config(args)
    a = arch(config)
    start = time.perf_counter()
    rows = [compare(a, t, args.prompt_len) for t in tokens]
    say(f"counted {len(rows)} generation lengths in {time.perf_counter() - start:.2f} s")

    table = Table(f"Experiment 3: multiply-accumulates to generate T tokens from a cold start "
                  f"({args.prompt_len}-token prompt)", experiment=3, columns=[
                      ("T", ",d"), ("no cache GMAC", ",.2f"), ("KV cache GMAC", ",.2f"),
                      ("ratio", ",.1f"), ("last step no cache", ",.2f"),
                      ("last step KV cache", ",.2f"), ("last step ratio", ",.1f")])
    table.header(f"model: {source}: L {a.num_hidden_layers}, D {a.hidden_size}, "
                 f"H {a.num_attention_heads}, Hkv {a.num_key_value_heads}, d {a.head_dim}, "
                 f"F {a.intermediate_size}, V {a.vocab_size:,}",
                 "GMAC summed over the generation, then of its last step alone")
    for r in rows:
        table.row(r.tokens, r.uncached / 1e9, r.cached / 1e9, r.ratio,  # in GMAC, as plotted
                  r.last_step_uncached / 1e9, r.last_step_cached / 1e9,
                  r.last_step_uncached / r.last_step_cached)
    table.note("counted: q/k/v/o projections (GQA shapes), MLP gate/up/down, attention scores "
               "QK^T and P V (dense: the masked half of the causal scores included), LM head on "
               "the last position",
               "not counted: RMSNorm, RoPE, softmax, SiLU and gating, residual adds, biases, "
               "embedding lookup, sampling (none is a multiply-accumulate over a weight or the "
               "context)")
    table.plot("T", ["no cache GMAC", "KV cache GMAC"], "multiply-accumulates to generate T "
               "tokens, with and without the cache", xlabel="tokens generated T",
               ylabel="multiply-accumulates (GMAC)", logx=True, logy=True)
    table.show()

if __name__ == "__main__":
    from _common import run
    run(main)
