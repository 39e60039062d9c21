"""Chat templates: rendering (the default model's ChatML template, a Llama-3-style one,
the HF-compatible helpers, errors as one-line UserErrors), every real template of
llama.cpp's collection, the built-in formats against llama.cpp's own renderings, the
recognition of a template text, the format a file without a template gets, and
--chat-template NAME|FILE."""
import json
from pathlib import Path

import pytest

from llambda.chat.formats import (ARCHITECTURE_FORMATS, BUILTIN, format_for_architecture, recognise,
                                  template_for_model, template_from_option)
from llambda.chat.template import render_chat
from llambda.errors import UserError
from repo_paths import FIXTURES

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

    from llambda.tokenizer.vocab import Tokenizer
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


def test_generation_block_renders_its_body():
    template = "{% for m in messages %}{% generation %}[{{ m.content }}]{% endgeneration %}{% endfor %}"
    assert render_chat(template, CONVERSATION[:2]) == "[You are terse.][Hi]"


def test_errors_name_the_template_on_one_line():
    template = "{{ raise_exception('System role\nnot supported') }}"
    with pytest.raises(UserError) as error:
        render_chat(template, CONVERSATION, name="my.jinja")
    assert str(error.value) == "chat template my.jinja: refused the conversation: System role not supported"


# ---------------------------------------------------------------- real templates
# tests/fixtures/templates: models/templates/*.jinja of the llama-cpp-python 0.3.36 sdist
# (vendor/llama.cpp), the templates of published models. Each renders a system + user +
# assistant conversation, or refuses it with one line that names it.

TEMPLATES = FIXTURES / "templates"
THREE_ROLES = [{"role": "system", "content": "SYSTEM-TEXT"}, {"role": "user", "content": "USER-TEXT"},
               {"role": "assistant", "content": "ASSISTANT-TEXT"}]
REFUSALS = {
    "google-gemma-2-2b-it.jinja": "refused the conversation: System role not supported",
    # it wants `functions` (a JSON spec) and `datetime`, which its own callers pass
    "fireworks-ai-llama-3-firefunction-v2.jinja": "'functions' is undefined",
}
# templates that drop the system message unless the conversation ends with the user
DROPS_SYSTEM = {"mistralai-Mistral-Nemo-Instruct-2407.jinja"}


def _template_files():
    files = sorted(TEMPLATES.glob("*.jinja"))
    assert len(files) >= 70, "tests/fixtures/templates is incomplete"
    return files


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("path", _template_files(), ids=lambda p: p.stem)
def test_real_template_renders_or_refuses_clearly(path, add_generation_prompt):
    text = path.read_text(encoding="utf-8")
    if path.name in REFUSALS:
        with pytest.raises(UserError) as error:
            render_chat(text, THREE_ROLES, add_generation_prompt=add_generation_prompt,
                        bos_token="<s>", eos_token="</s>", name=path.name)
        message = str(error.value)
        assert "\n" not in message and message.startswith(f"chat template {path.name}: ")
        assert REFUSALS[path.name] in message
        return
    prompt = render_chat(text, THREE_ROLES, add_generation_prompt=add_generation_prompt,
                         bos_token="<s>", eos_token="</s>", name=path.name)
    expected = ["USER-TEXT", "ASSISTANT-TEXT"] + ([] if path.name in DROPS_SYSTEM else ["SYSTEM-TEXT"])
    assert all(part in prompt for part in expected), prompt
    order = [prompt.index(part) for part in expected[:2]]
    assert order == sorted(order)


def test_a_model_template_that_refuses_suggests_the_builtin_it_is():
    from llambda.chat.formats import ChatTemplate, hint_for_failed_template
    text = (TEMPLATES / "google-gemma-2-2b-it.jinja").read_text(encoding="utf-8")
    hint = hint_for_failed_template(ChatTemplate("the model's template", text, builtin=False))
    assert "--chat-template gemma" in hint


# ---------------------------------------------------------------- built-in formats
# tests/fixtures/chat_formats.json holds llama.cpp's own renderings of its built-in formats
# and which of them it recognises each real template as (record_chat_formats.py wrote it
# with llama-cpp-python 0.3.36).

RECORDED = json.loads((FIXTURES / "chat_formats.json").read_text(encoding="utf-8"))
# llama.cpp formats llambda does not write (rare, or tool-call variants of ones it has)
NOT_BUILTIN = {"bailing", "bailing-think", "bailing2", "deepseek-ocr", "exaone-moe", "exaone4", "gigachat",
               "granite-4.0", "granite-4.1", "grok-2", "hunyuan-dense", "hunyuan-moe", "hunyuan-vl",
               "pangu-embedded", "yandex"}


def test_builtin_names_are_llama_cpps():
    assert set(BUILTIN) | NOT_BUILTIN == set(RECORDED["builtins"])
    assert not set(BUILTIN) & NOT_BUILTIN


@pytest.mark.parametrize("name", sorted(BUILTIN))
def test_builtin_renders_as_llama_cpp(name):
    for conversation, (plain, with_prompt) in zip(RECORDED["conversations"], RECORDED["builtins"][name]):
        assert render_chat(BUILTIN[name].text, conversation, add_generation_prompt=False) == plain
        assert render_chat(BUILTIN[name].text, conversation, add_generation_prompt=True) == with_prompt


