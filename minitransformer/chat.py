"""Chat messages -> prompt token ids, through the checkpoint's own chat template.

An instruction-tuned model was trained on conversations laid out in one exact way (role
markers, special tokens, where the answer begins); the checkpoint ships that layout as a Jinja
template, and a server must apply it exactly, or the model reads a format it never saw. We do
what transformers' ``apply_chat_template`` does: a sandboxed Jinja environment with
``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension, a ``tojson`` filter that
keeps non-ASCII text, ``raise_exception`` and ``strftime_now``; the template sees ``messages``,
``add_generation_prompt`` and the special tokens by name (``bos_token``, ``eos_token``...). The
rendered text already holds its special tokens, so it is encoded without adding a BOS again
(the trap: a doubled ``<s>``).

The template is the tokenizer's: from ``tokenizer_config.json`` or the GGUF metadata.
Needs jinja2 (the ``serve`` extra). Leaves out: tools, documents, assistant-token masks.
"""
import json
from datetime import datetime
from pathlib import Path

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")


def special_tokens(model) -> dict:
    """bos_token, eos_token, ... as strings, the way templates refer to them: from
    tokenizer_config.json beside the weights, else the model's bos and first eos ids."""
    tokenizer, tokens = model.tokenizer, dict.fromkeys(SPECIAL_TOKENS)
    if tokenizer.bos_token_id is not None:
        tokens["bos_token"] = tokenizer.backend.id_to_token(tokenizer.bos_token_id)
    if model.eos_token_ids:
        tokens["eos_token"] = tokenizer.backend.id_to_token(model.eos_token_ids[0])
    file = Path(model.path) / "tokenizer_config.json"
    settings = json.loads(file.read_text()) if file.is_file() else {}
    for name in SPECIAL_TOKENS:
        value = settings.get(name)
        value = value.get("content") if isinstance(value, dict) else value
        tokens[name] = value if isinstance(value, str) else tokens[name]
    return tokens


def render(template: str, messages: list, add_generation_prompt: bool = True,
           **tokens) -> str:
    """Apply a chat template to [{"role": ..., "content": ...}, ...] -> the prompt text.

    >>> template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\\n"
    ...             "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
    >>> render(template, [{"role": "user", "content": "Hi"}])
    '<|user|>Hi\\n<|assistant|>'
    """
    try:
        import jinja2
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise ImportError("chat templates need jinja2: pip install -e '.[serve]'") from None

    def raise_exception(message):   # the template refuses the messages: the caller's mistake
        raise ValueError(f"the chat template refuses these messages: {message}")

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                          separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template).render(messages=messages,
                                            add_generation_prompt=add_generation_prompt,
                                            **tokens)


def check_messages(messages) -> list:
    """Messages as the OpenAI API sends them; a clear ValueError naming what is wrong."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError(f"messages[{i}] must be an object with a string 'role'")
        if not isinstance(m.get("content"), str):
            raise ValueError(f"messages[{i}].content must be a string")
    return messages


def chat_ids(tokenizer, messages: list, add_generation_prompt: bool = True,
             **tokens) -> list[int]:
    """Messages -> prompt ids by the tokenizer's chat template (ValueError if it has none).
    The special tokens are in the rendered text already: none is added by encoding it."""
    if tokenizer.chat_template is None:
        raise ValueError("the tokenizer has no chat template (no 'chat_template' in "
                         "tokenizer_config.json or the GGUF metadata)")
    tokens.setdefault("bos_token", None if tokenizer.bos_token_id is None else
                      tokenizer.backend.id_to_token(tokenizer.bos_token_id))
    text = render(tokenizer.chat_template, check_messages(messages), add_generation_prompt,
                  **tokens)
    # encode_batch, not encode: it lets other threads run (see tokenizer.encode_text)
    return tokenizer.backend.encode_batch([text], add_special_tokens=False)[0].ids


def encode_chat(model, messages: list, add_generation_prompt: bool = True) -> list[int]:
    """Messages -> prompt ids for this model, its special tokens known to the template."""
    if model.tokenizer is None:
        raise ValueError(f"{model.path}: the model has no tokenizer")
    return chat_ids(model.tokenizer, messages, add_generation_prompt, **special_tokens(model))
