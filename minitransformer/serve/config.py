"""The engine's knobs in one frozen dataclass, under vLLM's names (nano-vllm's ``Config``),
and speculation's beside them (``SpeculativeConfig``, read from ``--speculative-config``).

Built once, from the command line (``__main__``) or by a caller, and handed to the engine,
the server and the scripts whole: ``Engine(model, EngineConfig(max_num_seqs=2))``. Each value
is checked here, when the config is made, and a bad one is a ValueError naming its field;
what needs the model (does the pool fit in memory?) is checked by the engine.

>>> EngineConfig(max_num_seqs=2, block_size=4).num_blocks     # 2 slots x 1,024 tokens / 4
512
>>> EngineConfig(max_num_seqs=4, max_num_batched_tokens=4)   # doctest: +ELLIPSIS
Traceback (most recent call last):
...
ValueError: max_num_batched_tokens=4 leaves no room for a prompt beside 4 decodes: give more...
"""
import json
from dataclasses import dataclass

import numpy as np

from minitransformer.checks import is_integer, is_real, no_duplicates
from minitransformer.kvquant import KV_DTYPES
from minitransformer.serve.blocks import pool_blocks
from minitransformer.tiled import ATTENTIONS

METHODS = ("ngram", "draft_model")
FIELDS = ("method", "model", "num_speculative_tokens", "prompt_lookup_max",
          "prompt_lookup_min", "disable_by_batch_size", "weight_rows", "min_acceptance")


@dataclass(frozen=True)
class SpeculativeConfig:
    """``--speculative-config``, under vLLM's field names (weight_rows and min_acceptance are
    this project's). Checked when made, built in Python or read from JSON, with the same
    messages (``__post_init__``), so a bad setting never reaches an engine:

    >>> SpeculativeConfig(num_speculative_tokens=2.5)
    Traceback (most recent call last):
    ...
    ValueError: speculative config: num_speculative_tokens must be an integer >= 1, got 2.5
    """
    num_speculative_tokens: int      # the longest draft
    method: str = "ngram"            # "ngram" (prompt lookup) or "draft_model"
    model: str | None = None         # the draft model's checkpoint (method draft_model)
    prompt_lookup_max: int = 3       # ngram: the longest n-gram looked up
    prompt_lookup_min: int = 1       # ngram: the shortest
    disable_by_batch_size: int | None = None  # no drafts while more sequences than this decode
    weight_rows: float | None = None     # set: draft lengths adapt (see the module's docstring)
    min_acceptance: float | None = None  # set: no draft while a sequence's acceptance is below it

    def __post_init__(self):
        """Each field's type and range, and the fields against each other: the one home of
        these rules, for a config built in Python and for one read from JSON alike (a
        ValueError starting "speculative config: ", naming the field)."""
        where = "speculative config"
        if not isinstance(self.method, str) or self.method not in METHODS:
            raise ValueError(f"{where}: method {self.method!r} is not served here: use "
                             f"{' or '.join(map(repr, METHODS))}")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
                     "disable_by_batch_size"):
            n = getattr(self, name)
            if not (n is None and name == "disable_by_batch_size") and (
                    not is_integer(n) or n < 1):
                raise ValueError(f"{where}: {name} must be an integer >= 1, got {n!r}")
        rows = self.weight_rows
        if rows is not None and (not is_real(rows) or not 0 < rows < float("inf")):
            raise ValueError(f"{where}: weight_rows must be a finite number > 0, got {rows!r}")
        least = self.min_acceptance
        if least is not None and (not is_real(least) or not 0 < least <= 1):
            raise ValueError(f"{where}: min_acceptance must be a number in (0, 1], "
                             f"got {least!r}")
        if self.method == "ngram":
            if self.model is not None:
                raise ValueError(f"{where}: model {self.model!r} is for method "
                                 f"'draft_model', not 'ngram'")
            if self.prompt_lookup_min > self.prompt_lookup_max:
                raise ValueError(f"{where}: prompt_lookup_min ({self.prompt_lookup_min}) is "
                                 f"more than prompt_lookup_max ({self.prompt_lookup_max})")
        elif not isinstance(self.model, str) or not self.model:
            raise ValueError(f"{where}: method 'draft_model' needs model, the draft's "
                             f"checkpoint path")