@pytest.mark.parametrize("file_name", sorted(RECORDED["recognised"]))
def test_recognise_agrees_with_llama_cpp(file_name):
    """llama.cpp's answer is the set of its formats that render as it rendered the template
    (granite's three variants render the same), or empty when it does not recognise it."""
    found = recognise((TEMPLATES / file_name).read_text(encoding="utf-8"))
    expected = RECORDED["recognised"][file_name]
    assert found in expected if expected else found is None


def test_recognise_a_name_and_unknown_text():
    assert recognise("gemma") == "gemma" and recognise("mistral-v7-tekken") == "mistral-v7-tekken"
    assert recognise("{{ messages }}") is None


# ---------------------------------------------------------------- files without a template

def _vocab(*texts):
    return {"a", "b", *texts}


@pytest.mark.parametrize("arch, vocabulary, expected", [
    ("gemma3", _vocab("<start_of_turn>", "<end_of_turn>"), "gemma"),
    ("gemma2", _vocab(), "gemma"),
    ("qwen2", _vocab("<|im_start|>", "<|im_end|>"), "chatml"),
    ("qwen3", _vocab(), "chatml"),
    ("phi3", _vocab("<|user|>", "<|assistant|>", "<|end|>"), "phi3"),
    ("phi3", _vocab("<|im_start|>", "<|im_sep|>", "<|im_end|>"), "phi4"),   # Phi-4
    ("deepseek2", _vocab(), "deepseek2"),
    ("deepseek2", _vocab("<｜User｜>", "<｜Assistant｜>"), "deepseek3"),
    ("llama", _vocab("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"), "llama3"),
    ("llama", _vocab("<|im_start|>", "<|im_end|>"), "chatml"),      # SmolLM
    ("llama", _vocab("<s>", "</s>"), "llama2"),                      # Llama 2, Mistral 7B
    ("no-such-arch", _vocab(), "chatml"),                            # llama.cpp's fallback
])
def test_format_for_architecture(arch, vocabulary, expected):
    assert format_for_architecture(arch, vocabulary) == expected


def test_every_architecture_default_is_a_builtin():
    for arch, names in ARCHITECTURE_FORMATS.items():
        assert names and all(name in BUILTIN for name in names), arch


def test_the_files_own_template_comes_first():
    md = {"tokenizer.chat_template": "{{ messages }}", "tokenizer.ggml.tokens": ["<start_of_turn>"]}
    template = template_for_model(md, "gemma3")
    assert template.text == "{{ messages }}" and not template.builtin


# ---------------------------------------------------------------- --chat-template NAME|FILE

def test_option_takes_a_builtin_name():
    template = template_from_option("llama3")
    assert template.builtin and template.name == "llama3" and template.text == BUILTIN["llama3"].text


def test_option_takes_a_file(tmp_path):
    path = tmp_path / "mine.jinja"
    path.write_text("{% for m in messages %}{{ m.content }};{% endfor %}", encoding="utf-8")
    template = template_from_option(str(path))
    assert not template.builtin and template.name == str(path)
    assert render_chat(template.text, CONVERSATION[:2]) == "You are terse.;Hi;"
    assert template_from_option(path).text == template.text          # a Path works too


def test_unknown_option_lists_the_names():
    with pytest.raises(UserError) as error:
        template_from_option("gemmma")
    message = str(error.value)
    assert "'gemmma'" in message and "chatml" in message and "gemma" in message and "llama3" in message


@pytest.mark.parametrize("content", ["", "   \n"])
def test_empty_template_file_is_refused(tmp_path, content):
    path = tmp_path / "empty.jinja"
    path.write_text(content)
    with pytest.raises(UserError, match="empty"):
        template_from_option(str(path))


def test_non_utf8_template_file_is_refused(tmp_path):
    path = tmp_path / "latin1.jinja"
    path.write_bytes(b"{{ '\xe9' }}")
    with pytest.raises(UserError, match="cannot read"):
        template_from_option(str(path))


# ---------------------------------------------------------------- the real Gemma 3 file

def _gemma_gguf():
    import fetched_files
    return fetched_files.gemma_gguf()


@pytest.fixture(scope="module")
def gemma_metadata():
    from gguf import GGUFReader
    reader = GGUFReader(_gemma_gguf())
    wanted = ("general.architecture", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
              "tokenizer.ggml.bos_token_id", "tokenizer.ggml.add_bos_token", "tokenizer.chat_template")
    return {key: reader.fields[key].contents() for key in wanted if key in reader.fields}


def test_gemma_file_without_template_gets_the_gemma_format(gemma_metadata):
    assert "tokenizer.chat_template" not in gemma_metadata
    template = template_for_model(gemma_metadata, gemma_metadata["general.architecture"])
    assert template.builtin and template.name == "gemma"
    prompt = render_chat(template.text, [{"role": "system", "content": "Be brief."},
                                         {"role": "user", "content": "Hi"}])
    assert prompt == "<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
    # the turn markers are control tokens of this vocabulary, and BOS is the tokenizer's to add
    tokens, types = gemma_metadata["tokenizer.ggml.tokens"], gemma_metadata["tokenizer.ggml.token_type"]
    for marker in ("<start_of_turn>", "<end_of_turn>"):
        assert types[tokens.index(marker)] == 3
    assert gemma_metadata["tokenizer.ggml.add_bos_token"] is True


