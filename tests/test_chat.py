"""Chat templates rendered as transformers' apply_chat_template renders them."""
import json

import pytest

import minitransformer as mt
from minitransformer.chat import encode_chat, render
from minitransformer.checkpoints.synth import make_checkpoint, qwen2_config, train_tokenizer

jinja2 = pytest.importorskip("jinja2")

# The layout of ChatML templates (Qwen2, SmolLM2): block tags on their own lines, which
# trim_blocks / lstrip_blocks must swallow, or every turn gains stray newlines and spaces.
CHATML = """{% for message in messages %}
    {% if loop.first and message['role'] != 'system' %}
<|im_start|>system
You are helpful.<|im_end|>
    {% endif %}
<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""


def test_block_tags_leave_no_whitespace_behind():
    text = render(CHATML, [{"role": "user", "content": "Hi"}])
    assert text == ("<|im_start|>system\nYou are helpful.<|im_end|>\n"
                    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert render(CHATML, [{"role": "user", "content": "Hi"}], add_generation_prompt=False) \
        == "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"


def test_template_helpers_of_transformers():
    assert render("{{ messages | tojson }}", [{"role": "user", "content": "çay"}]) == \
        '[{"role": "user", "content": "çay"}]'              # non-ASCII kept, as transformers
    assert render("{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
                  "{{ m['content'] }}{% endfor %}", [{"role": "user", "content": "a"}] * 3) == "a"
    with pytest.raises(ValueError, match="template refuses these messages: only user"):
        render("{{ raise_exception('only user and assistant roles') }}", [{"role": "x",
                                                                             "content": ""}])
    with pytest.raises(jinja2.exceptions.SecurityError):   # the sandbox: no Python internals
        render("{{ messages.__class__.__init__.__globals__ }}", [])


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    tokenizer = train_tokenizer(300)
    path = make_checkpoint(tmp_path_factory.mktemp("chat"), qwen2_config(vocab_size=320),
                           tokenizer=tokenizer)
    settings = json.loads((path / "tokenizer_config.json").read_text())
    settings |= {"chat_template": "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: "
                                  "{{ m['content'] }}{{ eos_token }}{% endfor %}",
                 "bos_token": "<|endoftext|>", "add_bos_token": True}
    (path / "tokenizer_config.json").write_text(json.dumps(settings))
    return mt.load(path)


def test_special_tokens_are_in_the_text_once(chat_model):
    ids = encode_chat(chat_model, [{"role": "user", "content": "The cat"}])
    tokenizer, eos = chat_model.tokenizer, chat_model.tokenizer.bos_token_id
    assert ids.count(eos) == 2 and ids[0] == eos and ids[-1] == eos    # not a doubled BOS
    assert tokenizer.backend.decode(ids, skip_special_tokens=False) == \
        "<|endoftext|>user: The cat<|endoftext|>"


def test_bad_messages_and_missing_templates_are_named(chat_model, checkpoint_dir):
    with pytest.raises(ValueError, match=r"messages\[1\].content: must be a string"):
        encode_chat(chat_model, [{"role": "user", "content": "a"}, {"role": "user"}])
    with pytest.raises(ValueError, match="messages must be a non-empty list"):
        encode_chat(chat_model, [])
    with pytest.raises(ValueError, match="has no tokenizer"):
        encode_chat(mt.load(checkpoint_dir("llama-gqa")), [{"role": "user", "content": "a"}])


READS_NAME = [  # every way a template may look at a message's field
    "{% for m in messages %}{{ m['name'] }}{% endfor %}",
    "{% for m in messages %}{{ m.name }}{% endfor %}",
    "{% for m in messages %}{{ m.get('name') }}{% endfor %}",
    "{% for m in messages %}{% if 'name' in m %}x{% endif %}{% endfor %}",
    "{% for m in messages %}{% for k, v in m.items() %}{{ v }}{% endfor %}{% endfor %}",
    "{% for m in messages %}{% for k in m %}{{ k }}{% endfor %}{% endfor %}",
    "{% for m in messages %}{{ m.values() | list }}{% endfor %}",
    "{% for m in messages %}{{ m | dictsort }}{% endfor %}",
    "{{ messages | tojson }}",
    "{% for m in messages %}{{ m | tojson }}{% endfor %}"]


@pytest.mark.parametrize("template", READS_NAME)
def test_a_field_is_read_however_the_template_looks_at_it(chat_model, template):
    """A message's field beyond role and content passes if the template reads it, in any of
    Jinja's ways; the same message under a template that never reads it is refused, naming
    the field: the prompt would drop it."""
    from dataclasses import replace

    from minitransformer.chat import MessageError, chat_ids
    tokenizer = chat_model.tokenizer
    message = [{"role": "user", "content": "a", "name": "Ada"}]
    assert chat_ids(replace(tokenizer, chat_template=template), message)
    content_only = replace(tokenizer, chat_template="{% for m in messages %}{{ m.content }}"
                                                    "{% endfor %}")
    with pytest.raises(MessageError, match="would drop it") as caught:
        chat_ids(content_only, message)
    assert caught.value.where == "messages[0].name"
    assert chat_ids(content_only, [{"role": "user", "content": "a", "name": None}])  # absent
