"""Logprobs, echo and n parallel samples through the server, driven by the official ``openai``
client on 127.0.0.1: the numbers are log_softmax of ``mt.logits`` on the same tokens (within
1e-4), streamed or not; sample i is the single request seeded seed + i; bad fields get a 400."""
import pytest

import minitransformer as mt
from minitransformer.chat import encode_chat
from minitransformer.logprobs import MAX_LOGPROBS
from minitransformer.sampling import SamplingSettings

pytest.importorskip("openai")
pytest.importorskip("fastapi")
import openai

from servers import (
    NAME,
    TOLERANCE,
    answered,
    check_names_index_the_text,
    names,
    post_json,
    reference,
    warm,
)

PROMPT = "The cat sat on the mat."


def name_at(tokenizer, context, tokens, i, token) -> str:
    """The text ``token`` would add in place of tokens[i]."""
    return names(tokenizer, context, list(tokens[:i]) + [token], end=False)[-1]


def check_completion_logprobs(model, ids, tokens, logprobs, k, text=None):
    """The completions logprobs object of ``tokens`` (after prompt ``ids``) against the model;
    text: the choice's text, which the tokens must index."""
    ref = reference(model, ids, tokens)
    assert logprobs.tokens == names(model.tokenizer, ids, tokens)
    assert logprobs.token_logprobs == pytest.approx(
        [row[t] for row, t in zip(ref, tokens, strict=True)], abs=TOLERANCE)
    for i, (row, t, top) in enumerate(zip(ref, tokens, logprobs.top_logprobs, strict=True)):
        best = sorted(range(len(row)), key=lambda i: -row[i])[:k]
        expected = {name_at(model.tokenizer, ids, tokens, i, j): row[j] for j in best + [t]}
        assert top.keys() == expected.keys()
        assert list(top.values()) == pytest.approx(list(expected.values()), abs=TOLERANCE)
    check_names_index_the_text(logprobs.tokens, logprobs.text_offset,
                               "".join(logprobs.tokens) if text is None else text)


@pytest.mark.parametrize("k", [0, 3])
def test_completion_logprobs_are_the_models_streamed_or_not(served, model, k):
    online, url, client = served
    ids = model.tokenizer.encode(PROMPT)
    reply = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=10, temperature=0,
                                      logprobs=k)
    tokens = answered(online, model, ids, 10)[0]       # generate's, by the exactness policy
    check_completion_logprobs(model, ids, tokens, reply.choices[0].logprobs, k,
                              reply.choices[0].text)
    assert reply.choices[0].text == model.tokenizer.decode(ids + tokens)[len(PROMPT):]
    chunks = list(client.completions.create(model=NAME, prompt=PROMPT, max_tokens=10,
                                            temperature=0, logprobs=k, stream=True))
    tokens = answered(online, model, ids, 10)[0]
    joined = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for chunk in chunks:
        if chunk.choices[0].logprobs:
            for key in joined:
                joined[key] += getattr(chunk.choices[0].logprobs, key)
    check_completion_logprobs(model, ids, tokens, type(reply.choices[0].logprobs)(**joined), k,
                              "".join(c.choices[0].text for c in chunks if c.choices))


def test_sampled_logprobs_are_before_temperature(served, model):
    """A hot, penalised, top-k-cut sample still reports the model's own log-probabilities."""
    online, url, client = served
    ids = model.tokenizer.encode(PROMPT)
    reply = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=8, logprobs=2,
                                      temperature=1.7, top_p=0.8, seed=11,
                                      extra_body={"top_k": 7, "repetition_penalty": 1.4})
    hot = SamplingSettings(do_sample=True, temperature=1.7, top_p=0.8, top_k=7,
                           repetition_penalty=1.4)
    tokens = answered(online, model, ids, 8, seed=11, sampling=hot)[0]
    check_completion_logprobs(model, ids, tokens, reply.choices[0].logprobs, 2,
                              reply.choices[0].text)


