"""A draft model for speculative decoding, trained on the target's soft labels.

    distill.py    soft labels and the distillation loss, with its gradient
    training.py   the draft's forward beside its backward, and Adam
"""
