"""Built-in chat formats, how a template text is recognised, and the format a model gets
when its file carries no template.

llama.cpp knows a few dozen chat formats by name (src/llama-chat.cpp): `--chat-template
gemma` picks one, and a template text is recognised as one of them from marker strings
it contains (`llm_chat_detect_template`). llambda keeps llama.cpp's names and its
recognition rules, and writes the formats as Jinja, rendered by chat_template.render_chat
like any model's own template. A built-in renders exactly the text llama.cpp's renders:
no BOS (the tokenizer adds it, as it does to any prompt, when the vocabulary asks for it),
and the same trimming of message contents.

A file without `tokenizer.chat_template` gets the format its architecture was trained
with (ARCHITECTURE_FORMATS). llama.cpp itself falls back to ChatML for every such file,
which is wrong for Gemma (`<start_of_turn>`), Phi-3 and Llama; ChatML stays the fallback
for architectures the table does not name.
"""
import os
from dataclasses import dataclass

from llambda.errors import UserError


@dataclass(frozen=True)
class ChatFormat:
    """A named built-in format: its Jinja text and the special tokens it writes.

    markers: token texts that a vocabulary trained on this format has; a file's
    vocabulary is checked against them when the architecture allows several formats."""
    name: str
    text: str
    markers: tuple = ()


@dataclass(frozen=True)
class ChatTemplate:
    """The template a model renders conversations with.

    name: the built-in's name, the file it was read from, or "the model's template";
    builtin: True for llambda's built-in formats, which (like llama.cpp's) leave BOS to
    the tokenizer; a model's own or a user's Jinja template writes BOS itself."""
    name: str
    text: str
    builtin: bool


# ---------------------------------------------------------------------------
# The built-in formats, as llama.cpp renders them
# ---------------------------------------------------------------------------
# Each template is one line of Jinja pieced together from Python strings; `'\n'` inside a
# Jinja string literal is a newline. Jinja's `trim` stands for llama.cpp's trim(), which
# strips ASCII white space only (Jinja's also strips other Unicode spaces).

def _each(body, generation=""):
    """A template that writes ``body`` per message (m: the message, c: its content) and
    ``generation`` for add_generation_prompt."""
    text = (r"{%- for m in messages -%}{%- set c = m['content'] -%}" + body + r"{%- endfor -%}")
    if generation:
        text += r"{%- if add_generation_prompt -%}{{- " + generation + r" -}}{%- endif -%}"
    return text


def _by_role(cases, other="", generation=""):
    """``_each`` with one output expression per role (``other``: any other role)."""
    branches = []
    for i, (role, expression) in enumerate(cases):
        keyword = "if" if i == 0 else "elif"
        branches.append(r"{%- " + keyword + f" m['role'] == '{role}' -%}}{{{{- {expression} -}}}}")
    if other:
        branches.append(r"{%- else -%}{{- " + other + r" -}}")
    return _each("".join(branches) + r"{%- endif -%}", generation)


def _llama2(system_tags, bos_inside, strip):
    # One [INST] ... [/INST] turn per user message; the system message (in <<SYS>> tags
    # when the variant has them) opens the first turn; no generation prompt is needed.
    content = "m['content'] | trim" if strip else "m['content']"
    system = r"'<<SYS>>\n' + c + '\n<</SYS>>\n\n'" if system_tags else r"c + '\n'"
    reopen = "'<s>[INST] '" if bos_inside else "'[INST] '"
    return (r"{%- set ns = namespace(inside=true) -%}{{- '[INST] ' -}}"
            r"{%- for m in messages -%}{%- set c = " + content + r" -%}"
            r"{%- if not ns.inside -%}{%- set ns.inside = true -%}{{- " + reopen + r" -}}{%- endif -%}"
            r"{%- if m['role'] == 'system' -%}{{- " + system + r" -}}"
            r"{%- elif m['role'] == 'user' -%}{{- c + ' [/INST]' -}}"
            r"{%- else -%}{{- c + '</s>' -}}{%- set ns.inside = false -%}{%- endif -%}"
            r"{%- endfor -%}")


