"""Logprob tokens that index the text, batches of prompts, echo with max_tokens 0 (a prompt's
logprobs alone) and vLLM's /tokenize and /detokenize, through the real server on 127.0.0.1:
with the byte-level BPE of the test models, SentencePiece (stories260K, byte fallback) and
SmolLM2's byte-level BPE when they are here."""
import itertools

import pytest

import minitransformer as mt
from minitransformer.chat import encode_chat

pytest.importorskip("openai")
pytest.importorskip("fastapi")
import openai

from minitransformer.serve.config import EngineConfig
from minitransformer.serve.engine import Engine
from minitransformer.serve.http import create_app
from minitransformer.serve.online import OnlineEngine
from servers import (
    NAME,
    TOLERANCE,
    Background,
    check_names_index_the_text,
    names,
    post_json,
    reference,
    warm,
)

# text with spaces, punctuation, and characters outside a small vocabulary (byte fallback)
TEXT = "Once upon a time, there was a little girl \u2014 Lily, 5\u20ac \u6f22!"


def serve_model(model):
    config = EngineConfig(max_num_seqs=4, num_gpu_blocks_override=64, block_size=8)
    online = OnlineEngine(Engine(model, config))
    server = Background(create_app(online, NAME))
    return online, server, openai.OpenAI(base_url=server.url + "/v1", api_key="none",
                                         max_retries=0)


@pytest.fixture(scope="module", params=["bpe-tiny", "sentencepiece-stories260K",
                                        "bpe-SmolLM2"])
def any_served(request, model):
    """A server of each tokenizer kind: the tiny model's byte-level BPE, stories260K's
    SentencePiece (skipped without ../shared), SmolLM2's byte-level BPE (skipped unless
    imported)."""
    if request.param == "sentencepiece-stories260K":
        model = request.getfixturevalue("stories")
    elif request.param == "bpe-SmolLM2":
        model = request.getfixturevalue("smollm2")
    online, server, client = serve_model(model)
    yield model, online, client
    server.stop()
    online.close()


@pytest.mark.parametrize("stream", [False, True])
def test_logprob_tokens_join_to_the_text_and_offsets_point_at_them(any_served, stream):
    """Completions with echo: each token named by the text it adds (leading spaces kept, the
    bytes of a character split over byte tokens named by the token that completes it), so the
    tokens join to the text and text[text_offset[i]:] starts with tokens[i]; a start token
    the text does not hold is kept with a null logprob and named ""."""
    model, online, client = any_served
    ids = model.tokenizer.encode(TEXT)
    tokens = mt.generate(model, ids, 12, sampling=warm(1.0), seed=3)
    reply = client.completions.create(model=NAME, prompt=TEXT, max_tokens=12, logprobs=2,
                                      echo=True, seed=3, stream=stream)
    chunks = list(reply) if stream else [reply]
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    scored = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    got = {key: sum((getattr(s, key) for s in scored), []) for key in
           ("tokens", "token_logprobs", "text_offset")}
    assert text == model.tokenizer.decode(ids + tokens)
    assert len(got["tokens"]) == len(ids) + len(tokens) and got["token_logprobs"][0] is None
    assert got["tokens"] == names(model.tokenizer, [], ids + tokens)
    check_names_index_the_text(got["tokens"], got["text_offset"], text)
    if model.tokenizer.bos_token_id is not None and model.tokenizer.add_bos:
        assert ids[0] == model.tokenizer.bos_token_id and got["tokens"][0] == ""
    assert " " in "".join(got["tokens"][:len(ids)])       # the spaces are in the tokens
    assert online.engine.cache.books.num_free == online.engine.cache.books.num_blocks


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_inside_a_token_cuts_its_name(served, model, stream):
    """The text stops before a stop string that may end inside a token: the tokens still join
    to the text (the last named by its part before the stop), streamed chunk by chunk too."""
    online, url, client = served
    ids = model.tokenizer.encode("The cat sat")
    made = mt.generate(model, ids, 16, sampling=warm(1.0), seed=8)
    full = model.tokenizer.decode(ids + made)[len("The cat sat"):]
    ends = list(itertools.accumulate(map(len, names(model.tokenizer, ids, made))))
    end = next(e for e in ends if e and full[e - 1] != "\ufffd")     # a token ends here
    held = full[end - 1] + "\x00"    # never met; its start is: the text is held, then sent
    stop = next(full[i:i + 2] for i in range(end + 1, len(full) - 1)
                if "\ufffd" not in full[i:i + 2])
    reply = client.completions.create(model=NAME, prompt="The cat sat", max_tokens=16,
                                      seed=8, logprobs=1, stop=[stop, held], stream=stream)
    chunks = list(reply) if stream else [reply]
    text, tokens, offsets = "", [], []
    for c in (c for c in chunks if c.choices):
        text += c.choices[0].text
        if c.choices[0].logprobs:
            tokens += c.choices[0].logprobs.tokens
            offsets += c.choices[0].logprobs.text_offset
        assert "".join(tokens) == text[:len("".join(tokens))]   # never ahead of the text
    assert text == full[:full.index(stop)]
    check_names_index_the_text(tokens, offsets, text)


