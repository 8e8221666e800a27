"""Training a draft by distillation, written out: each forward beside its backward, and Adam.

The draft is the target's first k layers with the last one's MLP block trained (its norm
gain too); everything else (the first k - 1 layers, layer k-1's attention, the final norm and
the tied head) is the target's own, frozen and shared. The trained block may start as the
target's own layer k-1 MLP (then the untrained draft is exactly the cut first_layers) or as
a copy of another layer's, such as the target's last, the block that writes for the head.
The trained piece reads the residual stream h after layer k-1's attention, which training
never changes, so h is computed once (``draft_inputs``) and each step runs only what comes
after it:

    h (N, D) -> n = rms_norm(h, g)                    g: post_attention_layernorm  trained
             -> m = silu(n Wg^T) * (n Wu^T)           (N, F)                       trained
             -> o = h + m Wd^T                        (N, D)                       trained
             -> f = rms_norm(o, g_final)              the target's final norm      frozen
             -> s = f E^T                             (N, V) the tied head         frozen
             -> loss(s, z)                            z: the teacher's logits (N, V)

The backward pass runs the same list upward. Each ``*_backward`` below takes the gradient of
the loss with respect to its forward's output and returns it with respect to the forward's
inputs (and parameters): the chain rule, one step at a time. The tests check every one
against finite differences. The loss and its gradient are distill.py's: soft labels at a
temperature T, or hard labels (the teacher's argmax). The optimiser is Adam, written out.

After training the draft is an ordinary Model (``draft_model``): the target's weights dict
with layer k-1's MLP swapped, cut to k layers, which speculative_generate and the engine take
as they take any model. What it costs per position: the head (V x D multiply-adds, 28M for
SmolLM2) forward, and backward to f (the head is frozen: its gradient is never formed).
Leaves out: attention's backward (the trained piece has none), learning-rate schedules,
weight decay, training on the draft's own samples (on-policy distillation).
"""
from dataclasses import dataclass, field, replace

import numpy as np

from minitransformer.backend import to_device, to_numpy
from minitransformer.checks import is_integer, is_real
from minitransformer.drafts.distill import (
    check_temperature,
    distillation_loss_and_grad,
    hard_label_loss_and_grad,
)
from minitransformer.kernels.fused import Fused, fuse_mlp
from minitransformer.logprobs import log_softmax
from minitransformer.model import Model, attention_block, block, embed, mlp, prepare, rms_norm

# The trained parameters: checkpoint names of layer i's MLP block, by their short names here.
PIECE = {"norm": "post_attention_layernorm.weight", "gate": "mlp.gate_proj.weight",
         "up": "mlp.up_proj.weight", "down": "mlp.down_proj.weight"}


# ---- forward and backward, one pair per operation -------------------------------------------
# Each *_forward is the core's function of that name (linear.linear, model.rms_norm,
# model.silu) on host arrays of any float dtype, returning what its *_backward needs
# (tests/drafts/test_training.py holds rms_norm_forward and silu_forward to the core's numbers).

def linear_forward(x, w):
    """x (..., in), w (out, in) as checkpoints store it -> x w^T (..., out): linear.linear."""
    return x @ w.T


def linear_backward(x, w, dy):
    """dy (..., out) -> dx = dy w (..., in), dw = sum over positions of dy^T x (out, in)."""
    dx = dy @ w
    dw = dy.reshape(-1, dy.shape[-1]).T @ x.reshape(-1, x.shape[-1])
    return dx, dw


def rms_norm_forward(x, g, eps):
    """x (N, D) -> y = g * x * r (N, D), with r = 1 / sqrt(mean(x^2) + eps) (N, 1) kept for
    the backward pass: model.rms_norm."""
    r = 1.0 / np.sqrt((x * x).sum(axis=-1, keepdims=True) / x.shape[-1] + eps)
    return g * (x * r), r


def rms_norm_backward(x, g, r, dy):
    """dy (N, D) -> dx (N, D), dg (D,).

    With u = g * dy: y_i = g_i x_i r and dr / dx_j = -r^3 x_j / D, so
    dx_j = r u_j - r^3 x_j (u . x) / D; and dg_i = sum over positions of dy_i x_i r.
    """
    u = g * dy
    dx = r * u - (r ** 3) * x * (u * x).sum(axis=-1, keepdims=True) / x.shape[-1]
    dg = (dy * x * r).reshape(-1, x.shape[-1]).sum(axis=0)
    return dx, dg


def sigmoid(x):
    """(1 + tanh(x / 2)) / 2: never overflows (see model.silu)."""
    return 0.5 * (1.0 + np.tanh(0.5 * x))


