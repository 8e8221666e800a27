"""OpenAI request bodies -> engine requests: defaults, meanings, and 400s naming the field
(no web framework needed)."""
import json

import pytest

import minitransformer as mt
from minitransformer.serve.openai_api import APIError, parse
from minitransformer.synth import make_checkpoint, qwen2_config, train_tokenizer

POOL = 128                      # KV pool tokens of the imagined server


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp("api"), qwen2_config(vocab_size=320),
                           tokenizer=train_tokenizer(300))
    settings = json.loads((path / "tokenizer_config.json").read_text())
    settings["chat_template"] = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (path / "tokenizer_config.json").write_text(json.dumps(settings))
    return mt.load(path)


def job(model, kind="completion", **body):
    return parse({"model": "m", **body}, kind, model, "m", POOL)


def test_defaults_and_meanings(model):
    j = job(model, prompt="The cat")
    assert j.request.prompt == tuple(model.tokenizer.encode("The cat"))
    assert j.request.max_new_tokens == 16 and j.request.sampling.temperature == 1.0
    assert not j.stream and not j.include_usage and j.stop == ()
    assert job(model, prompt="The cat", temperature=0).request.sampling.greedy
    chat = job(model, "chat", messages=[{"role": "user", "content": "The cat"}])
    assert chat.request.max_new_tokens == POOL - len(chat.request.prompt)   # what fits
    j = job(model, prompt=[5, 6], stop="x", stream=True, stream_options={"include_usage": True},
            top_k=-1, ignore_eos=True, seed=3, logprobs=None, n=1, presence_penalty=0)
    assert j.request.prompt == (5, 6) and j.stop == ("x",) and j.include_usage
    assert j.request.sampling.top_k == 0 and j.request.eos_token_id == [] and not j.eos
    assert j.request.seed == 3


def test_logprobs_echo_and_n_become_the_engine_request(model):
    j = parse({"model": "m", "prompt": "The cat", "logprobs": 3, "echo": True, "n": 2},
              "completion", model, "m", POOL, max_n=2)
    r = j.request
    assert (r.n, r.logprobs, r.prompt_logprobs, j.logprobs, j.echo) == (2, 3, 3, True, "The cat")
    j = job(model, prompt=[5, 6], echo=True)          # echo alone: text, no scoring
    assert j.request.prompt_logprobs is None and j.echo == model.tokenizer.decode([5, 6])
    chat = job(model, "chat", messages=[{"role": "user", "content": "a"}], logprobs=True)
    assert (chat.request.logprobs, chat.request.prompt_logprobs, chat.echo) == (0, None, None)
    chat = job(model, "chat", messages=[{"role": "user", "content": "a"}], logprobs=True,
               top_logprobs=5)
    assert chat.request.logprobs == 5 and chat.logprobs
    assert job(model, prompt="a", logprobs=None).request.logprobs is None


@pytest.mark.parametrize("body, field", [
    (dict(model="other", prompt="a"), "model"),
    (dict(prompt="a", n=3), "n"),
    (dict(prompt="a", logprobs=21), "logprobs"),
    (dict(prompt="a", logprobs=True), "logprobs"),
    (dict(prompt="a", echo="yes"), "echo"),
    (dict(prompt="a", frequency_penalty=0.5), "frequency_penalty"),
    (dict(prompt="a", max_tokens=0), "max_tokens"),
    (dict(prompt="a", max_tokens=1.5), "max_tokens"),
    (dict(prompt="a", max_tokens=POOL), "max_tokens"),
    (dict(prompt=[1] * POOL), "prompt"),
    (dict(prompt=[1, 999]), "prompt"),
    (dict(prompt=["a", "b"]), "prompt"),
    (dict(prompt=""), "prompt"),
    (dict(prompt="a", top_p=0), "top_p"),
    (dict(prompt="a", temperature=float("nan")), "temperature"),
    (dict(prompt="a", seed=-1), "seed"),
    (dict(prompt="a", stop=["a", "b", "c", "d", "e"]), "stop"),
    (dict(prompt="a", stream="yes"), "stream"),
    (dict(prompt="a", stream_options={"include_usage": True}), "stream_options"),
])
def test_bad_fields_are_named(model, body, field):
    with pytest.raises(APIError) as caught:
        parse({"model": "m"} | body, "completion", model, "m", POOL)
    assert caught.value.status == 400 and caught.value.param == field
    assert caught.value.body()["error"]["param"] == field


def test_chat_messages_are_checked(model):
    with pytest.raises(APIError, match=r"messages\[0\].content") as caught:
        job(model, "chat", messages=[{"role": "user"}])
    assert caught.value.param == "messages"
    with pytest.raises(APIError, match="JSON object"):
        parse([1, 2], "chat", model, "m", POOL)
