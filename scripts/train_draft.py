"""Distil a speculative draft: soft labels against hard, the same start and the same budget.

Trains the three students of minitransformer/drafts/students.py (the target's first --layers
layers, the last one's MLP block trained on the teacher's soft labels at T = 1 and T = 2, and
on its hard labels) and caches them under weights/drafts/, so that experiments 22 and 23 and
the main job reuse them; --retrain ignores the cache. Progress and the time left go to
stderr. Experiment 23 (scripts/exp23_soft_labels.py, the same settings) prints their tables;
experiment 22 races them as drafts.
"""
import argparse

from _common import (
    add_draft_arguments,
    add_model_argument,
    add_threads_argument,
    distilled_drafts,
    draft_settings,
    load_model,
    run,
    say,
    timing_header,
)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_argument(parser, default="smollm2")
    add_threads_argument(parser)
    add_draft_arguments(parser)
    args = parser.parse_args(argv)
    say(timing_header(args))
    distilled_drafts(load_model(args.model), draft_settings(args), args.retrain)
    say("their tables: scripts/exp23_soft_labels.py with the same settings")
    return 0


if __name__ == "__main__":
    run(main)
