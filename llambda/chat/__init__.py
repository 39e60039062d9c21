"""Conversations as prompts: the model's own Jinja chat template, and the built-in formats.

    template.py  rendering a conversation with the template a GGUF carries
    formats.py   built-in chat formats, how a template is recognised, the fallback format
    limits.py    bounds on rendering a template (code from a downloaded file)
"""
