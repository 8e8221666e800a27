"""The engine's knobs in one frozen dataclass, under vLLM's names (nano-vllm's ``Config``).

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
from dataclasses import dataclass

import numpy as np

from minitransformer.checks import is_integer
from minitransformer.kvquant import KV_DTYPES
from minitransformer.tiled import ATTENTIONS
from minitransformer.serve.blocks import blocks_for
from minitransformer.serve.speculate import SpeculativeConfig

POLICIES = ("static", "continuous")
TOKENS_PER_SLOT = 1024      # the default pool: room for this many tokens in every slot


@dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int = 8       # slots: sequences decoded together (the chapter's experiment 13)
    block_size: int = 16        # tokens per KV block: vLLM's default
    num_gpu_blocks_override: int = None     # blocks in the pool; None: TOKENS_PER_SLOT a slot
    policy: str = "continuous"  # or "static" (the two policies: engine.py's table)
    enable_prefix_caching: bool = True      # keep full blocks for later prompts (paged.py)
    max_num_batched_tokens: int = None      # chunked prefill: tokens a step; None: off
    kv_cache_dtype: str = "f32"  # the pool's format: f32, f16, q8_0 or q4_0 (kvquant.py)
    attention: str = "plain"    # ours: "plain" or "tiled" (tiled.ATTENTIONS)
    batch_invariant: bool = False   # ours: per-row-exact decode (engine.py, "Exactness")
    speculative_config: SpeculativeConfig = None    # drafts verified in the batch (speculate.py)

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
                             f"(speculate.parse_speculative_config reads vLLM's JSON)")
        for name in ("enable_prefix_caching", "batch_invariant"):
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                raise ValueError(f"{name}={getattr(self, name)!r}: expected True or False")

    @property
    def num_blocks(self) -> int:
        """Blocks in the pool: the override, else room for TOKENS_PER_SLOT in every slot."""
        if self.num_gpu_blocks_override is not None:
            return self.num_gpu_blocks_override
        return self.max_num_seqs * blocks_for(TOKENS_PER_SLOT, self.block_size)
