"""Experiment 24: what fits on a card. Weights + a fixed reserve + the KV cache = memory.

    card = weights + reserve + T * bytes_per_token      (T: resident tokens, all users together)
    T_max = floor((card - weights - reserve) / bytes_per_token)

The chapter prints this for 8 / 16 / 24 GB cards and 7B / 13B / 70B models at fp16 / int8 /
int4, and quotes: 7B fp16 weights 13.0 GB; on 8 GB, 13B int4 weights 6.2 GB and 337 tokens; on
16 GB int8, 7B 65,378 tokens and 13B 3,136. It does not state its assumptions. These are the
ones that reproduce every quoted figure exactly (and each is pinned by at least one of them):

- "GB" is 2^30 bytes (13.0 GB = 14e9 bytes; the same binary units as "800 KB/token");
- parameter counts are exactly 7e9, 13e9, 70e9;
- fp16 = 16 and int8 = 8 bits per weight; int4 = 4.125 (groups of 128 weights, one fp16 scale
  each: 4 + 16/128), the scheme the chapter itself prices; plain 4 bits would give 6.1 GB;
- a fixed 1.5 GB reserve (activations, runtime, allocator) on every card: 65,378 tokens pins it
  to within 3e-5 GB;
- the cache stays fp16 whatever the weights are.

Beside the chapter's fp16 cache each row also prices an int8 one, llama.cpp's q8_0 (blocks of 32
int8 codes and one fp16 scale: 34 bytes per 32 numbers, minitransformer/kvquant.py, the bytes
our KVCache holds in that format): nearly twice the resident tokens.

All of them are fields of `Assumptions` and `Precision`, and a card or model of your own is a
number and a `ModelSpec` (or a config via `ModelSpec.from_config`). Leaves out: activation
memory growing with batch size, cache paging overheads, tensor-parallel splits.
"""
import math
from dataclasses import dataclass

from minitransformer.kvquant import cache_bytes_per_token
from sim.arch import kv_dims, parameter_count
from sim.kv_memory import GB


@dataclass(frozen=True)
class ModelSpec:
    """What the budget needs from a model. Field names are HF's, so kv_dims() reads it."""
    name: str
    parameters: float
    num_hidden_layers: int
    num_key_value_heads: int
    head_dim: int

    @classmethod
    def from_config(cls, config, name="model"):
        """A config (object, dict or config.json path) -> its spec, parameters counted."""
        layers, kv_heads, head_dim = kv_dims(config)
        return cls(name, parameter_count(config), layers, kv_heads, head_dim)


@dataclass(frozen=True)
class Precision:
    name: str
    bits_per_weight: float  # storage cost including any per-group scales


@dataclass(frozen=True)
class Assumptions:
    gb: int = GB                 # bytes in the tables' "GB" (binary, like "800 KB/token")
    reserve_gb: float = 1.5      # activations + runtime, held back on every card
    kv_bytes_per_elem: int = 2   # the cache is fp16 even when the weights are quantized


# The chapter's three models: 7B and 70B with GQA (8 kv heads of 128), 13B with full MHA.
SEVEN_B = ModelSpec("7B", 7e9, 32, 8, 128)
THIRTEEN_B = ModelSpec("13B", 13e9, 40, 40, 128)
SEVENTY_B = ModelSpec("70B", 70e9, 80, 8, 128)
MODELS = (SEVEN_B, THIRTEEN_B, SEVENTY_B)

FP16 = Precision("fp16", 16)
INT8 = Precision("int8", 8)
INT4 = Precision("int4", 4 + 16 / 128)  # group-128 with an fp16 scale per group
PRECISIONS = (FP16, INT8, INT4)
CARDS_GB = (8, 16, 24)


@dataclass(frozen=True)
class Budget:
    """One row of experiment 24; left_bytes < 0 means the weights alone do not fit."""
    card_gb: float
    model: str
    precision: str
    weight_bytes: int
    left_bytes: int
    kv_bytes_per_token: int
    max_tokens: int
    kv_int8_bytes_per_token: int = 0  # the same, with a q8_0 cache
    max_tokens_int8: int = 0


def weight_bytes(model, precision):
    """Bytes to hold the weights: parameters * bits per weight / 8, rounded up."""
    return math.ceil(model.parameters * precision.bits_per_weight / 8)


def budget(card_gb, model, precision, assumptions=Assumptions()):
    """One card, model and precision -> weights, bytes left for the cache, tokens that fit."""
    if card_gb <= 0:
        raise ValueError(f"card_gb={card_gb!r}: a card needs a positive amount of memory")
    if model.parameters <= 0 or precision.bits_per_weight <= 0:
        raise ValueError(f"{model.name} at {precision.name}: parameters and bits per weight "
                         "must be positive")
    card = round(card_gb * assumptions.gb)
    reserve = round(assumptions.reserve_gb * assumptions.gb)
    weights = weight_bytes(model, precision)
    left = card - weights - reserve
    dims = kv_dims(model)
    per_token = cache_bytes_per_token(dims, assumptions.kv_bytes_per_elem)
    int8 = cache_bytes_per_token(dims, "q8_0")
    return Budget(card_gb, model.name, precision.name, weights, left, per_token,
                  max(left, 0) // per_token, int8, max(left, 0) // int8)


def budget_table(cards_gb=CARDS_GB, models=MODELS, precisions=PRECISIONS,
                 assumptions=Assumptions()):
    """Every card x model x precision, card-major (one table per card in the script)."""
    return [budget(card, m, p, assumptions)
            for card in cards_gb for m in models for p in precisions]
