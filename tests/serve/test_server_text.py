"""Every answer's text is the text of ``generate`` alone, streamed or not, driven by the official
``openai`` client over real HTTP on 127.0.0.1: completions and chat, concurrent clients batched
together, and stop strings cutting the text (the server's matching linear in the answer)."""
import threading
import time
import urllib.request

import pytest

from minitransformer.chat import encode_chat
from minitransformer.sampling import SamplingSettings

pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
from servers import NAME, answered, expected

SETTINGS = [dict(temperature=0), dict(temperature=0.9, top_p=0.9, seed=7)]


def as_generate(settings):
    if settings["temperature"] == 0:
        return {}
    return dict(sampling=SamplingSettings(do_sample=True, temperature=settings["temperature"],
                                          top_p=settings["top_p"]), seed=settings["seed"])


@pytest.mark.parametrize("settings", SETTINGS, ids=["greedy", "seeded"])
def test_completion_text_is_generates(served, model, settings):
    online, url, client = served
    prompt = "The cat sat on the mat."
    ids = model.tokenizer.encode(prompt)
    reply = client.completions.create(model=NAME, prompt=prompt, max_tokens=24, **settings)
    tokens, text, finish = answered(online, model, ids, 24, **as_generate(settings))
    assert reply.choices[0].text == text and reply.choices[0].finish_reason == finish
    assert reply.usage.completion_tokens == len(tokens)
    chunks = list(client.completions.create(model=NAME, prompt=prompt, max_tokens=24,
                                            stream=True, stream_options={"include_usage": True},
                                            **settings))
    tokens, text, finish = answered(online, model, ids, 24, **as_generate(settings))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert len([c for c in chunks if c.choices and c.choices[0].text]) > 1  # not one lump
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == finish
    assert chunks[-1].usage.completion_tokens == len(tokens) and not chunks[-1].choices


@pytest.mark.parametrize("settings", SETTINGS, ids=["greedy", "seeded"])
def test_chat_text_is_generates_through_the_template(served, model, settings):
    online, url, client = served
    messages = [{"role": "user", "content": "Tell me about the robot."}]
    ids = encode_chat(model, messages)
    reply = client.chat.completions.create(model=NAME, messages=messages, max_tokens=20,
                                           **settings)
    tokens, text, finish = answered(online, model, ids, 20, **as_generate(settings))
    assert reply.choices[0].message.content == text
    assert reply.choices[0].finish_reason == finish
    assert reply.usage.prompt_tokens == len(ids)
    chunks = list(client.chat.completions.create(model=NAME, messages=messages, max_tokens=20,
                                                 stream=True, **settings))
    tokens, text, finish = answered(online, model, ids, 20, **as_generate(settings))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text


def test_concurrent_clients_are_batched_and_exact(served, model):
    online, url, client = served
    prompts = [f"The {w} ran to the park." for w in ("dog", "cat", "robot", "boat", "sun",
                                                         "moon")]
    answers = [None] * len(prompts)

    def ask(i):
        chunks = client.completions.create(model=NAME, prompt=prompts[i], max_tokens=30,
                                           temperature=0.8, seed=i, stream=True,
                                           extra_body={"ignore_eos": True})
        answers[i] = "".join(c.choices[0].text for c in chunks)

    steps = len(online.engine.decode_times)
    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for i, prompt in enumerate(prompts):
        _, text, _ = answered(online, model, model.tokenizer.encode(prompt), 30, seed=i,
                              eos_token_id=[],
                              sampling=SamplingSettings(do_sample=True, temperature=0.8))
        assert answers[i] == text
    assert max(b for b, _ in online.engine.decode_times[steps:]) > 1   # decoded together


def test_stop_strings_cut_the_text_and_end_with_stop(served, model):
    online, url, client = served
    prompt = "The robot counted the boats."
    _, text, _ = expected(model, model.tokenizer.encode(prompt), 40)
    stop = text[len(text) // 2:len(text) // 2 + 2]
    cut = text[:text.find(stop)]
    reply = client.completions.create(model=NAME, prompt=prompt, max_tokens=40, temperature=0,
                                      stop=[stop, "never in the text \u2603"])
    assert reply.choices[0].text == cut and reply.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model=NAME, prompt=prompt, max_tokens=40,
                                            temperature=0, stop=stop, stream=True))
    _, made, _ = answered(online, model, model.tokenizer.encode(prompt), 40)   # cached: the
    assert "".join(c.choices[0].text for c in chunks) == made[:made.find(stop)]  # near-tie rule
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_long_stop_strings_cost_the_server_linear_work_and_keep_the_answer_whole(
        served, model, monkeypatch):
    """Four stop strings of the longest length taken, each beginning with the very text the
    answer will be (greedy), so that every token keeps them partly matched, the most work a
    stop string can ask for. The server's matching is the counted automata's: every character
    of the answer fed once, and at most 2 moves per character and string in all (a stream that
    scanned its held-back text again for each token would do about a token count times more).
    That work, not a time, is what keeps the loop free: /health answers meanwhile and after.
    The answer is the whole text (no stop string completed; what was held back is sent at the
    end)."""
    from minitransformer.serve.detokenize import StopStrings
    from minitransformer.serve.openai_api import MAX_STOP_CHARS

    fed, feed = [], StopStrings.feed

    def counted(self, text):
        before = self.moves
        found = feed(self, text)
        fed.append((len(text), self.moves - before, len(self.stops)))
        return found
    monkeypatch.setattr(StopStrings, "feed", counted)
    online, url, client = served
    prompt = "Once upon a time"
    tokens, text, _ = expected(model, model.tokenizer.encode(prompt), 60)
    stops = [(text + "\x00" + str(k)).ljust(MAX_STOP_CHARS, "\x01") for k in range(4)]
    done = []

    def ask():
        done.append(client.completions.create(model=NAME, prompt=prompt, max_tokens=60,
                                              temperature=0, stop=stops, stream=True))
        done.append("".join(c.choices[0].text for c in done.pop() if c.choices))
    thread = threading.Thread(target=ask)
    thread.start()
    while thread.is_alive():    # timeout: a loop that never answers fails, a slow one not
        assert urllib.request.urlopen(url + "/health", timeout=30).status == 200
        time.sleep(0.01)
    thread.join()
    assert done == [text]
    assert urllib.request.urlopen(url + "/health", timeout=30).status == 200
    assert sum(n for n, _, _ in fed) == len(text) and {k for _, _, k in fed} == {4}
    assert len(fed) >= len(tokens) - 1 and sum(m for _, m, _ in fed) <= 2 * len(text) * 4
