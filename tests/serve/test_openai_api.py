"""OpenAI request bodies -> engine requests: defaults, meanings, and 400s naming the field
(no web framework needed)."""
import json

import pytest

import minitransformer as mt
from minitransformer.checkpoints.synth import make_checkpoint, qwen2_config, train_tokenizer
from minitransformer.serve.openai_api import MAX_STOP_CHARS, APIError, parse

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
    """The one Job of a request with one prompt."""
    jobs = parse({"model": "m", **body}, kind, model, "m", POOL)
    assert len(jobs) == 1
    return jobs[0]


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
    j, = parse({"model": "m", "prompt": "The cat", "logprobs": 3, "echo": True, "n": 2},
               "completion", model, "m", POOL, max_n=2)
    r = j.request
    assert (r.n, r.logprobs, r.prompt_logprobs, j.logprobs, j.echo) == (2, 3, 3, True, True)
    j = job(model, prompt=[5, 6], echo=True)          # echo alone: text, no scoring
    assert j.request.prompt_logprobs is None and j.echo
    chat = job(model, "chat", messages=[{"role": "user", "content": "a"}], logprobs=True)
    assert (chat.request.logprobs, chat.request.prompt_logprobs, chat.echo) == (0, None, False)
    chat = job(model, "chat", messages=[{"role": "user", "content": "a"}], logprobs=True,
               top_logprobs=5)
    assert chat.request.logprobs == 5 and chat.logprobs
    assert job(model, prompt="a", logprobs=None).request.logprobs is None


def test_echo_with_max_tokens_0_asks_the_engine_for_no_token(model):
    """max_tokens 0 reaches the engine as 0 (its prompt's pass gives the logprobs; no token is
    made), so a prompt filling the whole pool can be scored; without echo, or with a token to
    make, that prompt is refused."""
    for field in ("max_tokens", "max_completion_tokens"):
        j = job(model, prompt=[1] * POOL, echo=True, logprobs=1, **{field: 0})
        assert j.request.max_new_tokens == 0 and j.request.prompt_logprobs == 1
    for body in (dict(echo=True, max_tokens=1), dict(echo=True), dict(max_tokens=1)):
        with pytest.raises(APIError) as e:
            job(model, prompt=[1] * POOL, **body)
        assert e.value.param in ("prompt", "max_tokens")


