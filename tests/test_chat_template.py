"""Chat template rendering: the default model's ChatML template, a Llama-3-style one,
the HF-compatible helpers, and template errors reported as UserError."""
import pytest

from llambda.chat_template import render_chat
from llambda.errors import UserError

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "2+2?"},
]

# Llama 3's format: BOS, then per message a role header, the trimmed content and <|eot_id|>.
LLAMA3_STYLE = (
    "{% for message in messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}"
)


@pytest.fixture(scope="module")
def chatml_template(default_gguf):
    from gguf import GGUFReader
    return GGUFReader(default_gguf).fields["tokenizer.chat_template"].contents()


def test_default_model_chatml_conversation(chatml_template):
    assert render_chat(chatml_template, CONVERSATION) == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\n2+2?<|im_end|>\n"
        "<|im_start|>assistant\n")


def test_default_model_chatml_adds_its_default_system_prompt(chatml_template):
    text = render_chat(chatml_template, [{"role": "user", "content": "Hi"}],
                       add_generation_prompt=False)
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, "
                    "trained by Hugging Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n")


def test_rendered_chat_tokenizes_to_control_tokens(chatml_template, default_gguf):
    from gguf import GGUFReader

    from llambda.tokenizer import Tokenizer
    reader = GGUFReader(default_gguf)
    md = {key: field.contents() for key, field in reader.fields.items()
          if key.startswith("tokenizer.")}
    tok = Tokenizer.from_gguf_metadata(md)
    ids = tok.encode(render_chat(chatml_template, CONVERSATION[:2]), add_special=False)
    assert ids.count(tok.bos_id) == 3  # <|im_start|> for system, user, assistant
    assert ids.count(tok.eos_id) == 2  # <|im_end|> closing system and user


def test_llama3_style_template():
    text = render_chat(LLAMA3_STYLE, [{"role": "system", "content": " Be brief. "},
                                      {"role": "user", "content": "Hi"}],
                       bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")
    assert text == ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief."
                    "<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
                    "<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_trim_and_lstrip_blocks_as_hf_renders():
    template = "{% for m in messages %}\n    {% if m.role %}\n[{{ m.content }}]\n    {% endif %}\n{% endfor %}"
    assert render_chat(template, CONVERSATION[:2]) == "[You are terse.]\n[Hi]\n"


def test_tojson_keeps_non_ascii_and_takes_indent():
    messages = [{"role": "user", "content": "café <b>"}]
    assert render_chat("{{ messages | tojson }}", messages) == \
        '[{"role": "user", "content": "café <b>"}]'
    assert render_chat("{{ messages[0] | tojson(indent=2) }}", messages) == \
        '{\n  "role": "user",\n  "content": "café <b>"\n}'


def test_extra_variables_reach_the_template():
    template = "{% if tools %}{{ tools | length }} tools{% endif %}|{{ custom }}"
    assert render_chat(template, [], tools=[{"name": "a"}, {"name": "b"}], custom=7) == "2 tools|7"


def test_loop_controls_and_strftime_now():
    template = ("{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
                "{{ m.role }}{% endfor %}{{ strftime_now('%Y') | length }}")
    assert render_chat(template, CONVERSATION) == "system4"


def test_raise_exception_is_a_user_error_with_its_message():
    template = ("{% if messages[0]['role'] == 'system' %}"
                "{{ raise_exception('System role not supported') }}{% endif %}")
    with pytest.raises(UserError, match="System role not supported"):
        render_chat(template, CONVERSATION)


@pytest.mark.parametrize("template", [
    "{% for m in messages %}",          # unclosed block
    "{{ messages | no_such_filter }}",  # unknown filter
])
def test_broken_template_is_a_user_error(template):
    with pytest.raises(UserError, match="chat template"):
        render_chat(template, CONVERSATION)


def test_python_error_inside_the_template_is_a_user_error():
    with pytest.raises(UserError, match="TypeError"):
        render_chat("{{ 'x' + messages[0]['content'] }}", [{"role": "user", "content": None}])


@pytest.mark.parametrize("template", [
    "{% set x = [] %}{{ x.append(1) }}",                      # mutation
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",          # reaching Python internals
])
def test_sandbox_stops_unsafe_templates(template):
    with pytest.raises(UserError):
        render_chat(template, CONVERSATION)


@pytest.mark.parametrize("messages", ["hello", [("user", "hi")], [{"content": "no role"}]])
def test_malformed_messages_are_a_user_error(messages):
    with pytest.raises(UserError, match="messages"):
        render_chat("{{ messages }}", messages)


def test_empty_template_is_a_user_error():
    with pytest.raises(UserError):
        render_chat("", CONVERSATION)
