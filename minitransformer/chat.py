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
A message's content may be a string or OpenAI's list of text parts (joined with newlines, as
vLLM does); a field of a message that the template never reads is refused, not dropped
(``check_all_read``). Needs jinja2 (the ``serve`` extra). Leaves out: tools, documents, images
and other non-text parts, assistant-token masks.
"""
import json
from datetime import datetime
from pathlib import Path

from minitransformer.checks import FieldsRead

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


class MessageError(ValueError):
    """A message that cannot be laid out as sent; ``where`` names the culprit as a path of
    the request body (``messages[1].tool_calls``, ``messages[0].content[2].type``)."""

    def __init__(self, where: str, problem: str):
        super().__init__(f"{where}: {problem}")
        self.where = where


def content_text(content, i: int) -> str:
    """A message's content -> its text: a string as it is, or OpenAI's list of parts, the text
    of each ``{"type": "text", "text": ...}`` joined with a newline (as vLLM joins them; OpenAI
    does not say). Any other part (image_url, input_audio, file, refusal) is refused, naming its
    type: this server has no way to show it to the model.

    >>> content_text([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], 0)
    'a\\nb'
    >>> content_text([{"type": "image_url", "image_url": {"url": "x"}}], 0)
    Traceback (most recent call last):
    ...
    minitransformer.chat.MessageError: messages[0].content[0].type: a part of type 'image_url'; \
this server takes text parts only
    """
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        raise MessageError(f"messages[{i}].content", "must be a string or a non-empty list of "
                           "parts ({\"type\": \"text\", \"text\": ...})")
    texts = []
    for j, part in enumerate(content):
        where = f"messages[{i}].content[{j}]"
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise MessageError(where, "must be an object with a string 'type'")
        if part["type"] != "text":
            raise MessageError(where + ".type", f"a part of type {part['type']!r:.40}; this "
                               "server takes text parts only")
        if not isinstance(part.get("text"), str):
            raise MessageError(where + ".text", "must be a string")
        extra = [key for key in part if key not in ("type", "text") and part[key] is not None]
        if extra:
            raise MessageError(f"{where}.{extra[0]:.100}", "not a field of a text part")
        texts.append(part["text"])
    return "\n".join(texts)


def check_messages(messages) -> list:
    """Messages as the OpenAI API sends them -> the messages a template sees: each content as
    text (``content_text``), each message a ``FieldsRead``, so that a field the template never
    reads can be refused (``check_all_read``); a clear ValueError naming what is wrong."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    checked = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise MessageError(f"messages[{i}]", "must be an object with a string 'role'")
        if not isinstance(m.get("content"), (str, list)):
            raise MessageError(f"messages[{i}].content", "must be a string or a list of parts")
        message = FieldsRead(m | {"content": content_text(m["content"], i)})
        message.read.update(("role", "content"))    # the message itself, whatever the template
        checked.append(message)                     # makes of them
    return checked


def check_all_read(messages: list) -> None:
    """Every field of every message beyond its role and content was read by the template: one
    it never read would be dropped from the prompt without a word (a misplaced
    ``temperature``, an assistant's ``tool_calls`` under a template that knows no tools, a
    ``name`` under most), so it is refused, naming it. A null field means the same as an
    absent one, and passes."""
    for i, m in enumerate(messages):
        unread = [field for field in m.unread() if dict.get(m, field) is not None]
        if unread:
            raise MessageError(f"messages[{i}].{unread[0]:.100}", "this model's chat template "
                               "does not read this field, so the prompt would drop it")


def chat_ids(tokenizer, messages: list, add_generation_prompt: bool = True,
             **tokens) -> list[int]:
    """Messages -> prompt ids by the tokenizer's chat template (ValueError if it has none).
    The special tokens are in the rendered text already: none is added by encoding it."""
    if tokenizer.chat_template is None:
        raise ValueError("the tokenizer has no chat template (no 'chat_template' in "
                         "tokenizer_config.json or the GGUF metadata)")
    tokens.setdefault("bos_token", None if tokenizer.bos_token_id is None else
                      tokenizer.backend.id_to_token(tokenizer.bos_token_id))
    messages = check_messages(messages)
    text = render(tokenizer.chat_template, messages, add_generation_prompt, **tokens)
    check_all_read(messages)
    # encode_batch, not encode: it lets other threads run (see tokenizer.encode_text)
    return tokenizer.backend.encode_batch([text], add_special_tokens=False)[0].ids


def encode_chat(model, messages: list, add_generation_prompt: bool = True) -> list[int]:
    """Messages -> prompt ids for this model, its special tokens known to the template."""
    if model.tokenizer is None:
        raise ValueError(f"{model.path}: the model has no tokenizer")
    return chat_ids(model.tokenizer, messages, add_generation_prompt, **special_tokens(model))
