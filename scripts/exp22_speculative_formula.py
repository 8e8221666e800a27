"""Experiment 22, the formula half: expected tokens per verification pass and net speedup of
speculative decoding, over acceptance rate alpha, draft length gamma and draft cost c.

    E[tokens / pass] = (1 - alpha^(gamma+1)) / (1 - alpha)      speedup = E / (gamma * c + 1)

The measured half (alpha of each quantized model as a draft for the full-precision target) is
another script; pass its alphas here with --alphas to read off what they are worth.
"""
import argparse

from _common import numbers, positive_ints
from _table import Table

from sim.speculative import expected_tokens, speedup
from sim.speculative import table as formula_table


def grid(title, alphas, gammas, cell, last=False):
    table = Table(title, experiment=22, chapter=last,
                  differs="a formula: the chapter's numbers exactly (the measured half differs)",
                  columns=[("alpha", ".2f"), *((f"gamma={g}", "") for g in gammas)])
    for a in alphas:
        table.row(a, *(cell(a, g) for g in gammas))
    return table


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--alphas", type=numbers, default="0.3,0.5,0.7,0.8,0.9,0.95",
                        help="acceptance rates, comma-separated (default: 0.3,...,0.95)")
    parser.add_argument("--gammas", type=positive_ints, default="1,2,4,8",
                        help="draft lengths, comma-separated (default: %(default)s)")
    parser.add_argument("--costs", type=numbers, default="0.1,0.2",
                        help="draft cost per token as a fraction of the target's "
                             "(default: 0.1,0.2)")
    args = parser.parse_args(argv)
    gammas = args.gammas
    try:  # every cell first, so a bad value fails before half a table is printed
        cells = {(x.c, x.alpha, x.gamma): x for x in formula_table(args.alphas, gammas, args.costs)}
    except ValueError as e:
        parser.error(str(e))

    c0 = args.costs[0]  # tokens per pass do not depend on c
    grid("Experiment 22 (formula): expected tokens per verification pass", args.alphas, gammas,
         lambda a, g: f"{cells[c0, a, g].tokens_per_pass:.2f}").header(
        "E[tokens/pass] = (1 - alpha^(gamma+1)) / (1 - alpha);  speedup = E / (gamma * c + 1)"
    ).show()
    for i, c in enumerate(args.costs):
        table = grid(f"speedup, draft cost c = {c:g} of the target per token", args.alphas,
                     gammas, lambda a, g: f"{cells[c, a, g].speedup:.2f}x",
                     last=i == len(args.costs) - 1)
        if i == len(args.costs) - 1:
            table.note("the chapter's cases:", *(
                f"  alpha {a}, gamma {g}, c {c:.2g}: {g} draft + 1 target passes, costing "
                f"{g * c + 1:.2f} target passes, keep {expected_tokens(a, g):.2f} tokens "
                f"-> {speedup(a, g, c):.2f}x" for a, g, c in ((0.9, 8, 0.1), (0.3, 8, 0.1),
                                                           (0.3, 4, 1 / 5))))
        table.show()

if __name__ == "__main__":
    from _common import run
    run(main)
