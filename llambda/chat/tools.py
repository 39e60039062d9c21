"""Tool calls: the tools a request offers, how each model family writes a call, and reading
calls back out of the generated text, whole or while it streams.

    tools = parse_tools(request_tools)                   # [Tool]; ToolError names the field at fault
    mode, name = parse_tool_choice(tool_choice, tools)   # ("auto" | "none" | "required", forced name)
    fmt = format_for(template_text, arch)                # an entry of FORMATS
    messages = fmt.messages(messages, tools)             # what the template renders
    grammar = fmt.grammar(tools, mode, name, parallel, specials)    # llguidance's grammar string
    content, calls = fmt.parse(text)                     # calls: [Call(name, arguments JSON text)]

FORMATS has one entry per way a model family writes a call, chosen from the chat template's
text (as llama.cpp does), else from the architecture:

- ``hermes`` (Qwen 2.5/3, Hermes): ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``;
- ``llama3`` (Llama 3.1-3.3): a bare ``{"name": ..., "parameters": {...}}``;
- ``phi4`` (Phi-4-mini): ``<|tool_call|>[{"name": ..., "arguments": {...}}]<|/tool_call|>``;
- ``json`` (Gemma 3, and any template that does not render tools): the tools are described in
  the system prompt and the whole reply is JSON, ``{"tool_calls": [...]}`` or ``{"response": ...}``.

The first three are the templates' own formats: the template renders the tools, and the
grammar is lazy: text is free until the call's trigger, after which the call must be one of
the tools with arguments valid under its schema. ``required`` and a named function force the
call from the reply's start (after a ``<think>`` block where the template has them). The
``json`` entry constrains the whole reply (with ``auto``, to either kind of object).
Arguments are always the raw JSON text the model wrote, so streamed pieces add up to it.
"""
import json
import re
from dataclasses import dataclass

from llambda.errors import UserError

NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")        # OpenAI's function names (plus '.')
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


class ToolError(UserError):
    """A tools list, tool_choice or message that cannot be used; ``field`` names it."""

    def __init__(self, field, message):
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict

    def as_openai(self):
        """The tool as templates expect it: OpenAI's {"type": "function", "function": {...}}."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


@dataclass
class Call:
    name: str
    arguments: str            # the JSON text of the arguments object, as generated


def parse_tools(tools, field="tools"):
    """[Tool] of an OpenAI ``tools`` list; ToolError naming the entry at fault."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ToolError(field, f"expected a list of tools, got {type(tools).__name__}")
    out, seen = [], set()
    for i, tool in enumerate(tools):
        where = f"{field}[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise ToolError(f"{where}.type", "only tools of type 'function' are supported")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise ToolError(f"{where}.function", "expected an object with a name")
        name = fn.get("name")
        if not isinstance(name, str) or not NAME.match(name):
            raise ToolError(f"{where}.function.name", f"expected 1-64 letters, digits, '_', '-' or '.', got {name!r}")
        if name in seen:
            raise ToolError(f"{where}.function.name", f"the tool {name!r} is listed twice")
        seen.add(name)
        description = fn.get("description") or ""
        if not isinstance(description, str):
            raise ToolError(f"{where}.function.description", "expected a string")
        parameters = fn.get("parameters")
        if parameters is None:
            parameters = EMPTY_PARAMETERS
        if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
            raise ToolError(f"{where}.function.parameters", "expected a JSON schema of type 'object'")
        _check_schema(parameters, f"{where}.function.parameters")
        out.append(Tool(name, description, closed_objects(parameters)))
    return out


def closed_objects(schema):
    """``schema`` with ``additionalProperties: false`` wherever an object schema lists its
    properties and says nothing of others: llama.cpp's default for grammars, which keeps a
    small model from inventing arguments the tool does not take."""
    if isinstance(schema, list):
        return [closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (closed_objects(v) if k not in ("enum", "const", "default", "examples") else v)
           for k, v in schema.items()}
    if "properties" in out and "additionalProperties" not in out and "patternProperties" not in out:
        out["additionalProperties"] = False
    return out


def _check_schema(schema, field):
    from llambda.serving.constraints import ConstraintError, grammar_from
    try:
        grammar_from(json_schema=schema, field=field)
    except ConstraintError as e:
        raise ToolError(field, e.reason) from None