def parse_speculative_config(value) -> SpeculativeConfig:
    """A JSON text or a dict -> SpeculativeConfig; a ValueError naming the bad field.

    >>> parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 5, '
    ...                          '"prompt_lookup_max": 4}').prompt_lookup_max
    4
    >>> parse_speculative_config({"num_speculative_tokens": None})
    Traceback (most recent call last):
    ...
    ValueError: speculative config: num_speculative_tokens must be an integer >= 1, got None

    A null optional field is the field left out (its default), as vLLM reads it. How long a
    draft may be against the model is checked against its config (``check_against``): the
    model's positions are not known here.
    """
    where = "speculative config"
    if isinstance(value, str):
        try:
            value = json.loads(value, object_pairs_hook=no_duplicates(lambda twice: ValueError(
                f"{where}: field(s) given twice: {', '.join(twice)}")))
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not JSON ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(value).__name__}")
    unknown = sorted(set(value) - set(FIELDS))
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {', '.join(map(repr, unknown))} "
                         f"(known: {', '.join(FIELDS)})")
    fields = {name: v for name, v in value.items()       # null: the default
              if v is not None or name == "num_speculative_tokens"}
    if fields.get("model") is not None and "method" not in fields:
        fields["method"] = "draft_model"        # vLLM infers it from the model
    if "num_speculative_tokens" not in fields:
        raise ValueError(f"{where}: num_speculative_tokens is required (the longest draft)")
    return SpeculativeConfig(**fields)


def check_against(config: SpeculativeConfig, target) -> None:
    """The config against the target's ModelConfig, before anything is allocated for
    speculation: no draft longer than the target has positions (a sequence could never take
    it; its books, one counter a position, would be that long), a ValueError naming both.
    Decided here, asked by each door before it spends anything: the engine before its pool,
    the CLI before the weights load. A draft model with fewer positions than the target is
    served: a sequence drafts only while it fits the draft's positions (``Proposer.room``), as
    vLLM does; its vocabulary is checked once it is loaded (speculative.check_vocabulary).

    >>> from minitransformer.config import ModelConfig
    >>> from minitransformer.checkpoints.synth import qwen2_config
    >>> check_against(SpeculativeConfig(num_speculative_tokens=300),
    ...               ModelConfig.from_dict(qwen2_config()))
    Traceback (most recent call last):
    ...
    ValueError: speculative config: num_speculative_tokens=300 is more than the model's 256 positions
    """
    positions = target.max_position_embeddings
    if config.num_speculative_tokens > positions:
        raise ValueError(f"speculative config: num_speculative_tokens="
                         f"{config.num_speculative_tokens} is more than the model's "
                         f"{positions} positions")


POLICIES = ("static", "continuous")
TOKENS_PER_SLOT = 1024      # the default pool: room for this many tokens in every slot


@dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int = 8       # slots: sequences decoded together (the chapter's experiment 13)
    block_size: int = 16        # tokens per KV block: vLLM's default
    num_gpu_blocks_override: int | None = None  # blocks in the pool; None: TOKENS_PER_SLOT a slot
    policy: str = "continuous"  # or "static" (the two policies: engine.py's table)
    enable_prefix_caching: bool = True      # keep full blocks for later prompts (paged.py)
    max_num_batched_tokens: int | None = None   # chunked prefill: tokens a step; None: off
    kv_cache_dtype: str = "f32"  # the pool's format: f32, f16, q8_0 or q4_0 (kvquant.py)
    attention: str = "plain"    # ours: "plain" or "tiled" (tiled.ATTENTIONS)
    batch_invariant: bool = False   # ours: per-row-exact decode (engine.py, "Exactness")
    speculative_config: SpeculativeConfig | None = None  # drafts verified in the batch

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"policy={self.policy!r}: use 'static' or 'continuous'")
        for name, optional in (("max_num_seqs", False), ("block_size", False),
                               ("num_gpu_blocks_override", True),
                               ("max_num_batched_tokens", True)):
            n = getattr(self, name)
            if not (n is None and optional) and (not is_integer(n) or n < 1):
                raise ValueError(f"{name}={n!r}: expected an integer >= 1"
                                 + (" or None" if optional else ""))
        budget = self.max_num_batched_tokens
        if budget is not None and budget <= self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens={budget} leaves no room for a prompt "
                             f"beside {self.max_num_seqs} decodes: give more than max_num_seqs")
        if self.kv_cache_dtype not in KV_DTYPES:
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r}: use one of "
                             f"{', '.join(KV_DTYPES)}")
        if not isinstance(self.attention, str) or self.attention not in ATTENTIONS:
            raise ValueError(f"attention={self.attention!r}: use one of {', '.join(ATTENTIONS)}")
        spec = self.speculative_config
        if spec is not None and not isinstance(spec, SpeculativeConfig):
            raise ValueError(f"speculative_config={spec!r}: expected a SpeculativeConfig "
                             f"(parse_speculative_config reads vLLM's JSON)")
        for name in ("enable_prefix_caching", "batch_invariant"):
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                raise ValueError(f"{name}={getattr(self, name)!r}: expected True or False")

    @property
    def num_blocks(self) -> int:
        """Blocks in the pool: the override, else room for TOKENS_PER_SLOT in every slot."""
        if self.num_gpu_blocks_override is not None:
            return self.num_gpu_blocks_override
        return pool_blocks(self.max_num_seqs, TOKENS_PER_SLOT, self.block_size)