@pytest.mark.parametrize("body, field", [
    (dict(model=None, prompt="a"), "model"),
    (dict(model=["m"], prompt="a"), "model"),
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
    (dict(prompt=["a", [1]]), "prompt"),
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
    assert caught.value.param == "messages[0].content"
    with pytest.raises(APIError, match="JSON object"):
        parse([1, 2], "chat", model, "m", POOL)


def test_an_unknown_model_is_404_model_not_found(model):
    with pytest.raises(APIError) as caught:
        parse({"model": "gpt-4", "prompt": "a"}, "completion", model, "m", POOL)
    assert caught.value.status == 404 and caught.value.code == "model_not_found"
    assert caught.value.body()["error"] == {
        "message": "the model 'gpt-4' does not exist; this server has 'm'",
        "type": "invalid_request_error", "param": "model", "code": "model_not_found"}


# A boolean is not an integer, an integer is not a boolean, and a field this server does not
# implement passes only with its neutral value.
NEUTRAL = [dict(n=1), dict(n=None), dict(best_of=1), dict(echo=False), dict(logprobs=None),
           dict(presence_penalty=0), dict(presence_penalty=0.0), dict(logit_bias={}),
           dict(tools=[]), dict(response_format={"type": "text"}), dict(stop=None),
           dict(ignore_eos=False), dict(user="someone"), dict(seed=2**63 - 1),
           dict(bad_words=[]), dict(min_p=0), dict(guided_json=None),
           dict(stop="x" * MAX_STOP_CHARS)]
REFUSED = [(dict(n=0), "n"), (dict(n=True), "n"), (dict(n=1.0), "n"), (dict(n="1"), "n"),
           (dict(best_of=0), "best_of"), (dict(best_of=True), "best_of"),
           (dict(logprobs=False), "logprobs"), (dict(logprobs=1.0), "logprobs"),
           (dict(echo=0), "echo"), (dict(echo="yes"), "echo"), (dict(top_logprobs=0),
                                                                "top_logprobs"),
           (dict(presence_penalty=False), "presence_penalty"),
           (dict(frequency_penalty=0.1), "frequency_penalty"),
           (dict(logit_bias={"5": 1}), "logit_bias"), (dict(suffix="x"), "suffix"),
           (dict(response_format={"type": "json_object"}), "response_format"),
           (dict(min_tokens=3), "min_tokens"), (dict(use_beam_search=True), "use_beam_search"),
           (dict(ignore_eos="yes"), "ignore_eos"), (dict(ignore_eos=1), "ignore_eos"),
           (dict(stream=1), "stream"), (dict(max_tokens=True), "max_tokens"),
           (dict(max_tokens=10**4000), "max_tokens"), (dict(seed=10**300), "seed"),
           (dict(seed=True), "seed"), (dict(temperature=True), "temperature"),
           (dict(temperature=10**400), "temperature"), (dict(top_k=False), "top_k"),
           (dict(prompt=[True, 5]), "prompt"), (dict(prompt=[5, 2.0]), "prompt"),
           (dict(stop=[""]), "stop"), (dict(stop=0), "stop"), (dict(user=5), "user"),
           (dict(stream=True, stream_options={"include_usage": 1}),
            "stream_options.include_usage"),
           (dict(stream=True, stream_options={"include_usage": True, "continuous_usage_stats":
                                              True}), "stream_options.continuous_usage_stats"),
           (dict(stream=True, stream_options={"usage": True}), "stream_options.usage"),
           (dict(prompt="a\ud800b"), "prompt"), (dict(stop=["\udfff"]), "stop"),
           (dict(metadata={"k\ud800": "v"}), "metadata"),
           # vLLM's extras this server does not implement, and a field of neither API
           (dict(guided_json={"type": "object"}), "guided_json"),
           (dict(guided_choice=["yes", "no"]), "guided_choice"),
           (dict(guided_regex="[0-9]+"), "guided_regex"), (dict(guided_grammar="g"),
                                                            "guided_grammar"),
           (dict(allowed_token_ids=[5, 6]), "allowed_token_ids"),
           (dict(bad_words=["dog"]), "bad_words"), (dict(truncate_prompt_tokens=8),
                                                    "truncate_prompt_tokens"),
           (dict(min_p=0.1), "min_p"), (dict(frobnicate=1), "frobnicate"),
           (dict(messages=[{"role": "user", "content": "hi"}]), "messages"),
           (dict(stop="x" * (MAX_STOP_CHARS + 1)), "stop"),
           (dict(stop=["a", "b", "y" * 250_000]), "stop")]


@pytest.mark.parametrize("fields", NEUTRAL, ids=lambda f: f"{f}")
def test_neutral_values_pass(model, fields):
    assert job(model, **{"prompt": "a"} | fields).request.prompt


@pytest.mark.parametrize("fields, param", REFUSED, ids=lambda f: f"{f}"[:40])
def test_strict_types_and_not_implemented_fields_are_refused(model, fields, param):
    with pytest.raises(APIError) as caught:
        job(model, **{"prompt": "a"} | fields)
    assert caught.value.status == 400 and caught.value.param == param, caught.value


def test_chat_logprobs_false_is_neutral_and_lone_surrogates_refused(model):
    messages = [{"role": "user", "content": "hi"}]
    assert job(model, "chat", messages=messages, logprobs=False).request.logprobs is None
    for fields, param in ((dict(echo=0), "echo"), (dict(logprobs=0), "logprobs"),
                          (dict(logprobs=True, top_logprobs=True), "top_logprobs")):
        with pytest.raises(APIError) as caught:
            job(model, "chat", messages=messages, **fields)
        assert caught.value.param == param, fields
    with pytest.raises(APIError, match="surrogate") as caught:
        job(model, "chat", messages=[{"role": "user", "content": "\ud83d"}])
    assert caught.value.param == "messages"


def test_a_template_that_refuses_the_messages_is_a_400(model):
    from dataclasses import replace

    tokenizer = replace(model.tokenizer,
                        chat_template="{{ raise_exception('roles must alternate') }}")
    refusing = replace(model, tokenizer=tokenizer)
    with pytest.raises(APIError, match="roles must alternate") as caught:
        job(refusing, "chat", messages=[{"role": "user", "content": "hi"}])
    assert caught.value.status == 400 and caught.value.param == "messages"



def test_best_of_must_equal_n_and_every_field_read_or_refused(model):
    """best_of means the same as n only when equal to it (OpenAI and vLLM refuse best_of < n;
    a larger one would drop samples this server makes); a chat body's prompt is no field of
    chat, and is refused, not ignored."""
    def ask(kind="completion", **fields):
        return parse({"model": "m", **fields}, kind, model, "m", POOL, max_n=4)
    assert ask(prompt="a", n=2, best_of=2)[0].request.n == 2
    for n, best_of in ((2, 1), (1, 2), (3, 4)):
        with pytest.raises(APIError, match="best_of must equal n") as caught:
            ask(prompt="a", n=n, best_of=best_of)
        assert caught.value.param == "best_of"
    with pytest.raises(APIError, match="unrecognized") as caught:
        ask("chat", messages=[{"role": "user", "content": "hi"}], prompt="hi")
    assert caught.value.param == "prompt"