def test_chat_token_bytes_rebuild_the_content(any_served):
    model, online, client = any_served
    if model.tokenizer.chat_template is None:
        pytest.skip("no chat template")
    messages = [{"role": "user", "content": TEXT}]
    reply = client.chat.completions.create(model=NAME, messages=messages, max_tokens=12,
                                           logprobs=True, top_logprobs=2, seed=5)
    content, entries = reply.choices[0].message.content, reply.choices[0].logprobs.content
    tokens = mt.generate(model, encode_chat(model, messages), 12, sampling=warm(1.0), seed=5)
    assert [e.token for e in entries] == names(model.tokenizer, encode_chat(model, messages),
                                               tokens)
    assert b"".join(bytes(e.bytes) for e in entries) == content.encode()
    assert all(bytes(e.bytes).decode() == e.token for e in entries)


def test_a_byte_fallback_character_is_named_by_the_token_that_completes_it(stories):
    """stories260K has no token for "\u2603": three byte tokens <0xE2> <0x98> <0x83>. The
    first two add no text yet ("", vLLM's names); the third carries the whole character."""
    online, server, client = serve_model(stories)
    try:
        ids = stories.tokenizer.encode("a \u2603")
        pieces = [stories.tokenizer.backend.id_to_token(i) for i in ids]
        assert pieces == ["<s>", "\u2581a", "\u2581", "<0xE2>", "<0x98>", "<0x83>"]
        reply = client.completions.create(model=NAME, prompt="a \u2603", max_tokens=0,
                                          echo=True, logprobs=0)
        assert reply.choices[0].logprobs.tokens == ["", "a", " ", "", "", "\u2603"]
        assert "".join(reply.choices[0].logprobs.tokens) == reply.choices[0].text == "a \u2603"
    finally:
        server.stop()
        online.close()


