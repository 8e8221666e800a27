"""Generation: the KV cache changes no token; sampling settings behave and fail clearly.

The cache and a recompute make differently shaped products (one new row against the cache,
or the whole sequence again), so their logits differ in the last bits: their tokens are
compared by the near-tie rule (conftest.assert_like_solo), the recompute the reference."""
import numpy as np
import pytest

import minitransformer as mt
from conftest import STORIES_NEAR_TIE, assert_like_solo
from minitransformer.sampling import SamplingSettings

# ../shared/models/stories260K/README.md: transformers and llama2.c's run.c agree on these ids
# for the greedy continuation of "<s> Once upon a time" (an outside reference, not our output).
STORIES_GREEDY_60 = [
    432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426, 338, 401, 396, 267, 337, 410, 408,
    419, 292, 411, 322, 265, 282, 295, 433, 426, 385, 328, 432, 358, 394, 261, 370, 432, 352,
    266, 268, 388, 426, 338, 391, 266, 267, 337, 335, 312, 432, 398, 312, 286, 267, 414, 270,
    333, 415, 426, 13, 438, 310]


@pytest.mark.usefixtures("step_threads")
@pytest.mark.parametrize("length", [1, 4, 17])
@pytest.mark.parametrize("n_new", [1, 9, 30])
def test_cache_and_recompute_give_the_same_greedy_tokens(tiny_model, length, n_new):
    rng = np.random.default_rng(length * 100 + n_new)
    for _ in range(3):
        ids = rng.integers(0, tiny_model.config.vocab_size, length).tolist()
        fast = mt.generate(tiny_model, ids, n_new, cache=True, eos_token_id=[])
        slow = mt.generate(tiny_model, ids, n_new, cache=False, eos_token_id=[])
        assert len(fast) == n_new
        assert_like_solo(tiny_model, fast, slow, ids, eos_token_id=[])


def test_cache_and_recompute_give_the_same_tokens_when_sampling(tiny_model):
    ids = [1, 2, 3]
    sampling = SamplingSettings(do_sample=True, temperature=0.8, top_k=20, top_p=0.9,
                                repetition_penalty=1.3)
    kw = dict(sampling=sampling, seed=7, eos_token_id=[])
    assert_like_solo(tiny_model, mt.generate(tiny_model, ids, 25, cache=True, **kw),
                     mt.generate(tiny_model, ids, 25, cache=False, **kw), ids, sampling, 7,
                     eos_token_id=[])


def test_real_checkpoint_greedy_story(stories):
    ids = stories.tokenizer.encode("Once upon a time")
    assert ids == [1, 403, 407, 261, 378]
    fast = mt.generate(stories, ids, 60)
    assert fast == STORIES_GREEDY_60
    assert_like_solo(stories, fast, mt.generate(stories, ids, 60, cache=False), ids,
                     tolerance=STORIES_NEAR_TIE)
    assert stories.tokenizer.decode(fast).startswith(", there was a little girl named Lily.")


@pytest.mark.parametrize("prompt", ["Lily saw a dog", "The sun was hot", "Tom and Sue"])
def test_real_checkpoint_cache_changes_no_token_on_many_prompts(stories, prompt):
    ids = stories.tokenizer.encode(prompt)
    assert_like_solo(stories, mt.generate(stories, ids, 40),
                     mt.generate(stories, ids, 40, cache=False), ids, tolerance=STORIES_NEAR_TIE)


def test_seeded_sampling_is_reproducible_and_seed_dependent(tiny_model):
    kw = dict(sampling=SamplingSettings(do_sample=True, temperature=1.5), eos_token_id=[])
    a = mt.generate(tiny_model, [1, 2], 30, seed=1, **kw)
    assert a == mt.generate(tiny_model, [1, 2], 30, seed=1, **kw)
    assert a != mt.generate(tiny_model, [1, 2], 30, seed=2, **kw)


def test_stream_yields_what_generate_returns(tiny_model):
    assert list(mt.stream(tiny_model, [3, 4], 12, eos_token_id=[])) == \
        mt.generate(tiny_model, [3, 4], 12, eos_token_id=[])


