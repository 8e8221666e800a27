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

The template comes from ``chat_template.jinja`` beside the weights, else ``tokenizer_config.json``
(a string, or a list of named templates: the one named "default").
Needs jinja2 (the ``serve`` extra). Leaves out: tools, documents, assistant-token masks.
"""
import json
from datetime import datetime
from pathlib import Path

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")


def tokenizer_settings(path) -> dict:
    """tokenizer_config.json of a checkpoint directory as a dict ({} when absent)."""
    file = Path(path) / "tokenizer_config.json"
    return json.loads(file.read_text()) if file.is_file() else {}


def chat_template(path) -> str | None:
    """The checkpoint's chat template source, or None when it has none."""
    path = Path(path)
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text()
    template = tokenizer_settings(path).get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
        template = {t.get("name"): t.get("template") for t in template}.get("default")
    return template if isinstance(template, str) else None


def special_tokens(path) -> dict:
    """bos_token, eos_token, ... as strings, the way templates refer to them."""
    settings, tokens = tokenizer_settings(path), {}
    for name in SPECIAL_TOKENS:
        value = settings.get(name)
        tokens[name] = value.get("content") if isinstance(value, dict) else value
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

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

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


def encode_chat(model, messages: list, add_generation_prompt: bool = True) -> list[int]:
    """Messages -> prompt ids for this model (ValueError if it has no template/tokenizer)."""
    if model.tokenizer is None:
        raise ValueError(f"{model.path}: the model has no tokenizer")
    template = chat_template(model.path)
    if template is None:
        raise ValueError(f"{model.path}: the checkpoint has no chat template "
                         f"(tokenizer_config.json has no 'chat_template')")
    text = render(template, check_messages(messages), add_generation_prompt,
                  **special_tokens(model.path))
    return model.tokenizer.backend.encode(text, add_special_tokens=False).ids
