"""``python3 -m minitransformer generate|chat``: what a person sees in a terminal."""
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

import minitransformer as mt
from conftest import ONE_ROUTE, wait_for
from minitransformer.chat import encode_chat
from minitransformer.sampling import SamplingSettings

ROOT = Path(__file__).resolve().parents[1]
# The command's text is compared with generate's by ==: this process multiplies as the
# commands do (conftest.ONE_ROUTE).
pytestmark = pytest.mark.usefixtures("flat_products")


def cli(*args, stdin=""):
    """Run the command; stdout and stderr as str, decoded without newline translation."""
    done = subprocess.run([sys.executable, "-m", "minitransformer", *args], cwd=ROOT,
                          input=stdin.encode(), capture_output=True, timeout=120,
                          env=os.environ | {"PYTHONIOENCODING": "utf-8"} | ONE_ROUTE)
    done.stdout, done.stderr = done.stdout.decode(), done.stderr.decode()
    return done


def continuation(model, ids, n, seed=None, **settings):
    """The text generate's tokens add after ids, decoded as one piece."""
    tokenizer = model.tokenizer
    tokens = mt.generate(model, ids, n, sampling=SamplingSettings(**settings), seed=seed)
    return tokenizer.decode(ids + tokens)[len(tokenizer.decode(ids)):]


CHAT = {"repetition_penalty": 1.1}  # chat's built-in default where the checkpoint gives none


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
    assert done.stdout == "you> model> " + continuation(model, ids, 8, **CHAT) + "\nyou> \n"


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
    assert done.stdout == "you> model> " + continuation(model, ids, 12, **CHAT) + "\nyou> "
    assert "repetition_penalty 1.1 (built-in)" in done.stderr


def test_chat_speculating_answers_each_turn_as_without(story_chat_model):
    """Prompt lookup in the chat engine: two turns, the second copying from the first (the
    story repeats itself), the same text as without speculation."""
    model, turns = story_chat_model, "Once upon a time\nThe little dog\n\n"
    plain = cli("chat", "--model", model.path, "--max-new-tokens", "24", stdin=turns)
    spec = cli("chat", "--model", model.path, "--max-new-tokens", "24", "--speculative-config",
               '{"method": "ngram", "num_speculative_tokens": 4}', stdin=turns)
    assert plain.returncode == spec.returncode == 0, spec.stderr
    assert spec.stdout == plain.stdout and spec.stdout.count("model> ") == 2
    accepted, drafted = map(int, re.findall(r"speculation: (\d+) of (\d+) drafted",
                                            spec.stderr)[-1])
    assert 0 < accepted <= drafted and "speculation" not in plain.stderr


BAD_SPECULATION = [('"num_speculative_tokens": 5, "prompt_lookup_maximum": 4',
                    "'prompt_lookup_maximum'"),
                   ('"num_speculative_tokens": null', "num_speculative_tokens must be an "
                    "integer >= 1, got None"),
                   ('"num_speculative_tokens": true', "got True"),
                   ('"num_speculative_tokens": 2.5', "got 2.5"),
                   ('"num_speculative_tokens": "5"', "got '5'")]


@pytest.mark.parametrize("command", ["chat", "serve"])
@pytest.mark.parametrize("fields, named", BAD_SPECULATION, ids=[n for _, n in BAD_SPECULATION])
def test_a_bad_speculative_config_is_one_error_line_naming_the_field(command, fields, named,
                                                                     tmp_path):
    done = cli(command, "--model", str(tmp_path / "nowhere"), "--speculative-config",
               '{"method": "ngram", ' + fields + '}')
    assert done.returncode == 2 and done.stdout == ""
    errors = [line for line in done.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and named in errors[0], done.stderr
    assert "checkpoint" not in done.stderr     # refused before the model is looked for


@pytest.mark.parametrize("command", ["chat", "serve"])
def test_a_draft_longer_than_the_model_has_positions_is_refused_naming_both(command,
                                                                            tiny_chat_model):
    """10**30 would overflow, 10**9 allocate gigabytes of books: refused from the
    checkpoint's config.json, before its weights load (nor any pool, draft or server)."""
    path, positions = tiny_chat_model.path, tiny_chat_model.config.max_position_embeddings
    done = cli(command, "--model", str(path), "--speculative-config",
               '{"num_speculative_tokens": 1' + "0" * 30 + "}", stdin="hi\n\n")
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        f"error: speculative config: num_speculative_tokens=1{'0' * 30} is more than the "
        f"model's {positions} positions")
    assert "loading" not in done.stderr


