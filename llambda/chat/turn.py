"""One chat turn's prompt, grammar and reply reader: messages (with tools, tool results and
earlier calls) to the prompt's token ids, the constraint a tool choice asks for, and how to
read the reply back (llambda/chat/reply.py). The server's /v1/chat/completions and
Model.respond both build their turns here.

    turn = prepare(model, messages, tools=tools, tool_choice="auto")
    completion = model.submit(turn.ids, constraint=turn.constraint, ...)
    reader = turn.reader()          # feed it the completion's text
"""
from dataclasses import dataclass

from llambda.chat import tools as tool_calls
from llambda.chat.reply import OPEN, ReplyReader
from llambda.errors import UserError

REASONING_FORMATS = ("auto", "none")
# tags a format writes that a vocabulary may hold as special tokens (then a grammar names them so)
TAGS = ("<tool_call>", "</tool_call>", "<|tool_call|>", "<|/tool_call|>", "<think>", "</think>")
# template variables a caller's chat_template_kwargs may not replace
RESERVED = ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token")


@dataclass
class Turn:
    ids: list
    constraint: object            # a llambda.serving.constraints.Constraint, or None
    tool_format: object           # the format calls are read in (None: no tools this turn)
    reasoning: bool
    thinking: bool                # the prompt opened a <think> block

    def reader(self):
        return ReplyReader(self.tool_format, reasoning=self.reasoning, thinking=self.thinking)


def tool_format_of(model, override=None):
    """The tool-call format of ``model``'s chat template (or ``override``: a format's name)."""
    if override is not None:
        return tool_calls.format_named(override)
    return tool_calls.format_for(model.chat_template.text, model.config.arch)


def special_tags(tokenizer):
    """Which of TAGS the vocabulary holds as one special token."""
    from llambda.serving.constraints import is_special
    found = set()
    for tag in TAGS:
        ids = tokenizer.encode(tag, add_special=False, parse_special=True)
        if len(ids) == 1 and is_special(tokenizer, ids[0]):
            found.add(tag)
    return found


def prepare(model, messages, *, tools=None, tool_choice=None, parallel_tool_calls=True, template_kwargs=None,
            reasoning="auto", tool_format=None, specials=None, constraint=None):
    """The Turn of ``messages`` (OpenAI's chat messages, as dicts). ``tools``: OpenAI's tools
    list; ``tool_choice``: "auto" (default), "none", "required" or {"type": "function",
    "function": {"name": ...}}; ``template_kwargs``: more template variables
    (``{"enable_thinking": False}``); ``reasoning``: "auto" splits a <think> block off the
    reply, "none" keeps it in the content; ``tool_format``: an entry of tools.FORMATS (default:
    the template's). ``constraint``: the caller's own (response_format); it cannot go with a
    tool choice that makes a grammar. Raises ToolError / UserError naming the field at fault."""
    if reasoning not in REASONING_FORMATS:
        raise UserError(f"reasoning_format: expected one of {', '.join(REASONING_FORMATS)}, got {reasoning!r}")
    extra = dict(template_kwargs or {})
    for key in RESERVED:
        if key in extra:
            raise UserError(f"chat_template_kwargs: {key!r} is set by the request itself")
    fmt = tool_format or tool_format_of(model)
    offered = tool_calls.parse_tools(tools)
    mode, name = tool_calls.parse_tool_choice(tool_choice, offered)
    active = offered if mode != "none" else []
    # OpenAI's null content (an assistant that only called tools): templates test it as text
    messages = [dict(m, content="") if isinstance(m, dict) and m.get("content", "") is None else m for m in messages]
    messages = fmt.messages(messages, active)
    if fmt.native and active:
        extra["tools"] = [t.as_openai() for t in active]
    text = model.render_chat(messages, **extra)
    ids = model.tokenize(text, add_special=model.chat_template.builtin)
    thinking = reasoning == "auto" and text.rstrip().endswith(OPEN)
    if active:
        if constraint is not None:
            raise tool_calls.ToolError("tool_choice", "tools cannot be combined with response_format or "
                                                      "another constraint; set tool_choice to 'none'")
        specials = special_tags(model.tokenizer) if specials is None else specials
        think = OPEN in model.chat_template.text and not thinking
        grammar = fmt.grammar(active, mode, name, parallel_tool_calls, specials, think)
        from llambda.serving.constraints import Constraint
        constraint = Constraint(grammar, model.tokenizer, model.n_vocab, field="tools")
    return Turn(ids, constraint, fmt if active else None, reasoning == "auto", thinking)