def parse_tool_choice(choice, tools, field="tool_choice"):
    """("auto" | "none" | "required", the forced function's name or None). No tools: "none"."""
    if choice is None:
        choice = "auto"
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise ToolError(field, f"expected 'auto', 'none', 'required' or a function, got {choice!r}")
        if choice == "required" and not tools:
            raise ToolError(field, "'required' needs tools")
        return ("none" if not tools else choice), None
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in {t.name for t in tools}:
            names = ", ".join(t.name for t in tools) or "none"
            raise ToolError(f"{field}.function.name", f"no tool is named {name!r} (tools: {names})")
        return "required", name
    raise ToolError(field, "expected 'auto', 'none', 'required' or {'type': 'function', 'function': {'name': ...}}")


# ---------------------------------------------------------------------------
# Grammar pieces (llguidance's Lark syntax)
# ---------------------------------------------------------------------------

def _lit(text, specials):
    """``text`` as a Lark sequence: special tokens of the vocabulary (``specials``, their text)
    by name, the rest as string literals (a special token cannot be spelled with text)."""
    if not text:
        return ""
    parts, rest = [], text
    pattern = re.compile("|".join(re.escape(s) for s in sorted(specials, key=len, reverse=True))) if specials else None
    while rest:
        m = pattern.search(rest) if pattern else None
        if m is None:
            parts.append(json.dumps(rest))
            break
        if m.start():
            parts.append(json.dumps(rest[:m.start()]))
        parts.append(m.group())
        rest = rest[m.end():]
    return " ".join(parts)


def _json(schema):
    return "%json " + json.dumps(schema, separators=(",", ":"))


# ---------------------------------------------------------------------------
# Formats
# ---------------------------------------------------------------------------

class WrappedFormat:
    """A call written as ``begin(name) + arguments JSON + end``, after a ``trigger`` that starts
    every call; the template renders the tools itself."""
    native = True

    def __init__(self, name, trigger, begin, end, argument_keys=("arguments",)):
        self.name = name
        self.trigger = trigger                   # the text that starts a call
        self._begin = begin                      # with {name}; starts with trigger
        self.end = end
        # what a call's text holds up to its arguments, and after them: the literal text of
        # begin and end, with any whitespace between their characters
        opening = begin.split("{{", 1)[0]       # the text before the JSON object
        self._head = re.compile(_spaced(opening) + r"\s*\{\s*\"name\"\s*:\s*\"([^\"]*)\"\s*,\s*\"(?:%s)\"\s*:\s*"
                                % "|".join(argument_keys))
        self._tail = re.compile(r"\s*" + _spaced(end))

    def begin(self, name):
        return self._begin.format(name=name)

    def messages(self, messages, tools):
        return _arguments_as_objects(messages)

    def grammar(self, tools, mode, name, parallel, specials=(), think=False):
        chosen = [t for t in tools if name is None or t.name == name]
        trigger_special = self.trigger in specials
        calls = []
        for i, tool in enumerate(chosen):
            begin = self.begin(tool.name)[len(self.trigger):]
            calls.append(f"call_{i}: {_lit(begin, specials)} {_json(tool.parameters)} {_lit(self.end, specials)}")
        lines = ["%llguidance {}"]
        any_call = " | ".join(f"call_{i}" for i in range(len(chosen)))
        if mode == "required":
            # from the reply's start (a <think> block first where the template has them)
            prefix = "think? " if think else ""
            repeat = f"(WS {_lit(self.trigger, specials)} (" + any_call + "))*" if parallel else ""
            lines.append(f"start: {prefix}WS {_lit(self.trigger, specials)} ({any_call}) {repeat}")
            if think:
                # the block ends at its first </think> (a lazy lexeme), or at the special token
                if "</think>" in specials:
                    lines.append(f"think: {_lit('<think>', specials)} TEXT {_lit('</think>', specials)}")
                else:
                    lines += [f"think: {_lit('<think>', specials)} think_end", 'think_end[lazy]: TEXT "</think>"']
                lines.append(r"TEXT: /(.|\n)*/")
            lines.append(r"WS: /[ \n]{0,2}/")
        else:
            count = "+" if parallel else ""
            if trigger_special:
                lines.append(f"start: (TEXT {_lit(self.trigger, specials)} ({any_call})){count} | TEXT")
            else:
                lines.append(f"start: (trigger ({any_call})){count} | TEXT")
                lines.append(f"trigger[lazy]: TEXT {_lit(self.trigger, specials)}")
            lines.append(r"TEXT: /(.|\n)*/")
        return "\n".join(lines + calls)

    # -- reading calls back ------------------------------------------------------
    def parse(self, text, partial=False):
        """(content, [Call]) of ``text``. ``partial``: text still growing: content stops short
        of a trigger that may be starting, and the last call's arguments are those written so
        far (each result extends the one before)."""
        content, calls, at = [], [], 0
        while True:
            start = text.find(self.trigger, at)
            if start < 0:
                tail = text[at:]
                if partial:
                    tail = tail[:len(tail) - held_back(tail, self.trigger)]
                content.append(tail)
                break
            content.append(text[at:start])
            call, end = self._read_call(text, start, partial)
            if call is None:                     # not a call after all (only when not partial)
                content.append(self.trigger)
                at = start + len(self.trigger)
                continue
            calls.append(call)
            if end is None:                      # still being written
                break
            at = end
        return "".join(content), calls

    def _read_call(self, text, at, partial):
        """(Call, index after it) of the call whose text starts at ``at``; (Call, None) for one
        still being written; (None, None) when it is no call."""
        head = self._head.match(text, at)
        if head is None:
            return (Call("", ""), None) if partial else (None, None)
        args_at = head.end()
        try:
            _, args_end = json.JSONDecoder().raw_decode(text, args_at)
        except ValueError:
            if partial:
                return Call(head.group(1), text[args_at:]), None
            return None, None
        call = Call(head.group(1), text[args_at:args_end])
        tail = self._tail.match(text, args_end)
        if tail is None:
            # the closing text is still being written (or was cut off: the call stands)
            return (call, None) if partial else (call, len(text))
        return call, tail.end()


