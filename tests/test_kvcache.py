"""The cache's bookkeeping: what it holds, how it grows, rolls back and refuses to overflow."""
import numpy as np
import pytest

import minitransformer as mt
from minitransformer.backend import to_numpy
from minitransformer.kvcache import KVCache
from minitransformer.model import forward, head


def test_nbytes_is_the_formula_kv_heads_only(tiny_model):
    c = tiny_model.config
    for dtype, size in (("f32", 4), ("f16", 2)):
        cache = KVCache.allocate(c, batch=3, max_len=50, kv_dtype=dtype)
        assert cache.k[0].shape == (3, c.num_key_value_heads, 50, c.head_dim)
        per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * size
        assert cache.nbytes == per_token * 3 * 50


def test_overflow_is_a_clear_error(tiny_model):
    cache = KVCache.allocate(tiny_model.config, batch=1, max_len=4)
    forward(tiny_model, np.array([[1, 2, 3]]), cache)
    with pytest.raises(ValueError, match="overflow"):
        forward(tiny_model, np.array([[4, 5]]), cache)


def test_trim_rolls_back_exactly(tiny_model):
    """Append 3 wrong tokens, trim them, append the right one: same logits as never erring."""
    cache = KVCache.allocate(tiny_model.config, batch=1, max_len=10)
    forward(tiny_model, np.array([[1, 2, 3]]), cache)
    forward(tiny_model, np.array([[9, 9, 9]]), cache)
    cache.trim(3)
    assert cache.lengths.tolist() == [3]
    out = to_numpy(head(tiny_model, forward(tiny_model, np.array([[4]]), cache)))[0, -1]
    np.testing.assert_allclose(out, mt.logits(tiny_model, [1, 2, 3, 4])[-1], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="cannot trim"):
        cache.trim(5)


def test_fp16_cache_stays_close(tiny_model):
    cache = KVCache.allocate(tiny_model.config, batch=1, max_len=8, kv_dtype="f16")
    out = to_numpy(head(tiny_model, forward(tiny_model, np.array([[1, 2, 3, 4]]), cache)))[0]
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, mt.logits(tiny_model, [1, 2, 3, 4]), atol=5e-3)


@pytest.mark.parametrize("batch, max_len", [(0, 4), (1.5, 4), (1, 0), (True, 4)])
def test_allocate_rejects_bad_sizes(tiny_model, batch, max_len):
    with pytest.raises(ValueError, match="a cache needs an integer"):
        KVCache.allocate(tiny_model.config, batch, max_len)
