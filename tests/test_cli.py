"""``python3 -m minitransformer generate|chat``: what a person sees in a terminal."""
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

import minitransformer as mt
from minitransformer.chat import encode_chat
from minitransformer.sampling import SamplingSettings

ROOT = Path(__file__).resolve().parents[1]
# A story model has no chat template; this one makes a conversation one running story.
STORY_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['content'] }}"
                  "{% if not loop.last %} {% endif %}{% endfor %}")


def cli(*args, stdin=""):
    """Run the command; stdout and stderr as str, decoded without newline translation."""
    done = subprocess.run([sys.executable, "-m", "minitransformer", *args], cwd=ROOT,
                          input=stdin.encode(), capture_output=True, timeout=120,
                          env=os.environ | {"PYTHONIOENCODING": "utf-8"})
    done.stdout, done.stderr = done.stdout.decode(), done.stderr.decode()
    return done


def continuation(model, ids, n):
    """The text generate's tokens add after ids, decoded as one piece."""
    tokenizer = model.tokenizer
    return tokenizer.decode(ids + mt.generate(model, ids, n))[len(tokenizer.decode(ids)):]


@pytest.fixture(scope="module")
def story_chat_model(tmp_path_factory, stories):
    """stories260K with a chat template added to its tokenizer_config.json."""
    path = tmp_path_factory.mktemp("stories-chat")
    for file in Path(stories.path).iterdir():
        shutil.copy(file, path / file.name)
    settings = json.loads((path / "tokenizer_config.json").read_text())
    settings["chat_template"] = STORY_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(settings))
    return mt.load(path)


@pytest.fixture(scope="module")
def tiny_chat_model(tmp_path_factory):
    """A tiny random Qwen2 with a byte-level tokenizer and a chat template (always present)."""
    from minitransformer.synth import make_checkpoint, qwen2_config, train_tokenizer

    path = make_checkpoint(tmp_path_factory.mktemp("tiny-chat"), qwen2_config(vocab_size=320),
                           tokenizer=train_tokenizer(300))
    settings = json.loads((path / "tokenizer_config.json").read_text())
    settings["chat_template"] = "<|endoftext|>" + STORY_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(settings))
    return mt.load(path)


def test_generate_and_chat_on_a_tiny_model(tiny_chat_model):
    model, prompt = tiny_chat_model, "The cat sat"
    done = cli("generate", "--model", model.path, prompt, "--max-new-tokens", "20",
               "--do-sample", "--temperature", "0.9", "--seed", "3")
    assert done.returncode == 0, done.stderr
    ids = model.tokenizer.encode(prompt)
    tokens = mt.generate(model, ids, 20, sampling=SamplingSettings(do_sample=True, temperature=0.9),
                         seed=3)
    text = model.tokenizer.decode(ids + tokens)[len(model.tokenizer.decode(ids)):]
    assert done.stdout == prompt + text + "\n"
    done = cli("chat", "--model", model.path, "--max-new-tokens", "8", stdin=f"{prompt}\n")
    ids = encode_chat(model, [{"role": "user", "content": prompt}])
    assert done.stdout == "you> model> " + continuation(model, ids, 8) + "\nyou> \n"


def test_generate_and_chat_with_a_quantized_cache_and_tiled_attention(tiny_chat_model):
    model, prompt = tiny_chat_model, "The cat sat"
    ids = model.tokenizer.encode(prompt)
    tokens = mt.generate(model, ids, 12, kv_dtype="q4_0", attention="tiled")
    text = model.tokenizer.decode(ids + tokens)[len(model.tokenizer.decode(ids)):]
    done = cli("generate", "--model", model.path, prompt, "--max-new-tokens", "12",
               "--kv-cache-dtype", "q4_0", "--attention", "tiled")
    assert done.returncode == 0, done.stderr
    assert done.stdout == prompt + text + "\n"
    chat_ids = encode_chat(model, [{"role": "user", "content": prompt}])
    answer = mt.generate(model, chat_ids, 8, kv_dtype="q8_0")
    done = cli("chat", "--model", model.path, "--max-new-tokens", "8", "--kv-cache-dtype",
               "q8_0", stdin=f"{prompt}\n")
    expected = model.tokenizer.decode(chat_ids + answer)[len(model.tokenizer.decode(chat_ids)):]
    assert done.stdout == "you> model> " + expected + "\nyou> \n"
    for bad in (["--kv-cache-dtype", "q5_k"], ["--attention", "flash"]):
        done = cli("generate", "--model", model.path, prompt, *bad)
        assert done.returncode == 2 and "invalid choice" in done.stderr and not done.stdout


