"""Qwen3, Llama 3.x and Mistral (a sliding window of 4 positions, under a prompt and answer of
more) checkpoints through the command line and the OpenAI server, unchanged: what a person
sees is generate's text, as for Qwen2 (tests/test_families.py holds the engine's tokens;
tests/test_golden.py the logits against transformers)."""
import json
import os
import subprocess
import sys

import pytest

import minitransformer as mt
from minitransformer.checkpoints.synth import (
    llama_config,
    make_checkpoint,
    mistral_config,
    qwen3_config,
    train_tokenizer,
)
from minitransformer.serve.config import EngineConfig
from minitransformer.serve.engine import Engine
from minitransformer.serve.online import OnlineEngine
from servers import TEMPLATE, Background, expected

pytest.importorskip("openai")
import openai

from minitransformer.serve.http import create_app

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}
CONFIGS = {"qwen3": qwen3_config(vocab_size=320),
           "llama3": llama_config(vocab_size=320, head_dim=16, rope_scaling=LLAMA3),
           "mistral": mistral_config(vocab_size=320, sliding_window=4)}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def model(request, tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp(request.param), CONFIGS[request.param],
                           tokenizer=train_tokenizer(300))
    settings = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps(settings | {"chat_template":
                                                                       TEMPLATE}))
    return mt.load(path)


def test_generate_on_the_command_line_prints_generates_text(model):
    prompt = "The cat sat on the"
    done = subprocess.run([sys.executable, "-m", "minitransformer", "generate", "--model",
                           model.path, prompt, "--max-new-tokens", "12"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    ids = model.tokenizer.encode(prompt)
    assert done.stdout == prompt + expected(model, ids, 12)[1] + "\n"


def test_the_server_answers_with_generates_text(model):
    online = OnlineEngine(Engine(model, EngineConfig(max_num_seqs=2, block_size=4,
                                                     batch_invariant=True)))
    server = Background(create_app(online, "tiny"))
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        prompt = "Once upon a time"
        assert len(model.tokenizer.encode(prompt)) > 4      # past a window of 4 at once
        answer = client.completions.create(model="tiny", prompt=prompt, max_tokens=10,
                                           temperature=0)
        _, text, finish = expected(model, model.tokenizer.encode(prompt), 10)
        assert (answer.choices[0].text, answer.choices[0].finish_reason) == (text, finish)
    finally:
        server.stop()
        online.close()
