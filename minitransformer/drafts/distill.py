"""Distillation's soft labels and loss (experiment 23).

A student learns from the teacher's whole next-token distribution, not just its argmax: the
hard label says "jug"; the soft label says jug 0.14, cup 0.11, bowl 0.06, ... and the
similarities are information. Distillation softens the labels further with a temperature T:

    soft label      p_T = softmax(z / T)             z: the teacher's logits (V,)
    ratio           p_T[i] / p_T[j] = exp((z[i] - z[j]) / T)  = (p_1[i] / p_1[j]) ** (1 / T)

so at T = 2 the ratio of any two tokens is the square root of the ratio at T = 1: the order is
kept, the runners-up gain weight (the chapter: top/third 2.24 at T = 1, 1.50 at T = 2).

The loss (Hinton, Vinyals and Dean, 2015) compares teacher and student at the same T:

    loss = T^2 * KL(p_T || q_T),   q_T = softmax(s / T),  s: the student's logits
    d loss / d s = T * (q_T - p_T)

Why T^2: at high T, q_T - p_T shrinks like (s - z) / (V T), so the plain KL's gradient
(q_T - p_T) / T fades like 1 / T^2; scaled, it tends to (s - z) / V whatever T is, and the
soft-label term keeps its weight beside a hard-label one when T changes. KL rather than
cross-entropy: they differ by the teacher's entropy, a constant with the same gradient, and KL
is exactly zero when the distributions agree. Computed in float64 from any float logits.

The hard label, for comparison, keeps only the teacher's verdict:

    loss = -log q_1[argmax z]          (cross-entropy on the teacher's argmax)
    d loss / d s = q_1 - onehot(argmax z)

Training with either loss is in training.py. Leaves out: the student model itself.
"""
import numpy as np

from minitransformer.checks import is_integer, is_real
from minitransformer.logprobs import log_softmax


def check_logits(logits, name: str = "logits") -> np.ndarray:
    """Host float64 array (..., V) of finite logits, or a ValueError naming the problem."""
    z = np.asarray(logits)
    if z.ndim == 0 or z.shape[-1] < 2:
        raise ValueError(f"{name} must have a vocabulary axis of at least 2, got shape {z.shape}")
    if not np.issubdtype(z.dtype, np.floating):
        raise ValueError(f"{name} must be floats, got dtype {z.dtype}")
    if not np.isfinite(z).all():
        raise ValueError(f"{name} contain inf or nan")
    return z.astype(np.float64)


def check_temperature(temperature) -> float:
    if not is_real(temperature) or not 0 < temperature < float("inf"):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    return float(temperature)


def soft_labels(logits, temperature: float = 1.0) -> np.ndarray:
    """Teacher logits (..., V) -> p_T = softmax(logits / T) (..., V), float64."""
    z = check_logits(logits)
    return np.exp(log_softmax(z / check_temperature(temperature)))


def top_tokens(p, k: int = 5):
    """The k most likely tokens of p (V,): -> (ids (k,), probabilities (k,)), most likely first.
    Ties go to the lower id (a stable sort), so the order is reproducible."""
    p = np.asarray(p)
    if p.ndim != 1:
        raise ValueError(f"expected one distribution of shape (V,), got shape {p.shape}")
    if not is_integer(k) or not 1 <= k <= p.size:
        raise ValueError(f"k must be an integer in [1, {p.size}], got {k!r}")
    ids = np.argsort(-p, kind="stable")[:k]
    return ids, p[ids]


def rank_ratio(p, rank: int = 3) -> float:
    """p(most likely token) / p(token ranked `rank`): the chapter's top/third for rank 3."""
    _, probs = top_tokens(p, rank)
    return float(probs[0] / probs[-1])


def _both(student_logits, teacher_logits, temperature):
    """-> log q_T, log p_T (N, V) over all leading positions, and T."""
    s = check_logits(student_logits, "student logits")
    z = check_logits(teacher_logits, "teacher logits")
    if s.shape != z.shape:
        raise ValueError(f"student logits {s.shape} and teacher logits {z.shape} differ in shape")
    T = check_temperature(temperature)
    V = s.shape[-1]
    return log_softmax(s.reshape(-1, V) / T), log_softmax(z.reshape(-1, V) / T), T


def distillation_loss(student_logits, teacher_logits, temperature: float) -> float:
    """T^2 * KL(p_T || q_T), averaged over positions. Logits (..., V), the same shape."""
    return distillation_loss_and_grad(student_logits, teacher_logits, temperature)[0]


def distillation_grad(student_logits, teacher_logits, temperature: float) -> np.ndarray:
    """d distillation_loss / d student_logits, (..., V) float64: T * (q_T - p_T) / N."""
    return distillation_loss_and_grad(student_logits, teacher_logits, temperature)[1]


def distillation_loss_and_grad(student_logits, teacher_logits, temperature: float):
    """(distillation_loss, distillation_grad) from one log-softmax of each side: a training
    step needs both."""
    log_q, log_p, T = _both(student_logits, teacher_logits, temperature)
    p = np.exp(log_p)                                                  # (N, V)
    kl = (p * (log_p - log_q)).sum(axis=-1)                           # (N,)
    grad = T * (np.exp(log_q) - p) / log_q.shape[0]                   # (N, V)
    return float(T * T * kl.mean()), grad.reshape(np.shape(student_logits))


def hard_label_loss(student_logits, teacher_logits) -> float:
    """Cross-entropy of the student on the teacher's argmax, averaged over positions."""
    return hard_label_loss_and_grad(student_logits, teacher_logits)[0]


def hard_label_grad(student_logits, teacher_logits) -> np.ndarray:
    """d hard_label_loss / d student_logits, (..., V) float64: (q_1 - onehot(argmax z)) / N."""
    return hard_label_loss_and_grad(student_logits, teacher_logits)[1]


def hard_label_loss_and_grad(student_logits, teacher_logits):
    """(hard_label_loss, hard_label_grad) from one log-softmax of the student."""
    s = check_logits(student_logits, "student logits")
    labels = _same_shape(s, teacher_logits)
    log_q = log_softmax(s.reshape(-1, s.shape[-1]))                  # (N, V)
    loss = float(-log_q[np.arange(len(log_q)), labels].mean())
    grad = np.exp(log_q)
    grad[np.arange(len(grad)), labels] -= 1.0
    return loss, (grad / len(grad)).reshape(s.shape)


def _same_shape(s, teacher_logits):
    """-> the teacher's argmax over all leading positions (N,), once the shapes agree."""
    z = check_logits(teacher_logits, "teacher logits")
    if s.shape != z.shape:
        raise ValueError(f"student logits {s.shape} and teacher logits {z.shape} differ in shape")
    return z.reshape(-1, z.shape[-1]).argmax(axis=-1)