def test_generate_streams_the_text_of_generate(stories):
    done = cli("generate", "--model", stories.path, "Once upon a time", "--max-new-tokens", "40")
    assert done.returncode == 0, done.stderr
    expected = continuation(stories, stories.tokenizer.encode("Once upon a time"), 40)
    assert done.stdout == "Once upon a time" + expected + "\n"
    assert ", there was" in done.stdout and "40 tokens" in done.stderr


def test_chat_answers_each_turn_with_the_template(story_chat_model):
    model, first = story_chat_model, "Once upon a time"
    done = cli("chat", "--model", model.path, "--max-new-tokens", "12", stdin=f"{first}\n\n")
    assert done.returncode == 0, done.stderr
    ids = encode_chat(model, [{"role": "user", "content": first}])
    assert done.stdout == "you> model> " + continuation(model, ids, 12) + "\nyou> "


@pytest.mark.parametrize("command", ["generate", "chat", "serve"])
def test_each_command_has_help(command):
    done = cli(command, "--help")
    assert done.returncode == 0 and "--model" in done.stdout


def test_bad_model_is_one_error_line(tmp_path):
    done = cli("generate", "--model", str(tmp_path / "nowhere"), "hi")
    assert done.returncode == 2 and done.stderr.startswith("error: ")
    assert "checkpoint directory not found" in done.stderr


def test_bad_sampling_is_refused_before_anything_is_loaded_or_printed(tmp_path):
    # the model does not exist either: the settings are checked first
    done = cli("generate", "--model", str(tmp_path / "nowhere"), "hi", "--temperature", "-1")
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == "error: temperature must be a finite number >= 0, got -1.0\n"


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_chat_in_a_real_terminal(story_chat_model):
    """Type into the chat under tmux, as a person would, and read the screen."""
    model, session = story_chat_model, f"mt-chat-{uuid.uuid4().hex[:8]}"

    def tmux(*args):
        return subprocess.run(["tmux", *args], capture_output=True, text=True, check=True).stdout

    def screen():
        return tmux("capture-pane", "-p", "-J", "-t", session)

    def wait_for(text, count=1):
        for _ in range(600):        # at most 60 s
            if screen().count(text) >= count:
                return
            time.sleep(0.1)
        raise AssertionError(f"{text!r} never appeared; the screen:\n{screen()}")

    command = f"{sys.executable} -m minitransformer chat --model {model.path} " \
              f"--max-new-tokens 16"
    tmux("new-session", "-d", "-s", session, "-x", "200", "-y", "50", "-c", str(ROOT), command)
    try:
        turns = ["Once upon a time", "The dog was happy"]
        for i, line in enumerate(turns):
            wait_for("you>", i + 1)
            tmux("send-keys", "-t", session, line, "Enter")
        wait_for("you>", 3)
        messages, replies = [], []
        for line in turns:
            messages.append({"role": "user", "content": line})
            ids = encode_chat(model, messages)
            replies.append(continuation(model, ids, 16))
            messages.append({"role": "assistant", "content": replies[-1]})
        shown = screen()
        for line, reply in zip(turns, replies):
            assert f"you> {line}\nmodel> {reply}\n" in shown, shown
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)


def test_model_names_and_the_offline_fallback(monkeypatch, capsys):
    import minitransformer.real_model as real_model
    from minitransformer.__main__ import model_path
    from minitransformer.synth import default_model

    def offline():
        raise real_model.FetchError("no network")
    monkeypatch.setattr(real_model, "is_imported", lambda path: False)
    monkeypatch.setattr(real_model, "smollm2", offline)
    assert model_path("some/dir") == "some/dir"
    assert model_path("default") == str(default_model())
    assert model_path(None) == str(default_model())
    assert "SmolLM2 unavailable (no network)" in capsys.readouterr().err