class JsonFormat:
    """Templates that do not render tools: the tools go into the system prompt, and the whole
    reply is one JSON object, constrained: {"tool_calls": [{"name", "arguments"}, ...]} or
    {"response": "..."} (Gemma 3's prompted JSON; llama.cpp's generic format)."""
    native = False
    name = "json"
    trigger = None

    def messages(self, messages, tools):
        """The system prompt tells of the tools and the reply's shape; earlier calls and their
        results are written as that JSON, in user turns (templates without tools know no
        'tool' role, and some insist that user and assistant alternate)."""
        listing = json.dumps([t.as_openai()["function"] for t in tools], ensure_ascii=False, indent=1)
        guide = ("You can call these tools:\n" + listing + "\n\nReply with one JSON object: "
                 '{"tool_calls": [{"name": "<tool name>", "arguments": {<arguments>}}]} to call tools, '
                 'or {"response": "<your answer>"} to answer the user directly.')
        out = []
        for m in messages:
            m = dict(m)
            if m.get("role") == "assistant" and m.get("tool_calls"):
                calls = [{"name": c["function"]["name"], "arguments": _loads_or_text(c["function"]["arguments"])}
                         for c in m["tool_calls"]]
                m = {"role": "assistant", "content": json.dumps({"tool_calls": calls}, ensure_ascii=False)}
            elif m.get("role") == "assistant" and m.get("content") is not None:
                m = {"role": "assistant", "content": json.dumps({"response": m["content"]}, ensure_ascii=False)}
            elif m.get("role") == "tool":
                result = json.dumps({"tool_response": {"tool_call_id": m.get("tool_call_id"),
                                                       "content": m.get("content")}}, ensure_ascii=False)
                if out and out[-1].get("role") == "user" and out[-1].get("_tool_results"):
                    out[-1]["content"] += "\n" + result
                    continue
                m = {"role": "user", "content": result, "_tool_results": True}
            out.append(m)
        for m in out:
            m.pop("_tool_results", None)
        if tools:
            if out and out[0].get("role") == "system":
                out[0] = dict(out[0], content=f"{out[0].get('content') or ''}\n\n{guide}".lstrip())
            else:
                out.insert(0, {"role": "system", "content": guide})
        return out

    def schema(self, tools, mode, name, parallel):
        chosen = [t for t in tools if name is None or t.name == name]
        item = {"anyOf": [{"type": "object", "properties": {"name": {"const": t.name}, "arguments": t.parameters},
                           "required": ["name", "arguments"], "additionalProperties": False} for t in chosen]}
        calls = {"type": "object", "properties": {"tool_calls": dict(
            {"type": "array", "items": item, "minItems": 1}, **({} if parallel else {"maxItems": 1}))},
            "required": ["tool_calls"], "additionalProperties": False}
        if mode == "required":
            return calls
        answer = {"type": "object", "properties": {"response": {"type": "string"}},
                  "required": ["response"], "additionalProperties": False}
        return {"anyOf": [calls, answer]}

    def grammar(self, tools, mode, name, parallel, specials=(), think=False):
        from llambda.serving.constraints import grammar_from
        return grammar_from(json_schema=self.schema(tools, mode, name, parallel), field="tools")

    def parse(self, text, partial=False):
        """(content, [Call]): the response's text or the calls. While ``partial``, the response
        so far (an unfinished JSON string read up to its last whole character) and no calls."""
        head = re.match(r'\s*\{\s*"(response|tool_calls)"\s*:\s*', text)
        if head is None:
            return ("", []) if partial else (text, [])
        if head.group(1) == "response":
            value, _ = partial_json_string(text, head.end())
            return value, []
        if partial:
            return "", []
        try:
            obj = json.loads(text)
        except ValueError:
            return text, []
        if "response" in obj:
            return str(obj["response"]), []
        # the arguments' JSON text, re-encoded (the reply is parsed whole, never streamed)
        calls = [Call(item["name"], json.dumps(item.get("arguments", {}), ensure_ascii=False))
                 for item in obj.get("tool_calls", [])]
        return "", calls


