"""Download a real checkpoint from the Hugging Face Hub into weights/<name>.

The chapter's model is Qwen/Qwen2.5-0.5B (about 1 GB in bfloat16). Every other script runs on
the embedded random default model without it; pass ``--model weights/Qwen2.5-0.5B`` to run
them on real weights. Needs the hub extra (pip install -e '.[hub]') and internet access.
Only what minitransformer reads is fetched: config, generation config, tokenizer files and
the safetensors weights (with their shard index, when sharded).

    python scripts/download.py                      # -> weights/Qwen2.5-0.5B
    python scripts/download.py --repo HuggingFaceTB/SmolLM2-135M
"""
import argparse
import sys
from pathlib import Path

from _common import run

from minitransformer.checkpoints.synth import weights_dir
from minitransformer.config import load_config

FILES = ["config.json", "generation_config.json", "tokenizer*", "*.safetensors",
         "model.safetensors.index.json"]


def download(repo: str, dest: Path, revision: str | None = None) -> Path:
    """Fetch the files minitransformer needs from one Hub repository; -> the local folder."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise SystemExit("scripts/download.py needs huggingface_hub: pip install -e '.[hub]'")
    return Path(snapshot_download(repo_id=repo, revision=revision, local_dir=dest,
                                  allow_patterns=FILES))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", default="Qwen/Qwen2.5-0.5B", help="Hub id (%(default)s)")
    parser.add_argument("--revision", default=None, help="branch, tag or commit (default: main)")
    parser.add_argument("--out", type=Path, default=None,
                        help="destination folder (default: weights/<last part of the repo id>)")
    args = parser.parse_args()
    dest = args.out or weights_dir() / args.repo.split("/")[-1]
    print(f"downloading {args.repo} into {dest}", file=sys.stderr)
    path = download(args.repo, dest, args.revision)
    config = load_config(path)  # fails here, naming the field, if minitransformer can't run it
    print(f"{path}  ({config.model_type}, {config.num_hidden_layers} layers, "
          f"hidden {config.hidden_size}, stored as {config.torch_dtype})")


if __name__ == "__main__":
    run(main)