def silu_forward(x):
    """x * sigmoid(x): model.silu."""
    return x * sigmoid(x)


def silu_backward(x, dy):
    """d silu / dx = sigmoid(x) (1 + x (1 - sigmoid(x)))."""
    s = sigmoid(x)
    return dy * s * (1.0 + x * (1.0 - s))


def piece(params, h, eps):
    """The trained piece, layer k-1's MLP block: h (N, D) -> o (N, D), and what backward needs.
    params: norm (D,), gate and up (F, D), down (D, F)."""
    n, r = rms_norm_forward(h, params["norm"], eps)                 # (N, D), (N, 1)
    a, b = linear_forward(n, params["gate"]), linear_forward(n, params["up"])  # (N, F) each
    m = silu_forward(a) * b                                          # (N, F)
    o = h + linear_forward(m, params["down"])                        # (N, D): the residual add
    return o, (h, n, r, a, b, m)


def piece_backward(params, saved, do):
    """do (N, D) -> dh (N, D), and the parameters' gradients (a dict like params)."""
    h, n, r, a, b, m = saved
    dm, d_down = linear_backward(m, params["down"], do)             # (N, F), (D, F)
    da, db = silu_backward(a, dm * b), dm * silu_forward(a)          # (N, F) each
    dn_gate, d_gate = linear_backward(n, params["gate"], da)         # (N, D), (F, D)
    dn_up, d_up = linear_backward(n, params["up"], db)
    dh, d_norm = rms_norm_backward(h, params["norm"], r, dn_gate + dn_up)
    return do + dh, {"norm": d_norm, "gate": d_gate, "up": d_up, "down": d_down}


def head_backward(embed_matrix, ds):
    """The tied head's backward (its forward, model.head, is linear_forward(f, E): f (N, D) ->
    logits (N, V)): ds (N, V) -> df = ds E (N, D); the head's own gradient is not needed
    (frozen)."""
    return ds @ embed_matrix


# ---- the draft's last steps, and the two losses ----------------------------------------------

@dataclass(frozen=True)
class Frozen:
    """What the draft shares with the target after the trained piece."""
    embed: np.ndarray        # (V, D) the tied embedding = the head
    final_norm: np.ndarray   # (D,) model.norm.weight
    eps: float               # rms_norm_eps

    @classmethod
    def of(cls, target: Model) -> "Frozen":
        if not target.config.tie_word_embeddings:
            raise ValueError("training a draft needs a tied head (the embedding matrix); "
                             f"{target.path or 'this model'} has a separate lm_head")
        w = target.weights
        return cls(host32(w["model.embed_tokens.weight"]), host32(w["model.norm.weight"]),
                   float(target.config.rms_norm_eps))


@dataclass(frozen=True)
class Labels:
    """What a student learns from: 'soft' (T^2 KL at `temperature`) or 'hard' (the argmax)."""
    kind: str
    temperature: float = 1.0

    def __post_init__(self):
        if self.kind not in ("soft", "hard"):
            raise ValueError(f"labels must be 'soft' or 'hard', got {self.kind!r}")
        check_temperature(self.temperature)

    @property
    def name(self) -> str:
        return f"soft, T = {self.temperature:g}" if self.kind == "soft" else "hard"

    def loss_and_grad(self, s, z):
        """Student logits s, teacher logits z (N, V) -> (loss, d loss / d s (N, V))."""
        if self.kind == "soft":
            T = self.temperature
            return distillation_loss_and_grad(s, z, T)
        return hard_label_loss_and_grad(s, z)


def logits(params, frozen: Frozen, h):
    """The draft from the trained piece on: h (N, D) -> logits (N, V), and what backward needs.
    """
    o, saved = piece(params, h, frozen.eps)                          # (N, D)
    f, r = rms_norm_forward(o, frozen.final_norm, frozen.eps)        # (N, D)
    return linear_forward(f, frozen.embed), (saved, o, r)             # (N, V): the tied head


def loss_and_grads(params, frozen: Frozen, h, z, labels: Labels):
    """One batch: h (N, D) the draft's inputs, z (N, V) the teacher's logits ->
    (loss, gradients of the loss with respect to params)."""
    s, (saved, o, r) = logits(params, frozen, h)
    loss, ds = labels.loss_and_grad(s, z)                            # ds (N, V) float64
    df = head_backward(frozen.embed, ds.astype(s.dtype))              # (N, D)
    do, _ = rms_norm_backward(o, frozen.final_norm, r, df)           # (N, D), g_final frozen
    _, grads = piece_backward(params, saved, do)
    return loss, grads