def test_echo_returns_the_prompt_and_its_tokens_logprobs(served, model):
    online, url, client = served
    ids = model.tokenizer.encode(PROMPT)
    tokens = mt.generate(model, ids, 4)
    for stream in (False, True):
        reply = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=4,
                                          temperature=0, logprobs=1, echo=True, stream=stream)
        chunks = list(reply) if stream else [reply]
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        scored = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
        got = {key: sum((getattr(s, key) for s in scored), []) for key in
               ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
        assert text == PROMPT + model.tokenizer.decode(ids + tokens)[len(PROMPT):]
        assert got["tokens"] == names(model.tokenizer, [], ids + tokens)
        check_names_index_the_text(got["tokens"], got["text_offset"], text)
        assert got["token_logprobs"][0] is None and got["top_logprobs"][0] is None
        ref = reference(model, ids[:1], ids[1:] + tokens)
        assert got["token_logprobs"][1:] == pytest.approx(
            [row[t] for row, t in zip(ref, ids[1:] + tokens, strict=True)], abs=TOLERANCE)
    plain = client.completions.create(model=NAME, prompt=ids, max_tokens=2, temperature=0,
                                      echo=True)
    assert plain.choices[0].text.startswith(PROMPT) and plain.choices[0].logprobs is None


def test_chat_logprobs_and_top_logprobs_streamed_or_not(served, model):
    online, url, client = served
    messages = [{"role": "user", "content": "Tell me about the robot."}]
    ids = encode_chat(model, messages)
    reply = client.chat.completions.create(model=NAME, messages=messages, max_tokens=8,
                                           temperature=0, logprobs=True, top_logprobs=4)
    tokens, text, _ = answered(online, model, ids, 8)     # generate's, by the policy
    assert reply.choices[0].message.content == text
    content = reply.choices[0].logprobs.content
    streamed = [entry for chunk in client.chat.completions.create(
        model=NAME, messages=messages, max_tokens=8, temperature=0, logprobs=True,
        top_logprobs=4, stream=True) if chunk.choices and chunk.choices[0].logprobs
        for entry in chunk.choices[0].logprobs.content]
    for entries, (tokens, text, _) in ((content, (tokens, text, None)),
                                       (streamed, answered(online, model, ids, 8))):
        ref = reference(model, ids, tokens)
        assert [e.token for e in entries] == names(model.tokenizer, ids, tokens)
        assert b"".join(bytes(e.bytes) for e in entries) == text.encode()  # they rebuild it
        for i, (e, row, t) in enumerate(zip(entries, ref, tokens, strict=True)):
            assert abs(e.logprob - row[t]) < TOLERANCE
            best = sorted(range(len(row)), key=lambda i: -row[i])[:4]
            assert [a.token for a in e.top_logprobs] == [
                name_at(model.tokenizer, ids, tokens, i, j) for j in best]
            assert [a.logprob for a in e.top_logprobs] == pytest.approx(row[best],
                                                                        abs=TOLERANCE)
    plain = client.chat.completions.create(model=NAME, messages=messages, max_tokens=2,
                                           logprobs=True)
    assert all(e.top_logprobs == [] for e in plain.choices[0].logprobs.content)
    assert client.chat.completions.create(model=NAME, messages=messages,
                                          max_tokens=2).choices[0].logprobs is None


def test_n_samples_are_the_single_requests_seeded_seed_plus_i(served, model):
    online, url, client = served
    ids = model.tokenizer.encode(PROMPT)       # (cached by the tests before: the near-tie rule)
    reply = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=12,
                                      temperature=0.9, seed=70, n=3)
    alone = [text for _, text, _ in answered(online, model, ids, 12, n=3, seed=70,
                                               sampling=warm(0.9))]
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert [c.text for c in reply.choices] == alone
    assert len(set(alone)) > 1
    single = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=12,
                                       temperature=0.9, seed=71)
    assert single.choices[0].text == answered(online, model, ids, 12, seed=71,
                                              sampling=warm(0.9))[1]
    texts = ["", "", ""]
    finished = set()
    for chunk in client.completions.create(model=NAME, prompt=PROMPT, max_tokens=12,
                                           temperature=0.9, seed=70, n=3, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                finished.add(c.index)
    assert texts == [text for _, text, _ in answered(online, model, ids, 12, n=3, seed=70,
                                                       sampling=warm(0.9))]
    assert finished == {0, 1, 2}
    messages = [{"role": "user", "content": "Hello"}]
    chat = client.chat.completions.create(model=NAME, messages=messages, max_tokens=6, n=2,
                                          temperature=0.8, seed=5, logprobs=True)
    chat_ids = encode_chat(model, messages)
    made = answered(online, model, chat_ids, 6, n=2, seed=5, sampling=warm(0.8))
    for c, (tokens, text, _) in zip(chat.choices, made, strict=True):
        assert c.message.content == text
        assert [e.token for e in c.logprobs.content] == names(model.tokenizer, chat_ids, tokens)
    assert chat.usage.completion_tokens == sum(len(c.logprobs.content) for c in chat.choices)
    assert online.engine.cache.books.num_free == online.engine.cache.books.num_blocks


def test_a_stop_string_ends_one_sample_not_the_others(served, model):
    online, url, client = served
    ids = model.tokenizer.encode(PROMPT)
    texts = [model.tokenizer.decode(ids + mt.generate(model, ids, 16, sampling=warm(1.0), seed=s))[
        len(PROMPT):] for s in (30, 31)]
    stop = next(texts[0][i:i + 2] for i in range(1, len(texts[0]) - 1)
                if "\ufffd" not in texts[0][i:i + 2] and texts[0][i:i + 2] not in texts[1])
    reply = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=16, temperature=1,
                                      seed=30, n=2, stop=stop)
    made = [text for _, text, _ in answered(online, model, ids, 16, n=2, seed=30,
                                              sampling=warm(1.0))]   # cached: near-tie rule
    assert reply.choices[0].text == made[0][:made[0].index(stop)]
    assert reply.choices[0].finish_reason == "stop"
    assert reply.choices[1].text == made[1] and reply.choices[1].finish_reason == "length"