@pytest.mark.parametrize("command", ["generate", "chat", "serve"])
def test_each_command_has_help(command):
    done = cli(command, "--help")
    assert done.returncode == 0 and "--model" in done.stdout


@pytest.mark.parametrize("variable, value", [("MT_BACKEND", "tensorflow"),
                                             ("MT_PRODUCTS", "fastest"),
                                             ("MT_LAYOUT", "diagonal"),
                                             ("MT_TUNING", "sometimes")])
def test_an_unknown_setting_is_one_error_line_naming_the_values_allowed(variable, value):
    """Read when the package is imported, before the command line's own code runs."""
    done = subprocess.run([sys.executable, "-m", "minitransformer", "generate", "hi"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60,
                          env=os.environ | {variable: value})
    assert (done.returncode, done.stdout) == (2, "")
    line, = done.stderr.splitlines()
    assert line.startswith(f"error: {variable}={value!r} is not ") and "use one of" in line


def error_line(done) -> str:
    """The one 'error:' line a refused command printed on stderr (argparse's usage aside),
    with nothing on stdout and exit status 2."""
    assert (done.returncode, done.stdout) == (2, ""), done.stderr
    errors = [line for line in done.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "Traceback" not in done.stderr, done.stderr
    return errors[0]


@pytest.mark.parametrize("command, option, value, says", [
    ("serve", "--port", "99999", "--port: expected an integer in 0..65535, got '99999'"),
    ("serve", "--port", "65536", "--port: expected an integer in 0..65535, got '65536'"),
    ("serve", "--port", "-1", "--port: expected an integer in 0..65535, got '-1'"),
    ("serve", "--port", "http", "--port: expected an integer in 0..65535, got 'http'"),
    ("serve", "--max-num-seqs", "0", "max_num_seqs=0"),
    ("serve", "--block-size", "-4", "block_size=-4"),
    ("serve", "--max-waiting", "-1", "max_waiting=-1"),
    ("serve", "--drain-timeout", "-1", "drain_timeout=-1.0"),
    ("serve", "--max-request-bytes", "0", "max_request_bytes=0"),
    ("generate", "--max-new-tokens", "-3", "--max-new-tokens: expected an integer >= 1, got '-3'"),
    ("generate", "--max-new-tokens", "0", "--max-new-tokens: expected an integer >= 1, got '0'"),
    ("generate", "--seed", "-1", "--seed: expected an integer >= 0, got '-1'"),
    ("generate", "--top-k", "-2", "top_k"),
    ("chat", "--max-new-tokens", "1.5", "--max-new-tokens: expected an integer >= 1, got '1.5'"),
])
def test_a_number_out_of_range_is_refused_before_the_model_is_looked_for(command, option,
                                                                          value, says, tmp_path):
    args = [command, "--model", str(tmp_path / "nowhere"), f"{option}={value}"]
    line = error_line(cli(*args[:3], *(["hi"] if command == "generate" else []), *args[3:]))
    assert says in line and "checkpoint" not in line


def test_a_prompt_too_long_is_refused_before_it_is_shown(tiny_chat_model):
    done = cli("generate", "--model", tiny_chat_model.path, "The cat", "--max-new-tokens",
               "100000")
    assert "exceeds the model's" in error_line(done)       # stdout empty: no prompt shown


def test_an_error_while_streaming_ends_the_text_s_line_first(tiny_chat_model):
    """The error line goes below the text, not after it on the same line."""
    from io import StringIO

    from minitransformer.__main__ import stream_text

    def tokens():
        yield from tiny_chat_model.tokenizer.encode(" sat on")
        raise ValueError("the engine refused it")
    out = StringIO()
    with pytest.raises(ValueError, match="refused"):
        stream_text(tiny_chat_model, tiny_chat_model.tokenizer.encode("The cat"), tokens(), out)
    assert out.getvalue() == " sat on\n"


def test_generate_into_a_closed_pipe_ends_quietly(tiny_chat_model):
    """generate ... | head: the reader goes away; no traceback, exit 141 (128 + SIGPIPE)."""
    read, write = os.pipe()
    os.close(read)                  # the reader has gone before the first byte is written
    try:
        done = subprocess.run([sys.executable, "-m", "minitransformer", "generate", "--model",
                               tiny_chat_model.path, "The cat", "--max-new-tokens", "30"],
                              cwd=ROOT, stdout=write, stderr=subprocess.PIPE, text=True,
                              timeout=120, env=os.environ | ONE_ROUTE)
    finally:
        os.close(write)
    assert done.returncode == 141 and "Traceback" not in done.stderr, done.stderr
    assert "error" not in done.stderr.lower()


def test_serve_names_a_busy_port_and_says_where_it_serves_once_bound(tiny_chat_model):
    pytest.importorskip("uvicorn")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = cli("serve", "--model", tiny_chat_model.path, "--port", str(port))
    assert error_line(done).startswith(f"error: cannot listen on 127.0.0.1:{port}: ")
    assert "serving" not in done.stderr
    server = subprocess.Popen([sys.executable, "-m", "minitransformer", "serve", "--model",
                               tiny_chat_model.path, "--port", "0"], cwd=ROOT,
                              stderr=subprocess.PIPE, text=True)
    try:                            # port 0: the port the system gave is the one announced
        said = (re.search(r" on (http://\S+)/v1$", line) for line in  # after the load's lines
                iter(server.stderr.readline, ""))
        url = next(found for found in said if found).group(1)

        def up():
            try:
                return urllib.request.urlopen(url + "/health", timeout=5).status == 200
            except OSError:
                return False
        wait_for(up, timeout=60)
        server.send_signal(signal.SIGINT)
        assert server.wait(30) == 0
    finally:
        server.kill()
        server.wait()
        server.stderr.close()


def test_bad_model_is_one_error_line(tmp_path):
    done = cli("generate", "--model", str(tmp_path / "nowhere"), "hi")
    assert done.returncode == 2 and done.stderr.startswith("error: ")
    assert "checkpoint directory not found" in done.stderr


def test_bad_sampling_is_refused_before_anything_is_loaded_or_printed(tmp_path):
    # the model does not exist either: the settings are checked first
    done = cli("generate", "--model", str(tmp_path / "nowhere"), "hi", "--temperature", "-1")
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == "error: temperature must be a finite number >= 0, got -1.0\n"


def with_sampling_defaults(model, tmp_path, defaults):
    """A copy of the checkpoint whose generation_config.json also gives sampling defaults."""
    for file in Path(model.path).iterdir():
        shutil.copy(file, tmp_path / file.name)
    config = json.loads((tmp_path / "generation_config.json").read_text())
    (tmp_path / "generation_config.json").write_text(json.dumps(config | defaults))
    return tmp_path


def test_the_checkpoints_sampling_defaults_are_used_unless_given(tiny_chat_model, tmp_path):
    defaults = {"do_sample": True, "temperature": 0.7, "top_k": 20, "repetition_penalty": 1.3}
    path = with_sampling_defaults(tiny_chat_model, tmp_path, defaults)
    model, prompt = mt.load(path), "The cat sat"
    ids = model.tokenizer.encode(prompt)
    done = cli("generate", "--model", str(path), prompt, "--max-new-tokens", "12", "--seed", "5")
    assert done.returncode == 0, done.stderr
    assert done.stdout == prompt + continuation(model, ids, 12, seed=5, **defaults) + "\n"
    assert "temperature 0.7 (generation_config.json)" in done.stderr
    done = cli("generate", "--model", str(path), prompt, "--max-new-tokens", "12", "--seed", "5",
               "--temperature", "0.5")               # the command line wins
    assert done.stdout == prompt + continuation(model, ids, 12, seed=5,
                                                **defaults | {"temperature": 0.5}) + "\n"
    assert "temperature 0.5 (command line)" in done.stderr
    chat_ids = encode_chat(model, [{"role": "user", "content": prompt}])
    done = cli("chat", "--model", str(path), "--max-new-tokens", "8", "--seed", "2",
               stdin=f"{prompt}\n")
    assert done.stdout == ("you> model> " + continuation(model, chat_ids, 8, seed=2, **defaults)
                           + "\nyou> \n")


@pytest.mark.parametrize("bad", [{"temperature": -1}, {"top_p": 0}, {"top_k": "many"}])
def test_a_bad_sampling_default_in_the_checkpoint_is_one_error_line(tiny_chat_model, tmp_path,
                                                                    bad):
    path = with_sampling_defaults(tiny_chat_model, tmp_path, bad)
    done = cli("generate", "--model", str(path), "hi")
    *said, error = done.stderr.splitlines()         # what the load said it did, then the error
    assert done.returncode == 2 and error.startswith("error: ") and said == [f"loading {path}"]
    assert "generation_config.json" in error and "Traceback" not in done.stderr


def test_reset_says_so_and_starts_over(tiny_chat_model):
    model, prompt = tiny_chat_model, "The cat sat"
    done = cli("chat", "--model", model.path, "--max-new-tokens", "6",
               stdin=f"hello\n/reset\n{prompt}\n")
    ids = encode_chat(model, [{"role": "user", "content": prompt}])   # hello forgotten
    assert "you> (conversation cleared: the next line starts a new one)\nyou> model> " \
        + continuation(model, ids, 6, **CHAT) + "\nyou> " in done.stdout


def test_help_is_plain_text_with_each_default_once():
    for command in ([], ["generate"], ["chat"], ["serve"]):
        text = cli(*command, "--help").stdout
        assert "``" not in text and ":class:" not in text and "(default: None)" not in text
        options = re.split(r"\n  (?=-)", text)[1:]          # one block per option
        assert command == [] or len(options) > 5
        for block in options:
            if not block.startswith("-h"):
                assert block.count("(default:") == 1, block
    serve = " ".join(cli("serve", "--help").stdout.split())
    assert "--host HOST address to listen on (default: 127.0.0.1" in serve
    assert "--port PORT TCP port, 0 for any free one (default: 8000)" in serve
    assert serve.count("folder name)") == 1


def tmux_session(name):
    """-> (tmux(*args), screen(), wait_for(text, count)) for one detached session, on a tmux
    server of its own (-L name; ended by `tmux -L name kill-server`): on the one default server,
    a test in another worker killing the last session ends the server while this one starts
    its session (a CalledProcessError seen in a whole-suite run)."""
    def tmux(*args):
        return subprocess.run(["tmux", "-L", name, *args], capture_output=True, text=True,
                              check=True).stdout

    def screen():
        return tmux("capture-pane", "-p", "-J", "-t", name)

    def wait_for(text, count=1):
        for _ in range(600):        # at most 60 s
            if screen().count(text) >= count:
                return
            time.sleep(0.1)
        raise AssertionError(f"{text!r} never appeared; the screen:\n{screen()}")
    return tmux, screen, wait_for


def end_tmux(name):
    """End the session's own tmux server and remove its socket (tmux leaves the file)."""
    path = subprocess.run(["tmux", "-L", name, "display-message", "-p", "#{socket_path}"],
                          capture_output=True, text=True).stdout.strip()
    subprocess.run(["tmux", "-L", name, "kill-server"], capture_output=True)
    if path:
        Path(path).unlink(missing_ok=True)


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_keys_typed_while_the_model_answers_are_discarded(story_chat_model):
    """An Enter pressed during an answer used to be read afterwards as an empty line, which
    ends the session: it is thrown away, and the next prompt waits for the person."""
    model, session = story_chat_model, f"mt-chat-{uuid.uuid4().hex[:8]}"
    tmux, screen, wait_for = tmux_session(session)
    command = f"{sys.executable} -m minitransformer chat --model {model.path} " \
              f"--max-new-tokens 200"
    tmux("new-session", "-d", "-s", session, "-x", "200", "-y", "50", "-c", str(ROOT), command)
    try:
        wait_for("you>")
        tmux("send-keys", "-t", session, "Once upon a time", "Enter", "Enter", "x", "Enter")
        wait_for("you>", 2)
        time.sleep(1)
        assert screen().count("you>") == 2 and "model> x" not in screen(), screen()
        tmux("send-keys", "-t", session, "The dog was happy", "Enter")
        wait_for("you>", 3)                 # still chatting: the typed-ahead lines were dropped
        assert "you> The dog was happy\nmodel> " in screen()
    finally:
        end_tmux(session)


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_chat_in_a_real_terminal(story_chat_model, tmp_path):
    """Type into the chat under tmux, as a person would, and read the screen: the answers as
    the model makes them, and nothing else in their lines. With a tuning file of its own, so
    that what a step measures the first time (blas.measured_split) is measured during the
    answers, as on a fresh machine (it printed its lines into them: seen in a clean run)."""
    model, session = story_chat_model, f"mt-chat-{uuid.uuid4().hex[:8]}"
    tmux, screen, wait_for = tmux_session(session)
    command = f"env MT_TUNING_CACHE={tmp_path / 'tuning.json'} {sys.executable} -m " \
              f"minitransformer chat --model {model.path} --max-new-tokens 16"
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
            replies.append(continuation(model, ids, 16, **CHAT))
            messages.append({"role": "assistant", "content": replies[-1]})
        shown = screen()
        for line, reply in zip(turns, replies, strict=True):
            assert f"you> {line}\nmodel> {reply}\n" in shown, shown
    finally:
        end_tmux(session)


def test_model_names_and_the_offline_fallback(monkeypatch, capsys):
    import minitransformer.checkpoints.real_model as real_model
    from minitransformer.__main__ import model_path
    from minitransformer.checkpoints.synth import default_model

    def offline(notify=None):
        raise real_model.FetchError("no network")
    monkeypatch.setattr(real_model, "is_imported", lambda path: False)
    monkeypatch.setattr(real_model, "smollm2", offline)
    assert model_path("some/dir") == "some/dir"
    assert model_path("default") == str(default_model())
    assert model_path(None) == str(default_model())
    assert "SmolLM2 unavailable (no network)" in capsys.readouterr().err


def test_a_command_says_what_it_loads_and_measures_once_on_stderr(stories, tmp_path):
    """No silent wait: generate names the checkpoint it loads and, where this machine has not
    measured the model's products yet (an empty tuning file, products left to measure), says
    that it measures them, a line per weight shape as it goes; the next run reads what the
    first measured and says only what it loads."""
    env = {k: v for k, v in os.environ.items() if k not in ("MT_PRODUCTS", "MT_LAYOUT")}
    env |= {"MT_TUNING_CACHE": str(tmp_path / "tuning.json"), "MT_TUNING": "remember"}
    runs = [subprocess.run([sys.executable, "-m", "minitransformer", "generate", "--model",
                            stories.path, "Once", "--max-new-tokens", "2"], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=120) for _ in range(2)]
    assert [run.returncode for run in runs] == [0, 0]
    first, second = (run.stderr.splitlines() for run in runs)
    shapes = {w.shape for w in [stories.layers[0].qkv, stories.layers[0].o,
                                stories.layers[0].gate_up, stories.layers[0].down]}
    assert first[0] == second[0] == f"loading {stories.path}"
    measuring = [line for line in first if line.startswith("measuring how this machine")]
    kept = f"kept in {tmp_path / 'tuning.json'}: what this machine measured, read back at the " \
        "next load"
    assert first[1] == measuring[0] and first[2] == kept       # said once, after it was kept
    assert [line for line in first[1:2 + len(measuring)] if line != kept] == measuring
    assert len(measuring) >= len(shapes)
    assert all(f"{n}x{k} float32 weight" in " ".join(measuring) for n, k in shapes)
    assert not [line for line in second if "measuring" in line]
