"""Checkpoints made by code: the embedded default model and the random test models.

Nothing here is downloaded. ``make_checkpoint`` writes a complete Hugging Face checkpoint
directory (config.json, model.safetensors, generation_config.json and, when the vocabulary is
large enough, a real byte-level BPE tokenizer.json trained right here on a few paragraphs
written for this project) from a seed, deterministically. ``default_model`` builds the model
the README's main command runs on, once, into ``weights/default/``.

The weights are random (normal, std 0.02), so the default model writes fluent nonsense: it
exists to have the shape of a real model and to make every table of the chapter come out of
real arithmetic in seconds, not to say anything. ``qwen25_05b_config`` gives the chapter's
model's exact shape, for benchmarks on a same-sized random checkpoint.
"""
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

# Text to train the default tokenizer on: written for this project (no outside text).
CORPUS = """\
To generate a token, a decoder-only transformer takes the whole sequence so far, runs it
through every layer, and reads a probability distribution off the last position. Then it
appends the chosen token and does it again. The keys and values of an earlier position never
change, so we store them: that store is the key-value cache. Prefill runs the prompt through
the model once; decode adds one token at a time and attends over the cache.
The cache trades arithmetic for memory. For every token of context, every layer keeps one key
vector and one value vector per key-value head. Grouped-query attention shares each key-value
head among a group of query heads, and the cache shrinks by the size of the group.
Decode is memory-bound: the weights are dragged across the bus to produce one token, and the
arithmetic units sit idle. So run many requests together, and the weights, read once, serve
them all. Continuous batching admits a waiting request the moment a slot is free. A paged
cache stores each sequence in fixed-size blocks through a block table, and sequences that
share a prompt share its blocks.
Quantization stores the same function in fewer bits. A scale per tensor, per row or per group
maps the largest weight onto the largest integer; outliers set the step for everyone else.
Speculative decoding lets a small draft model propose a few tokens that the target model
verifies in one pass; a token is kept only if the target would have chosen it.
Once upon a time a small robot lived in a quiet town by the sea. Every morning it counted the
boats, read the weather, and told the children a story about the stars, the moon and the sun.
The cat sat on the mat. The dog ran to the park. She poured the milk into the jug, and he
poured the tea into the cup. One, two, three, four, five, six, seven, eight, nine, ten.
"""
SPECIAL = "<|endoftext|>"
GENERATOR_VERSION = "default-model-v1"


def default_config(vocab_size: int) -> dict:
    """The embedded default model: a small Qwen2 (q/k/v bias, tied head, GQA 8:2)."""
    return qwen2_config(vocab_size=vocab_size, hidden_size=512, intermediate_size=1536,
                        num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
                        max_position_embeddings=4096, rope_theta=1_000_000.0)


def qwen2_config(**fields) -> dict:
    """A Qwen2 config.json as a dict; defaults are a tiny model, fields override them."""
    config = {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
        "vocab_size": 96, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": True,
        "use_sliding_window": False, "bos_token_id": 0, "eos_token_id": 0,
        "torch_dtype": "float32",
    }
    return config | fields


def llama_config(**fields) -> dict:
    """A Llama config.json as a dict (no biases unless attention_bias)."""
    config = qwen2_config(architectures=["LlamaForCausalLM"], model_type="llama",
                          attention_bias=False, tie_word_embeddings=False, rms_norm_eps=1e-5)
    return config | fields


def qwen3_config(**fields) -> dict:
    """A Qwen3 config.json as a dict: Llama's projections (no biases unless attention_bias),
    q/k norms, a head_dim of its own (16 here, not hidden / heads = 8)."""
    config = qwen2_config(architectures=["Qwen3ForCausalLM"], model_type="qwen3",
                          attention_bias=False, head_dim=16)
    return config | fields


def mistral_config(**fields) -> dict:
    """A Mistral config.json as a dict: Llama's layers, each seeing the last sliding_window
    positions (8 here)."""
    config = llama_config(architectures=["MistralForCausalLM"], model_type="mistral",
                          sliding_window=8)
    return config | fields


def qwen25_05b_config() -> dict:
    """Qwen2.5-0.5B's config.json: the chapter's model (24 x 896, 14 q heads, 2 kv heads)."""
    return qwen2_config(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                        num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                        max_position_embeddings=32768, rope_theta=1_000_000.0,
                        bos_token_id=151643, eos_token_id=151643, torch_dtype="bfloat16")