BOUND = f"in [0, {MAX_LOGPROBS}]"
HOSTILE = [  # (path, fields, the param named, what the message says)
    ("completions", dict(logprobs=MAX_LOGPROBS + 1), "logprobs", BOUND),
    ("completions", dict(logprobs=-1), "logprobs", BOUND),
    ("completions", dict(logprobs=True), "logprobs", BOUND),     # a bool is not a count
    ("completions", dict(logprobs=2.0), "logprobs", BOUND),
    ("completions", dict(logprobs="2"), "logprobs", BOUND),
    ("completions", dict(logprobs=10**30), "logprobs", BOUND),
    ("completions", dict(top_logprobs=2), "top_logprobs", "chat"),   # chat's field
    ("completions", dict(echo=1), "echo", "true or false"),
    ("completions", dict(echo="true"), "echo", "true or false"),
    ("completions", dict(n=0), "n", "in [1, 4]"),
    ("completions", dict(n=-3), "n", "in [1, 4]"),
    ("completions", dict(n=True), "n", "in [1, 4]"),
    ("completions", dict(n=2.5), "n", "in [1, 4]"),
    ("completions", dict(n="2"), "n", "in [1, 4]"),
    ("completions", dict(n=5), "n", "in [1, 4]"),                # more than the 4 slots
    ("completions", dict(best_of=3), "best_of", "not supported"),
    ("chat/completions", dict(logprobs=3), "logprobs", "true or false"),  # chat: a flag
    ("chat/completions", dict(logprobs="true"), "logprobs", "true or false"),
    ("chat/completions", dict(logprobs=True, top_logprobs=MAX_LOGPROBS + 1), "top_logprobs",
     BOUND),
    ("chat/completions", dict(logprobs=True, top_logprobs=-1), "top_logprobs", BOUND),
    ("chat/completions", dict(logprobs=True, top_logprobs=False), "top_logprobs", BOUND),
    ("chat/completions", dict(top_logprobs=2), "top_logprobs", "needs logprobs: true"),
    ("chat/completions", dict(logprobs=False, top_logprobs=2), "top_logprobs", "needs"),
    ("chat/completions", dict(echo=True), "echo", "/v1/completions only"),
    ("chat/completions", dict(n=[2]), "n", "in [1, 4]"),
]


@pytest.mark.parametrize("path, fields, param, says", HOSTILE,
                         ids=[f"{p}-{f}" for p, f, _, _ in HOSTILE])
def test_bad_logprobs_echo_and_n_get_400_naming_the_field(served, path, fields, param, says):
    online, url, client = served
    body = {"model": NAME, "max_tokens": 2} | (
        {"prompt": "hi"} if path == "completions" else
        {"messages": [{"role": "user", "content": "hi"}]})
    status, reply = post_json(url, f"/v1/{path}", body | fields)
    assert status == 400 and reply["error"]["param"] == param, reply
    assert says in reply["error"]["message"], reply
    assert online.engine.cache.books.num_free == online.engine.cache.books.num_blocks


def test_the_bound_on_k_is_accepted_at_its_edge(served):
    """k = MAX_LOGPROBS is served (chat lists k alternatives; completions' map may hold fewer
    keys: tokens whose texts are equal, such as two halves of characters, share one)."""
    online, url, client = served
    messages = [{"role": "user", "content": "hi"}]
    reply = client.chat.completions.create(model=NAME, messages=messages, max_tokens=1,
                                           logprobs=True, top_logprobs=MAX_LOGPROBS)
    assert len(reply.choices[0].logprobs.content[0].top_logprobs) == MAX_LOGPROBS
    reply = client.completions.create(model=NAME, prompt="hi", max_tokens=1,
                                      logprobs=MAX_LOGPROBS)
    assert 1 <= len(reply.choices[0].logprobs.top_logprobs[0]) <= MAX_LOGPROBS + 1
    with pytest.raises(openai.BadRequestError, match=f"in \\[0, {MAX_LOGPROBS}\\]"):
        client.chat.completions.create(model=NAME, messages=messages, max_tokens=1,
                                       logprobs=True, top_logprobs=MAX_LOGPROBS + 1)
