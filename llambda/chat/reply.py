"""Reading a chat reply as it is generated: reasoning, content and tool calls, as OpenAI's
chat deltas.

    reply = ReplyReader(tool_format=tools.HERMES, reasoning=True, thinking=False)
    for piece in generated_text_pieces:
        for delta in reply.feed(piece):       # {"reasoning_content": ...} | {"content": ...} | {"tool_calls": [...]}
            send(delta)
    for delta in reply.finish():
        send(delta)
    reply.message()                            # {"content", "reasoning_content", "tool_calls"} of the whole reply

Reasoning (Qwen3, DeepSeek R1 style): a ``<think>...</think>`` block at the reply's start goes
to ``reasoning_content``; ``thinking=True`` when the prompt itself opened the block (the
template wrote ``<think>`` after the generation prompt). A block never closed is all reasoning.
Tool calls are read after the reasoning, in the model family's format (llambda/chat/tools.py).

Each piece of text is read again with all that came before (a reply is at most a context of
text, and the readers are linear), and only what extends what was sent is sent: text that may
still become a tag (``<thi``, ``<tool_ca``) and trailing whitespace wait until they are known.
So the deltas always add up to ``message()``.
"""
import uuid

from llambda.chat.tools import held_back

OPEN, CLOSE = "<think>", "</think>"


def split_reasoning(text, thinking=False, partial=False):
    """(reasoning, rest) of a reply's text. ``thinking``: the prompt opened the block already."""
    at = 0
    if not thinking:
        stripped = text.lstrip()
        if not stripped.startswith(OPEN):
            if partial and stripped and OPEN.startswith(stripped):
                return "", ""                      # may be the tag, still being written
            return "", text
        at = len(text) - len(stripped) + len(OPEN)
    close = text.find(CLOSE, at)
    if close < 0:
        reasoning = text[at:]
        if partial:
            reasoning = reasoning[:len(reasoning) - held_back(reasoning, CLOSE)]
        return reasoning.lstrip(), ""
    return text[at:close].lstrip(), text[close + len(CLOSE):].lstrip("\n")


class ReplyReader:
    """One reply's reader (see the module's docstring). ``tool_format``: an entry of
    llambda.chat.tools.FORMATS, or None to read no tool calls; ``reasoning``: split a
    ``<think>`` block off; ``thinking``: the prompt opened that block."""

    def __init__(self, tool_format=None, reasoning=True, thinking=False):
        self.tool_format = tool_format
        self.reasoning = reasoning
        self.thinking = thinking and reasoning
        self.text = ""
        self._sent = {"reasoning_content": "", "content": ""}
        self._calls = []                           # [(id, name, arguments sent)]

    def feed(self, piece):
        self.text += piece
        return self._deltas(*self._read(partial=True))

    def finish(self):
        return self._deltas(*self._read(partial=False))

    def message(self):
        """The whole reply: content (None when there is none beside tool calls), reasoning_content
        (None without a block), tool_calls (None without calls)."""
        reasoning, content, calls = self._read(partial=False)
        calls = self._with_ids(calls)
        return {"content": None if calls and not content else content,
                "reasoning_content": reasoning if reasoning else None,
                "tool_calls": [{"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
                               for call_id, name, args in calls] or None}

    # -- reading ----------------------------------------------------------------
    def _read(self, partial):
        reasoning, body = ("", self.text)
        if self.reasoning:
            reasoning, body = split_reasoning(self.text, self.thinking, partial)
        calls = []
        if self.tool_format is not None:
            body, calls = self.tool_format.parse(body, partial)
            calls = [(c.name, c.arguments) for c in calls if c.name]
        if partial:                 # trailing whitespace may end the text: it waits
            reasoning, body = reasoning.rstrip(), body.rstrip()
        else:
            reasoning = reasoning.rstrip()
            if calls:
                body = body.rstrip()
        return reasoning, body, calls

    def _with_ids(self, calls):
        while len(self._calls) < len(calls):
            self._calls.append((f"call_{uuid.uuid4().hex[:24]}", calls[len(self._calls)][0], ""))
        return [(self._calls[i][0], name, args) for i, (name, args) in enumerate(calls)]

    def _deltas(self, reasoning, content, calls):
        out = []
        for key, now in (("reasoning_content", reasoning), ("content", content)):
            sent = self._sent[key]
            if len(now) > len(sent) and now.startswith(sent):
                out.append({key: now[len(sent):]})
                self._sent[key] = now
        known = len(self._calls)
        for i, (call_id, name, args) in enumerate(self._with_ids(calls)):
            sent = self._calls[i][2]
            if i >= known:                     # a new call: its id and name first (OpenAI's shape)
                out.append({"tool_calls": [{"index": i, "id": call_id, "type": "function",
                                            "function": {"name": name, "arguments": ""}}]})
            if len(args) > len(sent) and args.startswith(sent):
                out.append({"tool_calls": [{"index": i, "function": {"arguments": args[len(sent):]}}]})
                self._calls[i] = (call_id, name, args)
        return out