def _mistral(leading, trailing, trim_assistant):
    # v1/v3: like llama2 without <<SYS>>; the spaces around [INST] tell the versions apart.
    reply = "m['content'] | trim" if trim_assistant else "m['content']"
    return (r"{%- set ns = namespace(inside=false) -%}"
            r"{%- for m in messages -%}{%- set c = m['content'] -%}"
            r"{%- if not ns.inside -%}{{- '" + leading + "[INST]" + trailing + r"' -}}"
            r"{%- set ns.inside = true -%}{%- endif -%}"
            r"{%- if m['role'] == 'system' -%}{{- c + '\n\n' -}}"
            r"{%- elif m['role'] == 'user' -%}{{- c + '" + leading + r"[/INST]' -}}"
            r"{%- else -%}{{- '" + trailing + "' + " + reply + r" + '</s>' -}}"
            r"{%- set ns.inside = false -%}{%- endif -%}"
            r"{%- endfor -%}")


def _mistral_v7(space):
    return _by_role([("system", f"'[SYSTEM_PROMPT]{space}' + c + '[/SYSTEM_PROMPT]'"),
                     ("user", f"'[INST]{space}' + c + '[/INST]'")],
                    other=f"'{space}' + c + '</s>'")


# Gemma has no system turn: the system text (trimmed) opens the next user turn, and
# "assistant" is called "model".
_GEMMA = (r"{%- set ns = namespace(system='') -%}"
          r"{%- for m in messages -%}"
          r"{%- if m['role'] == 'system' -%}{%- set ns.system = ns.system + m['content'] | trim -%}"
          r"{%- else -%}{%- set role = 'model' if m['role'] == 'assistant' else m['role'] -%}"
          r"{{- '<start_of_turn>' + role + '\n' -}}"
          r"{%- if ns.system and role != 'model' -%}{{- ns.system + '\n\n' -}}{%- set ns.system = '' -%}"
          r"{%- endif -%}"
          r"{{- m['content'] | trim + '<end_of_turn>\n' -}}"
          r"{%- endif -%}{%- endfor -%}"
          r"{%- if add_generation_prompt -%}{{- '<start_of_turn>model\n' -}}{%- endif -%}")

_ORION = (r"{%- set ns = namespace(system='') -%}"
          r"{%- for m in messages -%}"
          r"{%- if m['role'] == 'system' -%}{%- set ns.system = ns.system + m['content'] -%}"
          r"{%- elif m['role'] == 'user' -%}{{- 'Human: ' -}}"
          r"{%- if ns.system -%}{{- ns.system + '\n\n' -}}{%- set ns.system = '' -%}{%- endif -%}"
          r"{{- m['content'] + '\n\nAssistant: </s>' -}}"
          r"{%- else -%}{{- m['content'] + '</s>' -}}{%- endif -%}{%- endfor -%}")

_RWKV_WORLD = _by_role([("system", r"'System: ' + c | trim + '\n\n'"),
                        ("user", r"'User: ' + c | trim + '\n\n' + ('Assistant:' if loop.last else '')"),
                        ("assistant", r"'Assistant: ' + c | trim + '\n\n'")])

_SMOLVLM = (r"{{- '<|im_start|>' -}}"
            + _by_role([("system", r"c + '\n\n'"), ("user", r"'User: ' + c + '<end_of_utterance>\n'")],
                       other=r"'Assistant: ' + c + '<end_of_utterance>\n'", generation="'Assistant:'"))

_CHATGLM3 = (r"{{- '[gMASK]sop' -}}"
             + _each(r"{{- '<|' + m['role'] + '|>\n ' + c -}}", generation="'<|assistant|>'"))

_CHATGLM4 = (r"{{- '[gMASK]<sop>' -}}"
             + _each(r"{{- '<|' + m['role'] + '|>\n' + c -}}", generation=r"'<|assistant|>\n'"))

