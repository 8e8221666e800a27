"""Text <-> token ids through a Hugging Face ``tokenizer.json`` (the `tokenizers` library).

The one family difference that matters for generation is the beginning-of-sequence token:
Llama checkpoints want ``<s>`` in front of every prompt, Qwen2 checkpoints use none. Most
tokenizer.json files already say so in their post-processor; ``tokenizer_config.json``'s
``add_bos_token`` is honoured as well, for files whose post-processor does not add it.

An instruct model was trained on conversations laid out by its chat template (a Jinja
template in ``tokenizer_config.json``); ``chat_prompt`` renders one, so a question is asked
the way the model learned to answer.
"""
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from minitransformer.checks import read_json_object
from minitransformer.errors import CheckpointError

if TYPE_CHECKING:  # for the type only: load_tokenizer imports it when it runs
    from tokenizers import Tokenizer as HFTokenizer


@dataclass(frozen=True)
class Tokenizer:
    backend: "HFTokenizer"   # the tokenizers library's
    bos_token_id: int | None  # prepended by encode() when the family expects it
    add_bos: bool
    chat_template: str | None = None  # Jinja source from tokenizer_config.json, if any

    def encode(self, text: str) -> list[int]:
        ids = encode_text(self.backend, text)
        if self.add_bos and self.bos_token_id is not None and ids[:1] != [self.bos_token_id]:
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=True)

    def chat_prompt(self, messages, add_generation_prompt: bool = True) -> list[int]:
        """[{"role": "user", "content": "..."}] -> token ids laid out by the chat template,
        ending where the assistant's answer starts (see chat.py; needs jinja2)."""
        from minitransformer.chat import chat_ids

        return chat_ids(self, messages, add_generation_prompt)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)


def encode_text(backend, text: str, add_special_tokens: bool = True) -> list[int]:
    """text -> ids through a `tokenizers` backend, letting other threads run meanwhile:
    ``encode`` holds Python's lock for the whole text (a second per megabyte), ``encode_batch``
    of one text gives the same ids and releases it, so a server stays responsive."""
    return backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids


def encode_prompt(model, text: str, what: str = "the prompt") -> list[int]:
    """A model's text -> its token ids, or a ValueError naming the checkpoint when it has no
    tokenizer (what: the text's name in that message)."""
    if model.tokenizer is None:
        raise ValueError(f"{model.path}: no tokenizer.json, cannot encode {what}")
    return model.tokenizer.encode(text)


def load_tokenizer(path) -> Tokenizer | None:
    """Checkpoint directory -> Tokenizer, or None when it has no tokenizer.json."""
    from tokenizers import Tokenizer as HFTokenizer  # imported here: a model runs without it

    path = Path(path)
    file = path / "tokenizer.json"
    if not file.is_file():
        return None
    try:
        backend = HFTokenizer.from_file(str(file))
    except Exception as e:  # tokenizers raises a bare Exception on bad JSON
        raise CheckpointError(f"{file}: cannot be read as a tokenizer ({e})") from None
    settings = {}
    config_file = path / "tokenizer_config.json"
    if config_file.is_file():
        settings = read_json_object(config_file)
    bos = settings.get("bos_token")
    bos = bos.get("content") if isinstance(bos, dict) else bos  # AddedToken form: {content: ..}
    if bos is not None and not isinstance(bos, str):
        raise CheckpointError(f"{config_file}: field 'bos_token' must be a string, an object "
                              f"with a string 'content', or null; got {bos!r:.100}")
    add_bos = settings.get("add_bos_token")
    if add_bos is not None and not isinstance(add_bos, bool):
        raise CheckpointError(f"{config_file}: field 'add_bos_token' must be true or false, "
                              f"got {add_bos!r:.100}")
    bos_id = backend.token_to_id(bos) if bos is not None else None
    template = settings.get("chat_template")
    return Tokenizer(backend, bos_id, bool(add_bos),
                     template if isinstance(template, str) else None)