# ---- Adam, written out ---------------------------------------------------------------------

@dataclass
class Adam:
    """Adam (Kingma and Ba, 2015): per parameter, running means of the gradient (m) and of its
    square (v), bias-corrected, and a step of lr * m_hat / (sqrt(v_hat) + eps)."""
    lr: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    t: int = 0
    m: dict = field(default_factory=dict)
    v: dict = field(default_factory=dict)

    def __post_init__(self):
        if not is_real(self.lr) or not 0 < self.lr < float("inf"):
            raise ValueError(f"learning rate must be a finite number > 0, got {self.lr!r}")

    def step(self, params: dict, grads: dict) -> None:
        """Update params in place from grads (a dict with the same names)."""
        self.t += 1
        for name, g in grads.items():
            m = self.m.setdefault(name, np.zeros_like(g))
            v = self.v.setdefault(name, np.zeros_like(g))
            m += (1 - self.beta1) * (g - m)                          # m = b1 m + (1 - b1) g
            v += (1 - self.beta2) * (g * g - v)                      # v = b2 v + (1 - b2) g^2
            m_hat = m / (1 - self.beta1 ** self.t)
            v_hat = v / (1 - self.beta2 ** self.t)
            params[name] -= (self.lr * m_hat / (np.sqrt(v_hat) + self.eps)).astype(
                params[name].dtype)


# ---- the draft as a Model, and its inputs ----------------------------------------------------

def check_layers(target: Model, k) -> int:
    L = target.config.num_hidden_layers
    if not is_integer(k) or not 1 <= k <= L:
        raise ValueError(f"a draft of the first k layers needs 1 <= k <= {L}, got {k!r}")
    return int(k)


def host32(a) -> np.ndarray:
    return np.ascontiguousarray(to_numpy(a), dtype=np.float32)


def start_params(target: Model, layer: int) -> dict:
    """The trained piece's starting point: copies of the target's layer `layer` MLP block. With
    layer = k - 1 the draft before training is exactly the untrained cut first_layers(target,
    k); with the target's last layer it starts from the block that feeds the final norm."""
    L = target.config.num_hidden_layers
    if not is_integer(layer) or not 0 <= layer < L:
        raise ValueError(f"the starting block's layer must be in 0..{L - 1}, got {layer!r}")
    prefix = f"model.layers.{layer}."
    return {short: host32(target.weights[prefix + name]).copy() for short, name in PIECE.items()}


def draft_model(target: Model, k: int, params: dict) -> Model:
    """The trained draft: the target cut to k layers, layer k-1's MLP block from params.
    Every other weight, fused matrices included, is the target's own array (shared, not
    copied): only the trained block is new."""
    k = check_layers(target, k)
    prefix = f"model.layers.{k - 1}."
    weights = dict(target.weights) | {prefix + PIECE[short]: to_device(np.asarray(w, np.float32))
                                      for short, w in params.items()}
    last = replace(target.layers[k - 1], **fuse_mlp(weights, k - 1))  # gate/up stacked anew
    return replace(target, config=replace(target.config, num_hidden_layers=k), weights=weights,
                   fused=Fused(weights, target.layers[:k - 1] + (last,)))


def draft_inputs(target: Model, k: int, ids):
    """One sequence ids (T,) through the target -> (h (T, D): the residual stream after layer
    k-1's attention, what the trained piece reads; the target's final hidden states (T, D),
    after its last norm: head(them) are the teacher's logits). One pass serves both."""
    k = check_layers(target, k)
    ids = np.asarray(ids)[None]                                      # (1, T)
    batch = prepare(target, ids)
    h = embed(target, ids)                                           # (1, T, D)
    for i in range(k - 1):
        h = block(target, i, h, batch)
    eps, layer = target.config.rms_norm_eps, target.layers[k - 1]
    h = h + attention_block(target, k - 1, rms_norm(h, layer.input_norm, eps), batch, None)
    inputs = host32(h[0])
    h = h + mlp(target, k - 1, rms_norm(h, layer.post_norm, eps))  # the rest of layer k-1
    for i in range(k, target.config.num_hidden_layers):
        h = block(target, i, h, batch)
    return inputs, host32(rms_norm(h, target.weights["model.norm.weight"], eps)[0])


# ---- training: students side by side on the same batches -------------------------------------

