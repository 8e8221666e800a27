"""A draft model for speculative decoding, trained on the target's soft labels.

    distill.py    soft labels and the distillation loss, with its gradient
    training.py   the draft's forward beside its backward, and Adam
    students.py   three students trained side by side (soft at T = 1, 2, hard), cached
"""