def partial_json_string(text, at):
    """(the decoded text of the JSON string starting at ``text[at]`` (a quote) as far as it is
    written, whether it closed). An escape still being written is left for later."""
    if at >= len(text) or text[at] != '"':
        return "", False
    out, i = [], at + 1
    while i < len(text):
        ch = text[i]
        if ch == '"':
            return "".join(out), True
        if ch == "\\":
            piece = text[i:i + 6] if text[i + 1:i + 2] == "u" else text[i:i + 2]
            if len(piece) < (6 if piece[1:2] == "u" else 2):
                break                              # cut mid-escape
            try:
                out.append(json.loads(f'"{piece}"'))
            except ValueError:
                break
            i += len(piece)
            continue
        out.append(ch)
        i += 1
    return "".join(out), False


def _spaced(literal):
    """A regex of ``literal``'s characters with any whitespace between and for its own."""
    return r"\s*".join(re.escape(ch) for ch in literal if not ch.isspace())


def held_back(text, trigger):
    """How many characters at the end of ``text`` could be the start of ``trigger`` (text
    that waits while it may still become the tag)."""
    for n in range(min(len(trigger) - 1, len(text)), 0, -1):
        if text.endswith(trigger[:n]):
            return n
    return 0


def _loads_or_text(arguments):
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def _arguments_as_objects(messages):
    """Templates render a call's arguments with ``tojson``: give them the object, not OpenAI's
    JSON text (as llama.cpp does), so the prompt holds the JSON once, not a quoted string."""
    out = []
    for m in messages:
        if m.get("role") == "assistant" and m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                fn = dict(c["function"], arguments=_loads_or_text(c["function"].get("arguments")))
                calls.append(dict(c, function=fn, **fn))        # both tool_call.function.x and tool_call.x
            m = dict(m, tool_calls=calls)
        out.append(m)
    return out


HERMES = WrappedFormat("hermes", "<tool_call>", '<tool_call>\n{{"name": "{name}", "arguments": ', "}\n</tool_call>")
LLAMA3 = WrappedFormat("llama3", '{"name": "', '{{"name": "{name}", "parameters": ', "}",
                       argument_keys=("parameters", "arguments"))
PHI4 = WrappedFormat("phi4", "<|tool_call|>", '<|tool_call|>[{{"name": "{name}", "arguments": ', "}]<|/tool_call|>")
JSON = JsonFormat()

# (name, test of the template's text): the first that matches chooses; else JSON
FORMATS = (
    ("hermes", HERMES, lambda t: "<tool_call>" in t),
    ("phi4", PHI4, lambda t: "<|tool_call|>" in t),
    ("llama3", LLAMA3, lambda t: '"parameters"' in t and ("<|python_tag|>" in t or "ipython" in t)),
)


def format_for(template_text, arch=None):
    """The tool-call format of a chat template (llama.cpp's way: by what the template writes);
    templates that render no tools (Gemma 3's among them) get the prompted JSON format."""
    text = template_text or ""
    for _, fmt, matches in FORMATS:
        if matches(text):
            return fmt
    return JSON


def format_named(name):
    for fmt_name, fmt, _ in FORMATS:
        if fmt_name == name:
            return fmt
    if name == "json":
        return JSON
    raise UserError(f"--tool-format: expected one of hermes, phi4, llama3, json, got {name!r}")
