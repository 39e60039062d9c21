"""Rendering a conversation with the model's own chat template.

GGUF files carry the Jinja template from the model's tokenizer_config.json
(`tokenizer.chat_template`). Templates are written against Hugging Face's
renderer, so the environment here offers what theirs does: trim_blocks and
lstrip_blocks, loop controls, `raise_exception`, `strftime_now`, a `tojson`
filter that keeps non-ASCII text as it is, and the `{% generation %}` block that
marks assistant text for training masks (rendered as its plain body here). The
sandbox keeps a template, which comes from a downloaded file, from reaching
Python internals or mutating data; read-only methods (str.strip, dict.items, ...)
stay available, as in HF's.

Every failure is a one-line UserError that names the template (``name``): the
model's own, a built-in format, or a file given with --chat-template.

A template is code from a downloaded file, so rendering is bounded (llambda/chat/limits.py):
output size, the size of any value it builds, time, and macro recursion.
"""
import datetime
import functools
import json
from collections.abc import Mapping

from llambda.chat import limits as template_limits

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from llambda.errors import UserError


class _TemplateRaised(Exception):
    """A template's own raise_exception(message)."""


def _raise_exception(message):
    raise _TemplateRaised(message)


def _strftime_now(format_string):
    return datetime.datetime.now().strftime(format_string)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's built-in tojson escapes HTML characters and non-ASCII text, which
    # would change the prompt; templates expect json.dumps' plain output.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


class _GenerationBlock(Extension):
    """``{% generation %}...{% endgeneration %}``: HF marks the assistant's tokens with
    it (return_assistant_tokens_mask); for a prompt only its body matters."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


@functools.lru_cache(maxsize=1)
def _environment():
    env = template_limits.BoundedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                             extensions=["jinja2.ext.loopcontrols", _GenerationBlock])
    env.filters["tojson"] = _tojson
    template_limits.bound_filters(env)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@functools.lru_cache(maxsize=16)
def _compiled(template, name):
    try:
        return _environment().from_string(template)
    except jinja2.TemplateError as error:
        raise UserError(f"chat template {name}: does not parse: {_describe(error)}") from None
    except template_limits.TemplateLimit as error:     # a constant folded at compile time
        raise UserError(f"chat template {name}: {error}") from None
    except (RecursionError, MemoryError) as error:
        raise UserError(f"chat template {name}: does not parse: {type(error).__name__} "
                        "(nested too deeply or too large)") from None
    except SyntaxError as error:     # Jinja compiles to Python, which refuses e.g. a stray {% break %}
        raise UserError(f"chat template {name}: does not parse: {error.msg} (line {error.lineno} "
                        "of the compiled template)") from None


def _describe(error):
    message = " ".join(str(error.message or type(error).__name__).split())
    where = f" (line {error.lineno})" if getattr(error, "lineno", None) else ""
    return f"{message}{where}"


def _check_messages(messages):
    if isinstance(messages, (str, bytes)) or not all(isinstance(m, Mapping) for m in messages):
        raise UserError("messages: expected a list of {'role': ..., 'content': ...} mappings")
    for i, message in enumerate(messages):
        if "role" not in message:
            raise UserError(f"messages[{i}] has no 'role'")


def render_chat(template, messages, add_generation_prompt=True, bos_token="", eos_token="",
                name="(given)", **extra):
    """The prompt text for `messages` ([{"role": ..., "content": ...}, ...]).

    add_generation_prompt: end with the header that starts the assistant's turn.
    bos_token / eos_token: the model's token texts, which many templates write out.
    name: what the template is, for error messages (a file, a built-in's name, ...).
    extra: more variables for the template (tools=..., documents=..., ...).
    """
    if not isinstance(template, str) or not template:
        raise UserError(f"chat template {name}: empty")
    messages = list(messages)
    _check_messages(messages)
    compiled = _compiled(template, name)
    try:
        return template_limits.render(compiled, messages=messages, add_generation_prompt=add_generation_prompt,
                                      bos_token=bos_token, eos_token=eos_token, **extra)
    except template_limits.TemplateLimit as error:
        raise UserError(f"chat template {name}: {error}") from None
    except RecursionError:
        raise UserError(f"chat template {name}: recursion too deep "
                        f"(more than {template_limits.MAX_DEPTH} nested macro calls)") from None
    except MemoryError:
        raise UserError(f"chat template {name}: ran out of memory while rendering") from None
    except _TemplateRaised as error:
        raise UserError(f"chat template {name}: refused the conversation: "
                        f"{' '.join(str(error).split())}") from None
    except jinja2.UndefinedError as error:
        # e.g. firefunction's `functions` and `datetime`, which its own callers pass
        raise UserError(f"chat template {name}: {_describe(error)}: the template needs a "
                        "variable llambda does not set") from None
    except jinja2.TemplateError as error:
        raise UserError(f"chat template {name}: failed: {_describe(error)}") from None
    except (TypeError, ValueError, LookupError, AttributeError, ArithmeticError) as error:
        # Python errors inside the template's expressions, e.g. str + None content.
        raise UserError(f"chat template {name}: failed: {type(error).__name__}: "
                        f"{' '.join(str(error).split())}") from None
