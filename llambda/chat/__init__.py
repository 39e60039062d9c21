"""Conversations as prompts: the model's own Jinja chat template, and the built-in formats.

    template.py  rendering a conversation with the template a GGUF carries
    formats.py   built-in chat formats, how a template is recognised, the fallback format
    limits.py    bounds on rendering a template (code from a downloaded file)
    tools.py     the tools a request offers, how each model family writes a call, reading calls
    reply.py     a reply's content, <think> reasoning and tool calls, as OpenAI's deltas
    turn.py      one chat turn: the prompt with tools, the tool grammar, the reply's reader
"""