_FORMATS = [
    ChatFormat("chatml", _each(r"{{- '<|im_start|>' + m['role'] + '\n' + c + '<|im_end|>\n' -}}",
                               generation=r"'<|im_start|>assistant\n'"),
               markers=("<|im_start|>", "<|im_end|>")),
    ChatFormat("llama2", _llama2(system_tags=False, bos_inside=False, strip=False)),
    ChatFormat("llama2-sys", _llama2(system_tags=True, bos_inside=False, strip=False)),
    ChatFormat("llama2-sys-bos", _llama2(system_tags=True, bos_inside=True, strip=False)),
    ChatFormat("llama2-sys-strip", _llama2(system_tags=True, bos_inside=False, strip=True)),
    ChatFormat("mistral-v1", _mistral(" ", " ", trim_assistant=False)),
    ChatFormat("mistral-v3", _mistral("", " ", trim_assistant=True)),
    ChatFormat("mistral-v3-tekken", _mistral("", "", trim_assistant=False)),
    ChatFormat("mistral-v7", _mistral_v7(" "), markers=("[SYSTEM_PROMPT]", "[INST]")),
    ChatFormat("mistral-v7-tekken", _mistral_v7(""), markers=("[SYSTEM_PROMPT]", "[INST]")),
    ChatFormat("phi3", _each(r"{{- '<|' + m['role'] + '|>\n' + c + '<|end|>\n' -}}",
                             generation=r"'<|assistant|>\n'"),
               markers=("<|user|>", "<|assistant|>", "<|end|>")),
    ChatFormat("phi4", _each(r"{{- '<|im_start|>' + m['role'] + '<|im_sep|>' + c + '<|im_end|>' -}}",
                             generation="'<|im_start|>assistant<|im_sep|>'"),
               markers=("<|im_start|>", "<|im_sep|>", "<|im_end|>")),
    ChatFormat("falcon3", _each(r"{{- '<|' + m['role'] + '|>\n' + c + '\n' -}}",
                                generation=r"'<|assistant|>\n'")),
    ChatFormat("zephyr", _each(r"{{- '<|' + m['role'] + '|>\n' + c + '<|endoftext|>\n' -}}",
                               generation=r"'<|assistant|>\n'")),
    ChatFormat("monarch", _each(r"{{- ('' if loop.first else '<s>') + m['role'] + '\n' + c + '</s>\n' -}}",
                                generation=r"'<s>assistant\n'")),
    ChatFormat("gemma", _GEMMA, markers=("<start_of_turn>", "<end_of_turn>")),
    ChatFormat("orion", _ORION),
    ChatFormat("openchat", _by_role([("system", "c + '<|end_of_turn|>'")],
                                    other="'GPT4 Correct ' + m['role'][:1] | upper + m['role'][1:] + ': '"
                                          " + c + '<|end_of_turn|>'",
                                    generation="'GPT4 Correct Assistant:'")),
    ChatFormat("vicuna", _by_role([("system", r"c + '\n\n'"), ("user", r"'USER: ' + c + '\n'"),
                                   ("assistant", r"'ASSISTANT: ' + c + '</s>\n'")],
                                  generation="'ASSISTANT:'")),
    ChatFormat("vicuna-orca", _by_role([("system", r"'SYSTEM: ' + c + '\n'"), ("user", r"'USER: ' + c + '\n'"),
                                        ("assistant", r"'ASSISTANT: ' + c + '</s>\n'")],
                                       generation="'ASSISTANT:'")),
    ChatFormat("deepseek", _by_role([("system", "c"), ("user", r"'### Instruction:\n' + c + '\n'"),
                                     ("assistant", r"'### Response:\n' + c + '\n<|EOT|>\n'")],
                                    generation=r"'### Response:\n'")),
    ChatFormat("deepseek2", _by_role([("system", r"c + '\n\n'"), ("user", r"'User: ' + c + '\n\n'"),
                                      ("assistant", "'Assistant: ' + c + '<｜end▁of▁sentence｜>'")],
                                     generation="'Assistant:'")),
    ChatFormat("deepseek3", _by_role([("system", r"c + '\n\n'"), ("user", "'<｜User｜>' + c"),
                                      ("assistant", "'<｜Assistant｜>' + c + '<｜end▁of▁sentence｜>'")],
                                     generation="'<｜Assistant｜>'"),
               markers=("<｜User｜>", "<｜Assistant｜>")),
    ChatFormat("command-r", _by_role(
        [("system", "'<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>' + c | trim + '<|END_OF_TURN_TOKEN|>'"),
         ("user", "'<|START_OF_TURN_TOKEN|><|USER_TOKEN|>' + c | trim + '<|END_OF_TURN_TOKEN|>'"),
         ("assistant", "'<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>' + c | trim + '<|END_OF_TURN_TOKEN|>'")],
        generation="'<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>'"),
        markers=("<|START_OF_TURN_TOKEN|>", "<|CHATBOT_TOKEN|>")),
    ChatFormat("llama3", _each(r"{{- '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n'"
                               r" + c | trim + '<|eot_id|>' -}}",
                               generation=r"'<|start_header_id|>assistant<|end_header_id|>\n\n'"),
               markers=("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")),
    ChatFormat("chatglm3", _CHATGLM3),
    ChatFormat("chatglm4", _CHATGLM4),
    ChatFormat("glmedge", _each(r"{{- '<|' + m['role'] + '|>\n' + c -}}", generation="'<|assistant|>'")),
    ChatFormat("minicpm", _by_role([("user", "'<用户>' + c | trim + '<AI>'")], other="c | trim")),
    ChatFormat("exaone3", _by_role([("system", r"'[|system|]' + c | trim + '[|endofturn|]\n'"),
                                    ("user", r"'[|user|]' + c | trim + '\n'"),
                                    ("assistant", r"'[|assistant|]' + c | trim + '[|endofturn|]\n'")],
                                   generation="'[|assistant|]'")),
    ChatFormat("rwkv-world", _RWKV_WORLD),
    ChatFormat("granite", _each(r"{{- '<|start_of_role|>' + m['role'] + '<|end_of_role|>'"
                                r" + ('<|tool_call|>' if m['role'] == 'assistant_tool_call' else '')"
                                r" + c + '<|end_of_text|>\n' -}}",
                                generation="'<|start_of_role|>assistant<|end_of_role|>'"),
               markers=("<|start_of_role|>", "<|end_of_role|>")),
    ChatFormat("megrez", _each("{{- '<|role_start|>' + m['role'] + '<|role_end|>' + c + '<|turn_end|>' -}}",
                               generation="'<|role_start|>assistant<|role_end|>'")),
    ChatFormat("llama4", _each(r"{{- '<|header_start|>' + m['role'] + '<|header_end|>\n\n'"
                               r" + c | trim + '<|eot|>' -}}",
                               generation=r"'<|header_start|>assistant<|header_end|>\n\n'"),
               markers=("<|header_start|>", "<|header_end|>", "<|eot|>")),
    ChatFormat("smolvlm", _SMOLVLM),
    ChatFormat("gpt-oss", _each("{{- '<|start|>' + m['role'] + '<|message|>' + c"
                                " + ('<|return|>' if m['role'] == 'assistant' else '<|end|>') -}}",
                                generation="'<|start|>assistant'")),
    ChatFormat("kimi-k2", _by_role([("system", "'<|im_system|>system<|im_middle|>' + c + '<|im_end|>'"),
                                    ("user", "'<|im_user|>user<|im_middle|>' + c + '<|im_end|>'"),
                                    ("assistant", "'<|im_assistant|>assistant<|im_middle|>' + c + '<|im_end|>'"),
                                    ("tool", "'<|im_system|>tool<|im_middle|>' + c + '<|im_end|>'")],
                                   other="c + '<|im_end|>'",
                                   generation="'<|im_assistant|>assistant<|im_middle|>'")),
    ChatFormat("seed_oss", _each(r"{{- '<seed:bos>' + m['role'] + '\n'"
                                 r" + (c | trim if m['role'] == 'assistant' else c) + '<seed:eos>' -}}",
                                 generation=r"'<seed:bos>assistant\n'")),
    ChatFormat("solar-open", _each("{{- '<|begin|>' + m['role'] + '<|content|>' + c + '<|end|>' -}}",
                                   generation="'<|begin|>assistant'")),
]

