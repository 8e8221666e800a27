"""Stamped writes into a paged cache, for tests of its bookkeeping without a model.

A real key at position p is a function of the tokens up to p (the prefix), not of the token
alone. A stamp is the same: one number per distinct prefix, written into every layer's keys and
values at that slot. So a block's contents say which prefix it holds, exactly, and a block
handed to the wrong sequence (a bad name, a missed copy on write, a block given out while held)
shows up as a wrong stamp. Shared by tests/serve/test_prefix_cache.py and
tests/serve/test_blocks.py (its state machine, BlockBooks).
"""
from dataclasses import dataclass, field

import numpy as np

from minitransformer.backend import to_device, to_numpy
from minitransformer.checkpoints.synth import qwen2_config
from minitransformer.config import ModelConfig
from minitransformer.serve.paged import PagedCache

CONFIG = ModelConfig.from_dict(qwen2_config())    # 2 layers, Hkv 2, d 8: only shapes matter


def pool(num_blocks: int, block_size: int) -> PagedCache:
    return PagedCache.allocate(CONFIG, num_blocks, block_size)


@dataclass
class Stamps:
    """prefix (tuple of token ids) <-> a number > 0 (0 is a slot never written). Exact in
    float32 while fewer than 2**24 prefixes are stamped."""
    of_prefix: dict = field(default_factory=dict)
    prefix_of: dict = field(default_factory=dict)

    def __call__(self, prefix) -> int:
        prefix = tuple(prefix)
        if prefix not in self.of_prefix:
            self.of_prefix[prefix] = len(self.of_prefix) + 1
            self.prefix_of[self.of_prefix[prefix]] = prefix
        return self.of_prefix[prefix]


def write(cache: PagedCache, stamps: Stamps, tokens: dict, T: int) -> list:
    """Append the next T tokens of each sequence (tokens: seq id -> all its token ids, at
    least length + T of them) as a forward pass would: make_room, then every layer's slots
    written through the view, then advance -> the physical blocks written, one list per row.

    Before writing, each target block is checked here, not by the cache's own rule: one
    holder (refcount 1) and no name. A write into a shared or named block fails."""
    ids = list(tokens)
    cache.books.make_room(ids, T)
    cache.do(cache.books.take_moves())                      # the copies on write first
    view = cache.view(ids)
    positions = view.positions(T)                                      # (B, T)
    targets = [[cache.books.seqs[s].blocks[p // cache.books.block_size] for p in row]
               for s, row in zip(ids, positions, strict=True)]
    for s, row in zip(ids, targets, strict=True):
        for block in row:
            assert cache.books.refcount[block] == 1, f"{s!r} writes block {block}, shared " \
                f"by {cache.books.refcount[block]}"
            assert block not in cache.books.index.name_of, f"{s!r} writes named block {block}"
    values = np.array([[stamps(tokens[s][:p + 1]) for p in row]
                       for s, row in zip(ids, positions, strict=True)], dtype=np.float32)   # (B, T)
    _, Hkv, _, d = cache.k[0].shape
    kv = to_device(np.broadcast_to(values[:, :, None, None], (*values.shape, Hkv, d)).copy())
    slots = view.slots(positions)
    for layer in range(len(cache.k)):
        view.update(layer, kv, kv, slots)
    view.advance(T)
    return targets


def block_stamps(cache: PagedCache, block: int) -> np.ndarray:
    """One stamp per slot of a block -> (bs,); checks every layer, head, dim, k and v agree."""
    held = np.stack([to_numpy(a[block]) for a in cache.k + cache.v])   # (2L, Hkv, bs, d)
    first = held[0, 0, :, 0]
    assert (held == first[None, None, :, None]).all(), f"block {block}'s layers disagree"
    return first


def read(cache: PagedCache, seq_id) -> list:
    """A sequence's stamps read back through its block table, one per token held."""
    seq = cache.books.seqs[seq_id]
    slots = [block_stamps(cache, b) for b in seq.blocks]
    return np.concatenate(slots)[:seq.length].tolist() if slots else []


def expected(stamps: Stamps, tokens) -> list:
    """The stamps of a sequence holding these tokens: one per prefix."""
    return [stamps(tokens[:p + 1]) for p in range(len(tokens))]


def holders(cache: PagedCache) -> np.ndarray:
    """(N,) how many block tables hold each block, counted here from the tables."""
    count = np.zeros(cache.books.num_blocks, dtype=np.int64)
    for seq in cache.books.seqs.values():
        for block in seq.blocks:
            count[block] += 1
    return count
