"""Experiment 20: the techniques the outliers justify, and what each does on one matmul.

The chapter's table is text only: the methods people use (LLM.int8's mixed-precision
decomposition, per-channel and per-group scales, SmoothQuant-style migration, NF4, GPTQ/AWQ)
and what each does about outliers. Here each implemented one is also measured: the residual
stream after layer l (the layer of experiments 18 and 19), normalized as layer l+1 reads it,
times layer l+1's q_proj; the number is the output error ||Y - Y_hat|| / ||Y||.
"""
import argparse

from _common import add_model_argument, choose_layer, encode_prompt, load_model, say
from quant.activations import PROMPT, capture_residuals
from quant.techniques import matmul_operands, measure


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_argument(parser)
    parser.add_argument("--prompt", default=PROMPT)
    parser.add_argument("--layer", type=int, default=None,
                        help="residual stream after this layer feeds layer+1's q_proj "
                             "(default: two thirds of the way up)")
    parser.add_argument("--threshold", type=float, default=6.0,
                        help="LLM.int8 outlier threshold on |x|")
    parser.add_argument("--alpha", type=float, default=0.5, help="SmoothQuant migration strength")
    args = parser.parse_args(argv)
    model = load_model(args.model)
    layer = choose_layer(args.layer, model.config.num_hidden_layers, followed=True)
    ids = encode_prompt(model, args.prompt)
    say(f"forward pass over {len(ids)} tokens")
    x, w = matmul_operands(model, capture_residuals(model, ids)[layer], layer + 1)
    rows = measure(x, w, args.threshold, args.alpha)

    print(f"Experiment 20: techniques against outliers, measured on layer {layer + 1}'s q_proj "
          f"(X {x.shape[0]} x {x.shape[1]}, W {w.shape[0]} x {w.shape[1]}), {model.path}")
    print("output error ||XW^T - X_hat W_hat^T|| / ||XW^T||")
    print()
    print(f"{'technique':<34}{'what it does about outliers':<58}{'error':>8}   note")
    for t in rows:
        error = "-" if t.error is None else f"{t.error:.4f}"
        print(f"{t.name:<34}{t.remedy:<58}{error:>8}   {t.note}")


if __name__ == "__main__":
    main()