# ---------------------------------------------------------------- Model and the chat command

@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    from synth import write_random_llama
    path = tmp_path_factory.mktemp("chat") / "tiny.gguf"
    write_random_llama(path, n_layer=1, dim=32, n_head=2, n_kv_head=1, ffn_dim=64, vocab_size=300,
                       tensor_type="Q8_0", n_ctx=256, seed=3)
    return path


@pytest.fixture(scope="module")
def templateless_path(tmp_path_factory):
    """The tiny model without tokenizer.chat_template (its vocabulary has ChatML's tokens)."""
    import synth
    path = tmp_path_factory.mktemp("chat") / "no-template.gguf"
    full = synth._minimal_tokenizer
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(synth, "_minimal_tokenizer", lambda n: synth._Tokenizer(
            [e for e in full(n).entries if e[0] != "tokenizer.chat_template"], n))
        synth.write_random_llama(path, n_layer=1, dim=32, n_head=2, n_kv_head=1, ffn_dim=64,
                                 vocab_size=300, tensor_type="Q8_0", n_ctx=256, seed=3)
    return path


def test_model_without_template_uses_its_architectures_format(templateless_path):
    import llambda
    with llambda.load(templateless_path, progress=False) as model:
        assert model.chat_template.builtin and model.chat_template.name == "chatml"
        assert model.render_chat([{"role": "user", "content": "Hi"}]) == \
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        assert isinstance("".join(model.chat([{"role": "user", "content": "Hi"}], max_tokens=3, seed=1)), str)


def test_chat_template_option_replaces_the_files(tiny_path, tmp_path):
    import llambda
    with llambda.load(tiny_path, progress=False, chat_template="llama2") as model:
        assert model.render_chat([{"role": "user", "content": "Hi"}]) == "[INST] Hi [/INST]"
    mine = tmp_path / "mine.jinja"
    mine.write_text("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}")
    with llambda.load(tiny_path, progress=False, chat_template=mine) as model:
        assert model.render_chat([{"role": "user", "content": "Hi"}]) == "<user>Hi"
        assert not model.chat_template.builtin and model.chat_template.name == str(mine)


def test_bad_chat_template_option_fails_before_the_model_is_read(tmp_path):
    import llambda
    with pytest.raises(UserError, match="neither a built-in format nor a file.*chatml"):
        llambda.load(tmp_path / "missing.gguf", chat_template="no-such-format")


def test_refusing_template_names_itself_and_suggests_a_builtin(tiny_path):
    import llambda
    gemma2 = TEMPLATES / "google-gemma-2-2b-it.jinja"
    with llambda.load(tiny_path, progress=False, chat_template=gemma2) as model:
        with pytest.raises(UserError) as error:
            model.render_chat(THREE_ROLES)
    message = str(error.value)
    assert message.startswith(f"chat template {gemma2}: refused the conversation: System role not supported")
    assert "--chat-template gemma" in message and "\n" not in message


def _chat_command(*args, input="Hello\n"):
    import subprocess
    import sys
    return subprocess.run([sys.executable, "-m", "llambda.cli", "chat", "--max-tokens", "3", "--seed", "1",
                           *args], input=input, capture_output=True, text=True, timeout=120)


def test_chat_command_takes_a_builtin_format(tiny_path):
    proc = _chat_command("--model", str(tiny_path), "--chat-template", "gemma", "--system", "Be brief.")
    assert proc.returncode == 0, proc.stderr
    assert "chat template: gemma (built-in)" in proc.stderr and "Traceback" not in proc.stderr


def test_chat_command_reports_the_default_format(templateless_path):
    proc = _chat_command("--model", str(templateless_path))
    assert proc.returncode == 0, proc.stderr
    assert "chat template: chatml (built-in)" in proc.stderr


def test_chat_command_unknown_format_is_one_line(tiny_path):
    proc = _chat_command("--model", str(tiny_path), "--chat-template", "gemmma")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "'gemmma'" in lines[0] and "llama3" in lines[0]


def test_a_llama_cpp_format_llambda_lacks_is_named_as_such():
    with pytest.raises(UserError, match="'yandex': a llama.cpp format llambda does not have"):
        template_from_option("yandex")


def test_namespace_items_and_string_methods_as_in_hf():
    template = ("{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}"
                "{{ ns.n }}|{% for k, v in messages[0].items() %}{{ k }}={{ v.strip().split(' ')[0] }};{% endfor %}"
                "|{{ messages[1].content.startswith('H') }}|{{ messages[1].content.upper() }}")
    assert render_chat(template, [{"role": "system", "content": " You are terse. "},
                                  {"role": "user", "content": "Hi"}]) == \
        "2|role=system;content=You;|True|HI"