BUILTIN = {f.name: f for f in _FORMATS}


# ---------------------------------------------------------------------------
# Recognising a template text (llama.cpp's llm_chat_detect_template)
# ---------------------------------------------------------------------------

def _has(*needles):
    return lambda text: all(n in text for n in needles)


def _any(*tests):
    return lambda text: any(t(text) for t in tests)


def _both(*tests):
    return lambda text: all(t(text) for t in tests)


_MISTRAL_FAMILY = _any(lambda text: text.startswith("mistral"), _has("[INST]"))
_MISTRAL_OFFICIAL = _any(_has("' [INST] ' + system_message"), _has("[AVAILABLE_TOOLS]"))

# In llama.cpp's order: the first rule whose test passes names the format.
_RECOGNITION = [
    ("phi4", _has("<|im_start|>", "<|im_sep|>")),
    ("smolvlm", _has("<|im_start|>", "<end_of_utterance>")),
    ("chatml", _has("<|im_start|>")),
    ("mistral-v7", _both(_MISTRAL_FAMILY, _has("[SYSTEM_PROMPT]"))),
    ("mistral-v1", _both(_MISTRAL_FAMILY, _MISTRAL_OFFICIAL, _has(" [INST]"))),
    ("mistral-v3-tekken", _both(_MISTRAL_FAMILY, _MISTRAL_OFFICIAL, _has('"[INST]"'))),
    ("mistral-v3", _both(_MISTRAL_FAMILY, _MISTRAL_OFFICIAL)),
    ("llama2-sys-strip", _both(_MISTRAL_FAMILY, _has("content.strip()"))),
    ("llama2-sys-bos", _both(_MISTRAL_FAMILY, _has("bos_token + '[INST]"))),
    ("llama2-sys", _both(_MISTRAL_FAMILY, _has("<<SYS>>"))),
    ("llama2", _MISTRAL_FAMILY),
    ("phi3", _has("<|assistant|>", "<|end|>")),
    ("chatglm4", _has("[gMASK]<sop>")),
    ("exaone-moe", _has("<|assistant|>", "<|user|>", "<|tool_declare|>")),
    ("falcon3", _has("<|assistant|>", "<|user|>", "</s>")),
    ("glmedge", _has("<|assistant|>", "<|user|>")),
    ("glmedge", _has("<|{{ item['role'] }}|>", "<|begin_of_image|>")),
    ("zephyr", _has("<|user|>", "<|endoftext|>")),
    ("monarch", _has("bos_token + message['role']")),
    ("gemma", _has("<start_of_turn>")),
    ("orion", _has("'\\n\\nAssistant: ' + eos_token")),
    ("openchat", _has("GPT4 Correct ")),
    ("vicuna-orca", _has("USER: ", "ASSISTANT: ", "SYSTEM: ")),
    ("vicuna", _has("USER: ", "ASSISTANT: ")),
    ("deepseek", _has("### Instruction:", "<|EOT|>")),
    ("command-r", _has("<|START_OF_TURN_TOKEN|>", "<|USER_TOKEN|>")),
    ("llama3", _has("<|start_header_id|>", "<|end_header_id|>")),
    ("chatglm3", _has("[gMASK]sop")),
    ("minicpm", _has("<用户>")),
    ("deepseek2", _has("'Assistant: ' + message['content'] + eos_token")),
    ("deepseek3", _has("<｜Assistant｜>", "<｜User｜>", "<｜end▁of▁sentence｜>")),
    ("exaone4", _has("[|system|]", "[|assistant|]", "[|endofturn|]", "[|tool|]")),
    ("exaone3", _has("[|system|]", "[|assistant|]", "[|endofturn|]")),
    ("rwkv-world", _any(_has("rwkv-world"), _has("{{- 'User: ' + message['content']|trim + '\\n\\n' -}}"))),
    ("granite-4.0", _both(_has("<|start_of_role|>", "g4_default_system_message"),
                          _any(_has("<tool_call>"), _has("<tools>")))),
    ("granite-4.1", _both(_has("<|start_of_role|>"), _any(_has("<tool_call>"), _has("<tools>")))),
    ("granite", _has("<|start_of_role|>")),
    ("gigachat", _has("message['role'] + additional_special_tokens[0] + message['content']"
                      " + additional_special_tokens[1]")),
    ("megrez", _has("<|role_start|>")),
    ("yandex", _has(" Ассистент:")),
    ("bailing", _has("<role>ASSISTANT</role>", "'HUMAN'")),
    ("bailing-think", _has("<role>ASSISTANT</role>", '"HUMAN"', "<think>")),
    ("bailing2", _has("<role>ASSISTANT</role>", "<role>HUMAN</role>", "<|role_end|>")),
    ("llama4", _has("<|header_start|>", "<|header_end|>")),
    ("dots1", _has("<|endofuserprompt|>")),
    ("hunyuan-moe", _has("<|extra_0|>", "<|extra_4|>")),
    ("gpt-oss", _has("<|start|>", "<|channel|>")),
    ("hunyuan-vl", _has("<｜hy_Assistant｜>", "<｜hy_begin▁of▁sentence｜>")),
    ("hunyuan-dense", _has("<｜hy_Assistant｜>", "<｜hy_place▁holder▁no▁3｜>")),
    ("kimi-k2", _has("<|im_assistant|>assistant<|im_middle|>")),
    ("seed_oss", _has("<seed:bos>")),
    ("grok-2", _has("'Assistant: '  + message['content'] + '<|separator|>")),
    ("pangu-embedded", _has("[unused9]系统：[unused10]")),
    ("solar-open", _has("<|begin|>", "<|end|>", "<|content|>")),
]


