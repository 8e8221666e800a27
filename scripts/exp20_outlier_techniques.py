"""Experiment 20: the techniques the outliers justify, and what each does on one matmul.

The chapter's table is text only: the methods people use (LLM.int8's mixed-precision
decomposition, per-channel and per-group scales, SmoothQuant-style migration, NF4, GPTQ/AWQ)
and what each does about outliers. Here each implemented one is also measured: the residual
stream after layer l (the layer of experiments 18 and 19), normalized as layer l+1 reads it,
times layer l+1's q_proj; the number is the output error ||Y - Y_hat|| / ||Y||.
"""
import argparse

from _common import add_model_argument, choose_layer, load_model, model_name, say
from _table import Table

from minitransformer.tokenizer import encode_prompt
from quant.activations import PROMPT, capture_residuals
from quant.techniques import matmul_operands, measure


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_argument(parser, default="smollm2")
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

    table = Table(f"Experiment 20: techniques against outliers, measured on layer {layer + 1}'s "
                  f"q_proj (X {x.shape[0]} x {x.shape[1]}, W {w.shape[0]} x {w.shape[1]}), "
                  f"{model_name(model)}", experiment=20, columns=[
                      ("technique", ""), ("what it does about outliers", ""), ("error", ".4f"),
                      ("note", "")])
    table.header("output error ||XW^T - X_hat W_hat^T|| / ||XW^T||").random_weights(model)
    for t in rows:
        table.row(t.name, t.remedy, t.error, t.note)
    table.show()

if __name__ == "__main__":
    from _common import run
    run(main)