def test_stops_at_eos(tiny_model):
    free = mt.generate(tiny_model, [3, 4], 12, eos_token_id=[])
    stop = free[4]
    out = mt.generate(tiny_model, [3, 4], 12, eos_token_id=stop)
    assert out == free[: free.index(stop) + 1]


def test_max_new_tokens_zero_gives_nothing(tiny_model):
    assert mt.generate(tiny_model, [1], 0) == []


@pytest.mark.parametrize("kwargs, message", [
    (dict(ids=[]), "non-empty"),
    (dict(ids=[[1, 2]]), "1-D"),
    (dict(ids=[1.5]), "integers"),
    (dict(ids=[-1]), r"\[0, "),
    (dict(ids=[10_000]), r"\[0, "),
    (dict(max_new_tokens=-1), "max_new_tokens"),
    (dict(max_new_tokens=2.5), "max_new_tokens"),
    (dict(ids=[1] * 250, max_new_tokens=10), "positions"),
    (dict(sampling=None), "SamplingSettings"),
    (dict(sampling={"temperature": 0.5}), "SamplingSettings"),
    (dict(seed="x"), "seed"),
    (dict(seed=-1), "seed"),
    (dict(eos_token_id="a"), "eos_token_id"),
])
def test_bad_settings_are_clear_errors(checkpoint_dir, kwargs, message):
    model = mt.load(checkpoint_dir("qwen2-gqa-tied-bf16"))  # 256 positions, vocab 96
    args = dict(ids=[1, 2], max_new_tokens=3) | kwargs
    with pytest.raises(ValueError, match=message):
        mt.generate(model, args.pop("ids"), args.pop("max_new_tokens"), **args)


def test_logits_rejects_bad_ids(checkpoint_dir):
    model = mt.load(checkpoint_dir("qwen2-gqa-tied-bf16"))
    with pytest.raises(ValueError, match="non-empty"):
        mt.logits(model, [])
    with pytest.raises(ValueError, match="positions"):
        mt.logits(model, [1] * 257)


@pytest.mark.parametrize("ids, message", [
    (np.array([1, 2]), r"\(B, T\)"),
    (np.zeros((1, 0), dtype=np.int64), r"\(B, T\)"),
    (np.array([[1.0, 2.0]]), r"\(B, T\)"),
    (np.array([[1, 96]]), r"\[0, 96\)"),
    (np.ones((1, 257), dtype=np.int64), "beyond the model's 256 positions"),
])
def test_forward_rejects_bad_ids(checkpoint_dir, ids, message):
    from minitransformer.model import forward
    model = mt.load(checkpoint_dir("qwen2-gqa-tied-bf16"))  # 256 positions, vocab 96
    with pytest.raises(ValueError, match=message):
        forward(model, ids)


def test_numpy_scalars_are_accepted_as_lengths_settings_and_slots(checkpoint_dir):
    from minitransformer.serve.config import EngineConfig
    from minitransformer.serve.engine import Engine
    from minitransformer.serve.records import Request
    model = mt.load(checkpoint_dir("qwen2-gqa-tied-bf16"))
    ids = [3, 1, 4]
    kw = dict(seed=np.int64(3), eos_token_id=[])
    expected = mt.generate(model, ids, 5, sampling=SamplingSettings(True, 0.75, 5), **kw)
    assert mt.generate(model, np.array(ids), np.int32(5),
                       sampling=SamplingSettings(np.bool_(True), np.float32(0.75), np.int64(5)),
                       **kw) == expected
    engine = Engine(model, EngineConfig(max_num_seqs=np.int64(2),
                                         num_gpu_blocks_override=np.int32(8),
                                         block_size=np.int16(4)))
    run = engine.run([Request(tuple(ids), max_new_tokens=np.int64(5), eos_token_id=[])])
    assert run.results[0].tokens == mt.generate(model, ids, 5, eos_token_id=[])
