"""A draft's room comes from the free list, never from the prefix cache's kept blocks (named,
held by nobody, counted free by the admission): taking one would evict a cached turn, and a
kept block that the same step's plan still copies from (a prompt cached in full copies its
last block, to be written at its last token, after the verification pass) would have the
draft's keys written into it before the copy reads it."""
import numpy as np
import pytest

from minitransformer.backend import to_numpy
from minitransformer.checkpoints.synth import qwen2_config, random_model
from minitransformer.model import forward
from minitransformer.serve.config import SpeculativeConfig
from minitransformer.serve.paged import PagedCache
from minitransformer.serve.speculate import Speculator
from test_speculate import rows_of, step

OLD = [11, 12, 13, 14, 15, 16, 17, 18]      # a finished turn: two full blocks of 4, kept
A = [1, 2, 3, 1, 2, 3, 1, 2]                # decoding; its lookup proposes "3 1 2 3"


@pytest.fixture(scope="module")
def model():
    return random_model(qwen2_config())


def test_a_draft_never_takes_a_kept_block_nor_one_a_pending_copy_reads(model):
    """The pool: OLD's two blocks kept; "a" holding two full blocks once its last token is
    counted; "new", OLD again, holding OLD's first block and copying its second (the copy
    pending, as a plan leaves it for the prefill after the verification); the free list
    emptied by other holders. The draft gets no room (its rows feed the last token alone):
    OLD's blocks stay named and found, and the copy reads OLD's keys, not a draft's."""
    cache = PagedCache.allocate(model.config, 8, 4)
    cache.books.add("old", OLD)
    forward(model, np.array([OLD]), cache.view(["old"]))
    cache.books.seal("old", OLD)
    kept = list(cache.books.seqs["old"].blocks)
    before = [to_numpy(pool[kept[1]]).copy() for pool in cache.k + cache.v]
    cache.books.free_seq("old")                                    # both blocks kept, unheld
    cache.books.add("a", A)
    forward(model, np.array([A[:-1]]), cache.view(["a"]))
    cache.books.add("new", OLD)                                    # cached in full: copy the last
    moves = cache.books.take_moves()                         # the plan's, done after the pass
    while cache.books.free:
        cache.books.add(("filler", len(cache.books.seqs)), [3])
    assert cache.books.num_free == 1                               # OLD's second block, kept
    spec = Speculator(SpeculativeConfig(num_speculative_tokens=4), model)
    (kept_tokens, _), = step(spec, cache, rows_of({"a": list(A)}, {"a": len(A)}))
    assert spec.counters.draft_tokens == 0 and spec.fed == [1]
    assert cache.books.index.evicted == 0
    assert len(cache.books.cached_prefix(OLD)[1]) == 2             # the turn is still found whole
    cache.do(moves)                                          # the plan's copy, after the pass
    copy = cache.books.seqs["new"].blocks[1]
    assert copy != kept[1]
    for pool, old in zip(cache.k + cache.v, before, strict=True):
        assert (to_numpy(pool[copy]) == old).all()
    cache.books.check()