def recognise(text):
    """The llama.cpp name of the chat format ``text`` is (a name, or a template's Jinja
    text), or None. As llama.cpp's, the answer may name a format llambda does not
    implement (see BUILTIN)."""
    if text in BUILTIN:
        return text
    for name, test in _RECOGNITION:
        if test(text):
            return name
    return None


# ---------------------------------------------------------------------------
# A file without a template
# ---------------------------------------------------------------------------

# general.architecture -> the formats its models are trained with, most specific first.
# With several, the first whose marker tokens the vocabulary has wins, and the last is
# taken when none match (one GGUF architecture "llama" covers Llama 3, SmolLM's ChatML
# and Llama 2 / Mistral 7B, whose [INST] is plain text).
ARCHITECTURE_FORMATS = {
    "llama": ("llama3", "chatml", "llama2"),
    "llama4": ("llama4",),
    "gemma": ("gemma",),
    "gemma2": ("gemma",),
    "gemma3": ("gemma",),
    "gemma3n": ("gemma",),
    "qwen2": ("chatml",),
    "qwen2moe": ("chatml",),
    "qwen3": ("chatml",),
    "qwen3moe": ("chatml",),
    "phi3": ("phi4", "phi3"),          # Phi-4 files say phi3 too; their vocabulary has <|im_sep|>
    "command-r": ("command-r",),
    "cohere2": ("command-r",),
    "granite": ("granite",),
    "granitemoe": ("granite",),
    "exaone": ("exaone3",),
    "chatglm": ("chatglm4",),
    "deepseek2": ("deepseek3", "deepseek2"),
    "gpt-oss": ("gpt-oss",),
}
FALLBACK_FORMAT = "chatml"     # llama.cpp's choice for every file without a template


