"""Experiment 22, the formula half: expected tokens per verification pass and net speedup of
speculative decoding, over acceptance rate alpha, draft length gamma and draft cost c.

    E[tokens / pass] = (1 - alpha^(gamma+1)) / (1 - alpha)      speedup = E / (gamma * c + 1)

The measured half (alpha of each quantized model as a draft for the full-precision target) is
another script; pass its alphas here with --alphas to read off what they are worth.
"""
import argparse

import _common  # noqa: F401  (puts the repository on sys.path)
from sim.speculative import expected_tokens, speedup, table


def floats(text):
    return [float(x) for x in text.split(",")]


def grid(title, alphas, gammas, cell):
    print(title)
    print(f"{'alpha':>6}" + "".join(f"{f'gamma={g}':>10}" for g in gammas))
    for a in alphas:
        print(f"{a:>6.2f}" + "".join(f"{cell(a, g):>10}" for g in gammas))
    print()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--alphas", type=floats, default=floats("0.3,0.5,0.7,0.8,0.9,0.95"),
                        help="acceptance rates, comma-separated (default: 0.3,...,0.95)")
    parser.add_argument("--gammas", default="1,2,4,8",
                        help="draft lengths, comma-separated (default: %(default)s)")
    parser.add_argument("--costs", type=floats, default=floats("0.1,0.2"),
                        help="draft cost per token as a fraction of the target's "
                             "(default: 0.1,0.2)")
    args = parser.parse_args(argv)
    gammas = [int(g) for g in args.gammas.split(",")]
    try:  # every cell first, so a bad value fails before half a table is printed
        cells = {(x.c, x.alpha, x.gamma): x for x in table(args.alphas, gammas, args.costs)}
    except ValueError as e:
        parser.error(str(e))

    print("Experiment 22 (formula): speculative decoding")
    print("E[tokens/pass] = (1 - alpha^(gamma+1)) / (1 - alpha);  "
          "speedup = E / (gamma * c + 1)")
    print()
    c0 = args.costs[0]  # tokens per pass do not depend on c
    grid("expected tokens per verification pass", args.alphas, gammas,
         lambda a, g: f"{cells[c0, a, g].tokens_per_pass:.2f}")
    for c in args.costs:
        grid(f"speedup, draft cost c = {c:g} of the target per token", args.alphas, gammas,
             lambda a, g: f"{cells[c, a, g].speedup:.2f}x")
    print("the chapter's cases")
    for a, g, c in ((0.9, 8, 0.1), (0.3, 8, 0.1), (0.3, 4, 1 / 5)):
        print(f"  alpha {a}, gamma {g}, c {c:.2g}: {g} draft + 1 target passes, costing "
              f"{g * c + 1:.2f} target passes, keep {expected_tokens(a, g):.2f} tokens "
              f"-> {speedup(a, g, c):.2f}x")


if __name__ == "__main__":
    main()
