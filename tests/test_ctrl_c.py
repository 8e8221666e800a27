"""Ctrl-C is an ordinary way to stop, sent as a real SIGINT to a real process: while a command
loads its model (generate, chat, serve) it ends with one line and exit status 130, as a shell
reports a program it stopped, never a traceback; a checkpoint or a fetch cut off leaves no
half-written folder behind; in chat, a stopped answer shows " [stopped]" and the history keeps
only the text the person saw (the next turn's prompt is counted on the screen); /exit and
/quit leave.

A load is caught in the act without timing: the command's stderr is a pipe this test has
filled, so the load's first line ("loading ...") blocks in write() until the test reads; the
test waits until the process sits in that write (its /proc/PID/syscall), sends SIGINT, then
reads on."""
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from conftest import ONE_ROUTE, wait_for
from minitransformer.chat import encode_chat
from test_cli import CHAT, ROOT, continuation, end_tmux, tmux_session

# This process multiplies as the commands do (conftest.ONE_ROUTE): their text is compared by ==.
pytestmark = pytest.mark.usefixtures("flat_products")

WRITE = {"x86_64": "1", "aarch64": "64"}.get(os.uname().machine)    # write(2)'s number


def full_pipe() -> tuple:
    """A pipe whose buffer is full: the next write to it blocks. -> (read end, write end)."""
    read, write = os.pipe()
    os.set_blocking(write, False)
    while True:
        try:
            os.write(write, b"x" * 4096)
        except BlockingIOError:
            break
    os.set_blocking(write, True)
    return read, write


def blocked_writing_stderr(pid) -> bool:
    try:
        call = Path(f"/proc/{pid}/syscall").read_text().split()
    except OSError:
        return False
    return call[:2] == [WRITE, "0x2"]


@pytest.mark.skipif(WRITE is None or not Path("/proc/self/syscall").exists(),
                    reason="needs Linux's /proc/PID/syscall on x86_64 or aarch64")
@pytest.mark.parametrize("command", [["generate", "Hello"], ["chat"], ["serve", "--port", "0"]])
def test_ctrl_c_while_loading_is_one_line_and_exit_130(tiny_chat_model, tmp_path, command):
    read, write = full_pipe()
    process = subprocess.Popen(
        [sys.executable, "-m", "minitransformer", *command[:1], "--model",
         tiny_chat_model.path, *command[1:]], cwd=ROOT, stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, stderr=write, env=os.environ | ONE_ROUTE | {
            "MT_WEIGHTS_DIR": str(tmp_path)})
    os.close(write)
    try:
        wait_for(lambda: blocked_writing_stderr(process.pid) or process.poll() is not None,
                 timeout=120)
        assert process.poll() is None, "the command ended before its first line"
        process.send_signal(signal.SIGINT)
        with os.fdopen(read, "rb") as pipe:
            said = pipe.read().lstrip(b"x").decode()
        assert process.wait(60) == 130, said
    finally:
        process.kill()
        process.wait()
        process.stdin.close()
        process.stdout.close()
    # the line the load had begun (cut where the signal came), then the one line
    assert said.endswith("stopped (Ctrl-C)\n") and "Traceback" not in said, said
    # (the load's line may be cut to nothing: the signal can come before any of it is written)
    assert said.startswith(("loading ", "stopped (Ctrl-C)")) and len(said.splitlines()) <= 2, said
    assert list(tmp_path.iterdir()) == []       # nothing written, nothing half-written


BLOCKED = """
import os, signal, sys
from pathlib import Path
from minitransformer.checkpoints.real_model import smollm2
from minitransformer.checkpoints.synth import write_whole

fifo, root, which = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]

def stuck(folder):                  # writes a file, then waits on a FIFO nobody writes to
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.safetensors").write_bytes(b"half")
    print("writing", flush=True)
    return fifo.read_bytes()

if which == "checkpoint":
    write_whole(root / "model", stuck, "STAMP", "v1")
else:                               # a fetch: the download cut off
    smollm2(weights_dir=root, download=stuck)
"""


@pytest.mark.parametrize("which", ["checkpoint", "fetch"])
def test_ctrl_c_while_writing_a_checkpoint_or_fetching_leaves_nothing_half_written(tmp_path,
                                                                                   which):
    fifo, root = tmp_path / "never", tmp_path / "weights"
    os.mkfifo(fifo)
    process = subprocess.Popen([sys.executable, "-c", BLOCKED, str(fifo), str(root), which],
                               cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    try:
        assert process.stdout.readline() == "writing\n", process.stderr.read()
        assert any(root.rglob("model.safetensors"))     # a half-written file is there now
        process.send_signal(signal.SIGINT)
        process.wait(60)
        assert "KeyboardInterrupt" in process.stderr.read()
    finally:
        process.kill()
        process.wait()
        process.stdout.close()
        process.stderr.close()
    assert list(root.iterdir()) == []


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_a_stopped_answer_shows_its_marker_and_the_history_keeps_what_was_shown(
        story_chat_model):
    model, session = story_chat_model, f"mt-chat-{uuid.uuid4().hex[:8]}"
    tmux, screen, wait_for_text = tmux_session(session)
    command = f"MT_PRODUCTS={ONE_ROUTE['MT_PRODUCTS']} {sys.executable} -m minitransformer " \
              f"chat --model {model.path} --max-new-tokens 400; echo EXITED $?; sleep 60"
    tmux("new-session", "-d", "-s", session, "-x", "250", "-y", "80", "-c", str(ROOT), command)
    try:
        wait_for_text("you>")
        tmux("send-keys", "-t", session, "Once upon a time", "Enter")

        def begun():
            time.sleep(0.05)
            return re.search(r"model> \S", screen())

        wait_for(begun, timeout=60)         # the answer has begun: stop it
        tmux("send-keys", "-t", session, "C-c")
        wait_for_text("you>", 2)
        shown = screen()
        made = int(re.search(r"\[(\d+) tokens, ", shown).group(1))
        assert made < 400 and " [stopped]\n" in shown, shown
        tmux("send-keys", "-t", session, "The dog", "Enter")
        wait_for_text("you>", 3)
        prompt = int(re.findall(r"\[prefix cache: \d+ of (\d+) prompt tokens", screen())[-1])
        tmux("send-keys", "-t", session, "/exit", "Enter")
        wait_for_text("EXITED 0")
    finally:
        end_tmux(session)
    first = [{"role": "user", "content": "Once upon a time"}]
    ids = encode_chat(model, first)

    def second_prompt(answer):
        return len(encode_chat(model, first + [{"role": "assistant", "content": answer},
                                               {"role": "user", "content": "The dog"}]))
    # the answer's text as shown: `made` tokens, or one fewer when the Ctrl-C came between
    # counting a token and showing it
    seen = [continuation(model, ids, k, **CHAT) for k in (made, made - 1)]
    shown = " ".join(shown.replace("^C", "").split())     # the terminal echoes the key
    assert any(" ".join(text.split()) + " [stopped]" in shown for text in seen), shown
    assert prompt in [second_prompt(text) for text in seen], (prompt, seen)
    assert prompt != second_prompt(seen[0] + " [stopped]")


@pytest.mark.parametrize("word", ["/exit", "/quit"])
def test_exit_and_quit_leave_the_chat(story_chat_model, word):
    done = subprocess.run([sys.executable, "-m", "minitransformer", "chat", "--model",
                           story_chat_model.path], input=f"{word}\nOnce upon a time\n",
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0 and "model>" not in done.stdout, done.stdout