def format_for_architecture(arch, vocabulary=()):
    """The built-in format name for a file of architecture ``arch`` without a template.

    vocabulary: the file's token texts, to choose among the formats the architecture
    allows; read only when it allows more than one (a 262k-token list costs tens of ms
    to index, on every load)."""
    candidates = ARCHITECTURE_FORMATS.get(arch, (FALLBACK_FORMAT,))
    if len(candidates) > 1:
        vocabulary = set(vocabulary)
    for name in candidates[:-1]:
        if all(marker in vocabulary for marker in BUILTIN[name].markers):
            return name
    return candidates[-1]


# ---------------------------------------------------------------------------
# Choosing the template a model renders with
# ---------------------------------------------------------------------------

FILE_TEMPLATE = "the model's template"


def builtin_template(name):
    return ChatTemplate(name=name, text=BUILTIN[name].text, builtin=True)


def template_from_option(value, option="chat_template"):
    """``--chat-template NAME|FILE``: a built-in format name, or a Jinja file."""
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str) or not value:
        raise UserError(f"{option}: expected a built-in format name or a Jinja file, got {value!r}")
    if value in BUILTIN:
        return builtin_template(value)
    if os.path.isfile(value):
        try:
            with open(value, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"{option} {value}: cannot read the template ({e})") from None
        if not text.strip():
            raise UserError(f"{option} {value}: the file is empty")
        return ChatTemplate(name=value, text=text, builtin=False)
    known_to_llama_cpp = {name for name, _ in _RECOGNITION}
    what = ("a llama.cpp format llambda does not have, nor a file" if value in known_to_llama_cpp
            else "neither a built-in format nor a file")
    raise UserError(f"{option} {value!r}: {what}. Built-in formats: {', '.join(sorted(BUILTIN))}")


def template_for_model(tokenizer_metadata, arch):
    """The ChatTemplate of a model file: its own template, else its architecture's
    built-in format (a --chat-template given by the user replaces either)."""
    text = tokenizer_metadata.get("tokenizer.chat_template")
    if text:
        return ChatTemplate(name=FILE_TEMPLATE, text=text, builtin=False)
    vocabulary = tokenizer_metadata.get("tokenizer.ggml.tokens", ())
    return builtin_template(format_for_architecture(arch, vocabulary))


def hint_for_failed_template(template):
    """What to suggest when ``template`` (not a built-in) failed on a conversation: the
    built-in format llama.cpp would recognise it as, if llambda has it."""
    if template.builtin:
        return ""
    name = recognise(template.text)
    if name in BUILTIN:
        return f" (llama.cpp recognises it as the '{name}' format: try --chat-template {name})"
    return ""