def test_a_batch_of_prompts_is_answered_in_openais_order(served, model):
    """A list of strings, or of token-id lists: choice p x n + j is sample j of prompt p, the
    text the single request gives; usage counts every prompt and sample."""
    online, url, client = served
    prompts = ["The cat sat", "A robot", "Once upon a time"]
    as_ids = [model.tokenizer.encode(p) for p in prompts]
    made = [mt.generate(model, ids, 6, sampling=warm(0.9), seed=40 + j)
            for ids in as_ids for j in range(2)]
    alone = [model.tokenizer.decode(as_ids[c // 2] + tokens)[len(prompts[c // 2]):]
             for c, tokens in enumerate(made)]
    for prompt in (prompts, as_ids):
        reply = client.completions.create(model=NAME, prompt=prompt, max_tokens=6, n=2,
                                          temperature=0.9, seed=40)
        assert [c.index for c in reply.choices] == list(range(6))
        assert [c.text for c in reply.choices] == alone
        assert reply.usage.prompt_tokens == sum(map(len, as_ids))
        assert reply.usage.completion_tokens == sum(map(len, made))
    texts = [""] * 6
    for chunk in client.completions.create(model=NAME, prompt=prompts, max_tokens=6, n=2,
                                           temperature=0.9, seed=40, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == alone
    assert online.engine.cache.books.num_free == online.engine.cache.books.num_blocks


def test_echo_with_max_tokens_0_is_the_prompts_logprobs_alone(served, model):
    """vLLM's way to score a text: the prompt back, each token's logprob (the first null),
    no new token; a batch of them, as lm-eval sends."""
    online, url, client = served
    prompts = [model.tokenizer.encode("The cat sat on the mat."), model.tokenizer.encode("Hi")]
    reply = client.completions.create(model=NAME, prompt=prompts, max_tokens=0, echo=True,
                                      logprobs=1)
    assert reply.usage.completion_tokens == 0
    for ids, c in zip(prompts, reply.choices, strict=True):
        assert c.text == model.tokenizer.decode(ids) and c.finish_reason == "length"
        assert c.logprobs.tokens == names(model.tokenizer, [], ids)
        ref = reference(model, ids[:1], ids[1:])
        assert c.logprobs.token_logprobs[0] is None
        assert c.logprobs.token_logprobs[1:] == pytest.approx(
            [row[t] for row, t in zip(ref, ids[1:], strict=True)], abs=TOLERANCE)
    plain = client.completions.create(model=NAME, prompt="Hi there", max_tokens=0, echo=True)
    assert plain.choices[0].text == "Hi there" and plain.choices[0].logprobs is None
    assert online.engine.cache.books.num_free == online.engine.cache.books.num_blocks


def test_tokenize_and_detokenize_as_vllm(served, model):
    online, url, client = served
    status, reply = post_json(url, "/tokenize", {"model": NAME, "prompt": "The cat sat"})
    ids = model.tokenizer.encode("The cat sat")
    assert status == 200 and reply == {"count": len(ids), "tokens": ids, "token_strs": None,
                                       "max_model_len": model.config.max_position_embeddings}
    status, reply = post_json(url, "/tokenize", {"prompt": "The cat", "return_token_strs": True,
                                            "add_special_tokens": False})
    assert reply["token_strs"] == [model.tokenizer.backend.id_to_token(i)
                                   for i in reply["tokens"]]
    assert "".join(reply["token_strs"]).replace("\u0120", " ") == "The cat"
    messages = [{"role": "user", "content": "Hello"}]
    status, reply = post_json(url, "/tokenize", {"messages": messages})
    assert status == 200 and reply["tokens"] == encode_chat(model, messages)
    status, reply = post_json(url, "/tokenize", {"messages": messages,
                                            "add_generation_prompt": False})
    assert reply["tokens"] == encode_chat(model, messages, add_generation_prompt=False)
    status, reply = post_json(url, "/detokenize", {"model": NAME, "tokens": ids})
    assert status == 200 and reply == {"prompt": "The cat sat"}
    assert post_json(url, "/detokenize", {"tokens": []}) == (200, {"prompt": ""})


def test_stories260k_tokenize_adds_its_bos(stories):
    online, server, client = serve_model(stories)
    try:
        status, reply = post_json(server.url, "/tokenize", {"prompt": "Once upon"})
        assert reply["tokens"] == stories.tokenizer.encode("Once upon")
        assert reply["tokens"][0] == stories.tokenizer.bos_token_id == 1
        status, bare = post_json(server.url, "/tokenize", {"prompt": "Once upon",
                                                      "add_special_tokens": False})
        assert bare["tokens"] == reply["tokens"][1:]
        assert post_json(server.url, "/detokenize", {"tokens": reply["tokens"]})[1] == {
            "prompt": "<s> Once upon"}            # special tokens kept, as vLLM decodes
    finally:
        server.stop()
        online.close()


V = 320     # the test model's vocabulary
HOSTILE = [  # (path, body fields, the param named, what the message says)
    ("/v1/completions", dict(prompt=[]), "prompt", "non-empty"),
    ("/v1/completions", dict(prompt=[[]]), "prompt", "prompt[0]"),
    ("/v1/completions", dict(prompt=["a", ""]), "prompt", "prompt[1]"),
    ("/v1/completions", dict(prompt=["a", [1, 2]]), "prompt", "mixes"),
    ("/v1/completions", dict(prompt=[[1, 2], "a"]), "prompt", "mixes"),
    ("/v1/completions", dict(prompt=[1, "a"]), "prompt", "token ids"),
    ("/v1/completions", dict(prompt=[[1, 2], [3, V]]), "prompt", "prompt[1]"),
    ("/v1/completions", dict(prompt=[[1, -1]]), "prompt", "-1"),
    ("/v1/completions", dict(prompt=[[1, True]]), "prompt", "true"),
    ("/v1/completions", dict(prompt=[[1.0, 2]]), "prompt", "1.0"),
    ("/v1/completions", dict(prompt=[10**30]), "prompt", "token ids"),
    ("/v1/completions", dict(prompt=[[[1]]]), "prompt", "prompt[0]"),
    ("/v1/completions", dict(prompt=[None]), "prompt", "prompt"),
    ("/v1/completions", dict(prompt={"a": 1}), "prompt", "prompt"),
    ("/v1/completions", dict(prompt=["a"] * 65), "prompt", "at most 64"),
    ("/v1/completions", dict(prompt=[[1]] * 10_000), "prompt", "10000 prompts"),
    ("/v1/completions", dict(prompt=[[1] * 300, [2]]), "prompt", "prompt[0] has 300"),
    ("/v1/completions", dict(prompt="a", max_tokens=0), "max_tokens", "in [1,"),
    ("/v1/completions", dict(prompt="a", max_tokens=-1, echo=True), "max_tokens", "in [0,"),
    ("/tokenize", dict(), "prompt", "one of them"),
    ("/tokenize", dict(prompt="a", messages=[]), "prompt", "one of them"),
    ("/tokenize", dict(prompt=5), "prompt", "must be a string"),
    ("/tokenize", dict(prompt=["a"]), "prompt", "must be a string"),
    ("/tokenize", dict(prompt="a", add_special_tokens="yes"), "add_special_tokens", "true"),
    ("/tokenize", dict(prompt="a", return_token_strs=1), "return_token_strs", "true"),
    ("/tokenize", dict(prompt="a", add_generation_prompt=True), "add_generation_prompt",
     "messages"),
    ("/tokenize", dict(messages="hi"), "messages", "list"),
    ("/tokenize", dict(messages=[{"role": "user"}]), "messages[0].content", "content"),
    ("/tokenize", dict(prompt="a", temperature=0), "temperature", "not a field"),
    ("/tokenize", dict(messages=[], chat_template="{{ x }}"), "chat_template", "not a field"),
    ("/tokenize", dict(prompt="a", model="gpt-4"), "model", "does not exist"),
    ("/tokenize", dict(prompt="\ud800"), "prompt", "surrogate"),
    ("/detokenize", dict(), "tokens", "list of token ids"),
    ("/detokenize", dict(tokens="1 2"), "tokens", "list of token ids"),
    ("/detokenize", dict(tokens=[1, V]), "tokens", str(V)),
    ("/detokenize", dict(tokens=[1, -5]), "tokens", "-5"),
    ("/detokenize", dict(tokens=[[1]]), "tokens", "[1]"),
    ("/detokenize", dict(tokens=[1, False]), "tokens", "false"),
    ("/detokenize", dict(tokens=[2**64]), "tokens", "token ids"),
    ("/detokenize", dict(tokens=[1], prompt="a"), "prompt", "not a field"),
]


@pytest.mark.parametrize("path, fields, param, says", HOSTILE,
                         ids=[f"{p}-{str(f)[:40]}" for p, f, _, _ in HOSTILE])
def test_bad_prompts_and_tokenizer_bodies_get_400_naming_the_field(served, path, fields,
                                                                   param, says):
    online, url, client = served
    body = ({"model": NAME, "max_tokens": 2} if path == "/v1/completions" else {}) | fields
    status, reply = post_json(url, path, body)
    expected = 404 if says == "does not exist" else 400     # an unknown model: 404
    assert status == expected and reply["error"]["param"] == param, reply
    assert says in reply["error"]["message"], reply
    assert online.engine.cache.books.num_free == online.engine.cache.books.num_blocks


@pytest.mark.parametrize("path, body", [("/tokenize", [1, 2]), ("/detokenize", "x")])
def test_a_tokenizer_body_that_is_not_an_object_is_400(served, path, body):
    online, url, client = served
    status, reply = post_json(url, path, body)
    assert status == 400 and "JSON object" in reply["error"]["message"]



def test_a_batch_the_queue_can_never_take_is_a_400_one_it_cannot_take_now_a_429(model):
    """A batch is queued whole or not at all. One longer than --max-waiting could never be
    queued, so it is a 400 naming prompt and the limit (a 429 would have an obedient client
    retry forever); one within the limit that finds the queue busy is a 429, and is served
    once the queue is free. Nothing refused is handed over (blocks free, nothing counted)."""
    import urllib.request

    from conftest import wait_for
    from servers import one_running_one_waiting
    config = EngineConfig(max_num_seqs=1, num_gpu_blocks_override=64, block_size=8)
    online = OnlineEngine(Engine(model, config), max_waiting=2)
    server = Background(create_app(online, NAME))
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    batch = {"model": NAME, "prompt": [[5, 6], [7, 8], [9, 10]], "max_tokens": 4}
    try:
        status, reply = post_json(server.url, "/v1/completions", batch)
        assert status == 400 and reply["error"]["param"] == "prompt", reply
        assert "at most 2 may wait (--max-waiting)" in reply["error"]["message"]
        wait_for(lambda: not online.engine.waiting and not online.engine.running())
        assert online.engine.cache.books.num_free == online.engine.cache.books.num_blocks
        metrics = urllib.request.urlopen(server.url + "/metrics").read().decode()
        assert f'vllm:prompt_tokens_total{{model_name="{NAME}"}} 0' in metrics
        long, waiter = one_running_one_waiting(online, client)
        status, reply = post_json(server.url, "/v1/completions", batch | {"prompt": [[5], [6]]})
        assert status == 429 and reply["error"]["code"] == "queue_full", reply
        long.close()
        waiter.join(20)
        status, reply = post_json(server.url, "/v1/completions", batch | {"prompt": [[5], [6]]})
        assert status == 200 and len(reply["choices"]) == 2
    finally:
        server.stop()
        online.close()
