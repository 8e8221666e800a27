"""Experiment 22's formulas: the chapter's figures, limits, and a Monte Carlo of the rule."""
import math

import numpy as np
import pytest

from sim.speculative import best_gamma, expected_tokens, replayed_speedup, speedup, table


def test_chapter_figures():
    assert f"{speedup(0.9, 8, 0.1):.2f}" == "3.40"
    assert f"{speedup(0.3, 8, 0.1):.2f}" == "0.79"
    # a draft costing a fifth of the target, gamma 4: five forward passes (four draft, one
    # verification), 4/5 + 1 = 1.8 target passes of time, for 1.4 tokens
    assert f"{expected_tokens(0.3, 4):.1f}" == "1.4"
    assert f"{speedup(0.3, 4, 1 / 5):.2f}" == "0.79"


@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.9, 0.999])
@pytest.mark.parametrize("gamma", [1, 4, 8])
def test_closed_form_is_the_geometric_sum(alpha, gamma):
    assert expected_tokens(alpha, gamma) == pytest.approx(sum(alpha**k
                                                              for k in range(gamma + 1)))


def test_limits():
    assert expected_tokens(1.0, 8) == 9.0
    assert expected_tokens(0.0, 8) == 1.0
    assert speedup(1.0, 4, 0.0) == 5.0
    assert speedup(0.5, 3, 0.0) == expected_tokens(0.5, 3)  # free draft: no cost to divide by


def test_monte_carlo_of_the_acceptance_rule():
    # accept draft tokens one by one with probability alpha, stop at the first rejection,
    # then the target adds one token of its own
    rng = np.random.default_rng(0)
    alpha, gamma = 0.7, 4
    accepted = rng.random((200_000, gamma)) < alpha
    run = np.where(accepted.all(axis=1), gamma, np.argmin(accepted, axis=1))
    assert np.mean(run + 1) == pytest.approx(expected_tokens(alpha, gamma), rel=0.01)


def test_longer_drafts_help_only_at_high_acceptance():
    assert speedup(0.9, 8, 0.1) > speedup(0.9, 2, 0.1)
    assert speedup(0.3, 8, 0.1) < speedup(0.3, 2, 0.1)


def test_table_order():
    cells = table([0.3, 0.9], [2, 8], [0.1, 0.2])
    assert [(x.c, x.alpha, x.gamma) for x in cells[:4]] == [
        (0.1, 0.3, 2), (0.1, 0.3, 8), (0.1, 0.9, 2), (0.1, 0.9, 8)]
    assert len(cells) == 8
    assert cells[3].speedup == speedup(0.9, 8, 0.1) and cells[3].passes == pytest.approx(1.8)


@pytest.mark.parametrize("args, word", [
    ((-0.1, 4, 0.1), "alpha"), ((1.1, 4, 0.1), "alpha"), ((math.nan, 4, 0.1), "alpha"),
    ((0.5, 0, 0.1), "gamma"), ((0.5, 2.0, 0.1), "gamma"), ((0.5, True, 0.1), "gamma"),
    ((0.5, 4, -0.1), "c="), ((0.5, 4, math.nan), "c="),
])
def test_bad_inputs(args, word):
    with pytest.raises(ValueError, match=word):
        speedup(*args)


def test_a_verification_pass_that_costs_more_moves_the_best_gamma_down():
    assert speedup(0.8, 4, 0.0, v=2.0) == expected_tokens(0.8, 4) / 2.0
    free = {g: 1.0 for g in range(1, 9)}
    cpu = {g: 1.0 + 0.05 * g ** 2 for g in range(1, 9)}   # rising faster than linearly
    assert best_gamma(0.8, 0.0, free) == 8
    assert 1 < best_gamma(0.8, 0.0, cpu) < 8
    assert best_gamma(0.8, 0.0, cpu) == max(cpu, key=lambda g: speedup(0.8, g, 0.0, cpu[g]))
    with pytest.raises(ValueError, match="v="):
        speedup(0.8, 4, 0.0, v=0.0)


def test_replayed_rounds_price_each_pass_at_its_own_length():
    rounds = [(3, 3), (3, 0), (0, 0), (2, 1)]     # 4 + 1 + 1 + 2 = 8 tokens
    costs = {2: 1.5, 3: 2.0}
    assert replayed_speedup(rounds, costs) == 8 / (2.0 + 2.0 + 1.0 + 1.5)
    assert replayed_speedup([(0, 0)] * 5, costs) == 1.0   # nothing proposed: plain decoding