@dataclass(frozen=True)
class Schedule:
    """How every student trains: `steps` Adam steps at learning rate `lr`, each on `batch`
    positions, drawn in an order that `seed` fixes."""
    steps: int
    batch: int
    lr: float
    seed: int = 0

    def __post_init__(self):
        for name in ("steps", "batch"):
            value = getattr(self, name)
            if not is_integer(value) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def train(students: dict, start: dict, frozen: Frozen, inputs, teacher_hidden,
          schedule: Schedule, on_step=None) -> dict:
    """Train one copy of `start` per student (name -> Labels) on the same schedule.

    inputs, teacher_hidden (N, D) from draft_inputs. Every student sees the same batches in
    the same order (positions drawn without replacement, a fresh shuffle per pass over N) and
    gets the same optimiser: only the labels differ. The teacher's logits of a batch are
    computed once and serve all students. on_step(step, params, losses) after each step.
    -> name -> trained params.
    """
    batch = schedule.batch
    if len(inputs) != len(teacher_hidden) or len(inputs) < batch:
        raise ValueError(f"need as many teacher positions as inputs, at least one batch of "
                         f"{batch}: got {len(inputs)} inputs, {len(teacher_hidden)} teacher")
    rng = np.random.default_rng(schedule.seed)
    params = {name: {k: w.copy() for k, w in start.items()} for name in students}
    optimisers = {name: Adam(schedule.lr) for name in students}
    order = np.empty(0, dtype=np.int64)
    for step in range(1, schedule.steps + 1):
        if len(order) < batch:                                       # a new pass over the data
            order = np.concatenate([order, rng.permutation(len(inputs))])
        rows, order = order[:batch], order[batch:]
        h = inputs[rows]                                             # (B, D)
        z = linear_forward(teacher_hidden[rows], frozen.embed)       # (B, V) the teacher's
        losses = {}
        for name, labels in students.items():
            losses[name], grads = loss_and_grads(params[name], frozen, h, z, labels)
            optimisers[name].step(params[name], grads)
        if on_step is not None:
            on_step(step, params, losses)
    return params


# ---- how close a student is, on held-out positions ------------------------------------------

def teacher_logits(frozen: Frozen, teacher_hidden, chunk: int = 128) -> np.ndarray:
    """The teacher's final hidden states (N, D) -> its logits (N, V), float32, chunk by chunk."""
    return np.concatenate([linear_forward(teacher_hidden[a:a + chunk], frozen.embed)
                           for a in range(0, len(teacher_hidden), chunk)])


def teacher_distributions(z, chunk: int = 128) -> list:
    """The teacher's side of closeness, made once for every student it is held against:
    z (N, V) -> per chunk of positions (log p, p, argmax), p the teacher's distribution at
    T = 1 (float64: 8 bytes a logit held, twice)."""
    made = []
    for a in range(0, len(z), chunk):
        z_chunk = z[a:a + chunk]                                        # (n, V)
        log_p = log_softmax(z_chunk.astype(np.float64))
        made.append((log_p, np.exp(log_p), z_chunk.argmax(axis=-1)))
    return made


def closeness(params, frozen: Frozen, h, z, chunk: int = 128, teacher=None) -> dict:
    """Student against teacher over positions h (N, D) it never trained on, z (N, V) the
    teacher's logits there (teacher_logits):
    kl       mean KL(p || q) at T = 1 (nats), p the teacher's distribution, q the student's
    top1     fraction of positions where the two argmaxes agree: the acceptance rate of a
             greedy draft on this text
    alpha    mean of sum_x min(p(x), q(x)) = 1 - total variation: the per-token acceptance
             rate of a sampling draft under Leviathan's rule (T = 1)
    teacher: teacher_distributions(z, chunk), where many students are held against one z
    (the same numbers, the teacher's log-softmax not made again for each)."""
    kl = top1 = alpha = 0.0
    teacher = teacher_distributions(z, chunk) if teacher is None else teacher
    for a, (log_p, p, top_p) in zip(range(0, len(h), chunk), teacher, strict=True):
        s, _ = logits(params, frozen, h[a:a + chunk])                 # (n, V)
        if log_p.shape != s.shape:
            raise ValueError(f"teacher_distributions made for chunks of {len(log_p)} "
                             f"positions, closeness reads {len(s)} at a time")
        log_q = log_softmax(s.astype(np.float64))
        q = np.exp(log_q)
        kl += float((p * (log_p - log_q)).sum())
        top1 += float((s.argmax(axis=-1) == top_p).sum())
        alpha += float(np.minimum(p, q).sum())
    return {"kl": kl / len(h), "top1": top1 / len(h), "alpha": alpha / len(h)}