def train_tokenizer(vocab_size: int = 1024):
    """A byte-level BPE tokenizer (the kind Qwen2 uses) trained on CORPUS; deterministic."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[SPECIAL],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(CORPUS.splitlines(), trainer)
    return tokenizer


def random_weights(config: dict, seed: int = 0) -> dict:
    """Every tensor the config implies, float32, normal(0, 0.02); norm gains near 1."""
    from minitransformer.config import ModelConfig
    from minitransformer.shape import tensor_shapes

    rng = np.random.default_rng(seed)
    weights = {}
    for name, shape in tensor_shapes(ModelConfig.from_dict(config)).items():
        x = rng.standard_normal(shape, dtype=np.float32)
        weights[name] = (1.0 + 0.1 * x) if name.endswith("norm.weight") else 0.02 * x
    return weights


def random_model(config: dict, seed: int = 0):
    """A Model in memory with random_weights, no files (for worked examples)."""
    from minitransformer.backend import to_device
    from minitransformer.config import ModelConfig
    from minitransformer.model import Model

    weights = {name: to_device(w) for name, w in random_weights(config, seed).items()}
    return Model(ModelConfig.from_dict(config), weights, eos_token_ids=(config["eos_token_id"],))


def make_checkpoint(path, config: dict, seed: int = 0, dtype: str = "float32",
                    tokenizer=None) -> Path:
    """Write a complete random checkpoint directory; -> its path."""
    from minitransformer.formats.safetensors_io import write_tensors

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = config | {"torch_dtype": dtype}
    (path / "config.json").write_text(json.dumps(config, indent=2))
    eos = config.get("eos_token_id")
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}, indent=2))
    write_tensors(path / "model.safetensors", random_weights(config, seed), dtype)
    if tokenizer is not None:
        tokenizer.save(str(path / "tokenizer.json"))
        (path / "tokenizer_config.json").write_text(json.dumps(
            {"add_bos_token": False, "eos_token": SPECIAL, "bos_token": None}, indent=2))
    return path


class WeightsFolderError(OSError):
    """The weights folder cannot be written (read-only, not a folder, no permission): its
    message is one line naming the folder and MT_WEIGHTS_DIR, which moves it."""


def weights_dir() -> Path:
    """Where checkpoints live: $MT_WEIGHTS_DIR; else, run from the repository (a checkout, or
    an editable install of one: weights/README.md is there), its weights/ folder, as the
    README's commands expect; else (an installed wheel: never inside site-packages, which an
    uninstall would leave half a gigabyte in) the user's cache folder,
    $XDG_CACHE_HOME/minitransformer/weights (~/.cache/minitransformer/weights)."""
    if os.environ.get("MT_WEIGHTS_DIR"):
        return Path(os.environ["MT_WEIGHTS_DIR"]).expanduser()
    checkout = Path(__file__).resolve().parents[2]
    if (checkout / "weights" / "README.md").is_file():
        return checkout / "weights"
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "minitransformer" / "weights"


def writable(folder: Path) -> Path:
    """folder, made where missing and written to once (a file made and removed) -> folder;
    WeightsFolderError where it cannot be: one line, not a raw Errno from the first write."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as e:
        raise WeightsFolderError(f"cannot write to the weights folder {folder} "
                                 f"({e.strerror or e}): MT_WEIGHTS_DIR=FOLDER puts the models "
                                 f"in another") from None
    return folder


def write_whole(path: Path, write, stamp: str, version: str) -> Path:
    """write(folder) fills a sibling ``path.partial`` folder, which gets a file `stamp` holding
    `version` and then replaces path: a checkpoint cut off halfway is never found under path,
    and ``is_written`` tells a finished one of this version. -> path. A folder that cannot be
    written is WeightsFolderError, before anything is made."""
    writable(path.parent)
    partial = path.with_name(path.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    try:
        write(partial)
        (partial / stamp).write_text(version)
    except BaseException:       # an error, or Ctrl-C: no half-written folder is left behind
        shutil.rmtree(partial, ignore_errors=True)
        raise
    shutil.rmtree(path, ignore_errors=True)
    partial.rename(path)
    return path


def is_written(path, stamp: str, version: str) -> bool:
    """Did ``write_whole`` finish path, with this version?"""
    file = Path(path) / stamp
    return file.is_file() and file.read_text() == version


def default_model() -> Path:
    """Path of the embedded default model, generating it on first use (about a second)."""
    path = weights_dir() / "default"
    if is_written(path, "GENERATED", GENERATOR_VERSION):
        return path
    from minitransformer.shape import ceil_div

    tokenizer = train_tokenizer()
    vocab = ceil_div(tokenizer.get_vocab_size(), 64) * 64  # a multiple of 64, as Qwen pads it
    eos = tokenizer.token_to_id(SPECIAL)
    config = default_config(vocab) | {"bos_token_id": eos, "eos_token_id": eos}
    return write_whole(path, lambda partial: make_checkpoint(partial, config, seed=0,
                                                             tokenizer=tokenizer),
                       "GENERATED", GENERATOR_VERSION)
