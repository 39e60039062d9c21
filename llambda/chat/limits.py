"""Bounds on rendering a chat template, which is code from a downloaded model file.

Jinja's sandbox keeps a template away from Python internals but not from the machine's
memory and time: ``{{ "a" * 10**10 }}``, a string doubled in a loop, nested
``range(100000)`` loops or a macro that calls itself end in an abort, a MemoryError after
tens of seconds, a hang or a RecursionError. Here:

- size: the output, and every value a template builds (strings, lists, in its variables
  and namespaces), stay under MAX_CHARS; an operator or a call that would make a larger
  one (``*``, ``**``, ``%``, ``+``, ``center(10**10)``, ``"x".ljust(10**10)``) is refused
  before it allocates;
- time: rendering stops after MAX_SECONDS;
- recursion: at most MAX_DEPTH nested template frames (macro calls).

Time, depth and the size of built values are checked by a trace function that runs only
in the template's own frames (its compiled code), one check per line it executes. A
process that already traces (a debugger, coverage) keeps its own tracer and gets the
size bounds only.

A bound hit raises TemplateLimit; chat_template turns it into the one-line error that
names the template.
"""
import sys
import time

from jinja2.runtime import Namespace
from jinja2.sandbox import ImmutableSandboxedEnvironment

MAX_CHARS = 1 << 23          # output, and any one string or list: far above any context
MAX_SECONDS = 5.0
MAX_DEPTH = 200
_TEMPLATE_FILE = "<template>"       # co_filename of code compiled from_string
_CHECK_EVERY = 64                   # line events between clock readings


class TemplateLimit(Exception):
    """A template exceeded a rendering bound; the message says which."""


def _too_big(n):
    return TemplateLimit(f"would build a value of {n:,} items (more than {MAX_CHARS:,}): refused")


def _sized(value):
    return isinstance(value, (str, bytes, list, tuple))


def _check_size(value):
    if _sized(value) and len(value) > MAX_CHARS:
        raise _too_big(len(value))
    return value


def _check_binop(op, left, right):
    """Refuse before allocating: a repetition, a power or a concatenation whose result
    would be too large, and %-formatting with huge widths."""
    if op == "*":
        for seq, count in ((left, right), (right, left)):
            if _sized(seq) and isinstance(count, int) and len(seq) * max(count, 0) > MAX_CHARS:
                raise _too_big(len(seq) * count)
    elif op == "**":
        if isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0:
            if abs(left).bit_length() * right > 4 * MAX_CHARS:
                raise TemplateLimit(f"{left} ** {right} has too many digits: refused")
    elif op == "+":
        if _sized(left) and _sized(right) and len(left) + len(right) > MAX_CHARS:
            raise _too_big(len(left) + len(right))
    elif op == "%" and isinstance(left, str):
        _check_format_widths(left)


def _check_format_widths(text):
    """%-format and str.format width/precision fields that would pad past MAX_CHARS."""
    number = ""
    for char in text + " ":
        if char.isdigit():
            number += char
            continue
        if number and int(number) > MAX_CHARS:
            raise TemplateLimit(f"a format width of {int(number):,} (more than {MAX_CHARS:,}): refused")
        number = ""


def _check_args(args, kwargs):
    """An integer argument larger than MAX_CHARS (a width, a count, an indent) would make a
    value at least that large in every string method and filter that takes one."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, int) and not isinstance(value, bool) and value > MAX_CHARS:
            raise TemplateLimit(f"an argument of {value:,} (more than {MAX_CHARS:,}): refused")
        if isinstance(value, str) and ("%" in value or "{" in value):
            _check_format_widths(value)


class BoundedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox, with the sizing operators and every call checked before they run
    (an intercepted operator is also never folded at compile time)."""
    intercepted_binops = frozenset(("*", "**", "%", "+"))

    def call_binop(self, context, op, left, right):
        _check_binop(op, left, right)
        return _check_size(super().call_binop(context, op, left, right))

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (Jinja's own signature)
        _check_args(args, kwargs)
        if getattr(__obj, "__name__", None) == "replace" and len(args) >= 2:
            _check_replace(getattr(__obj, "__self__", None), args[0], args[1])
        return _check_size(super().call(__context, __obj, *args, **kwargs))


def _check_replace(text, old, new):
    if isinstance(text, str) and isinstance(old, str) and isinstance(new, str):
        grows = (text.count(old) if old else len(text) + 1) * max(len(new) - len(old), 0)
        if len(text) + grows > MAX_CHARS:
            raise _too_big(len(text) + grows)


def bound_filters(env):
    """Wrap every filter of ``env`` with the argument and result checks (filters are called
    directly by compiled code, and on constants at compile time, not through ``call``)."""
    for name, function in list(env.filters.items()):
        env.filters[name] = _bounded_filter(function, name)


def _bounded_filter(function, name):
    def bounded(*args, **kwargs):
        _check_args(args, kwargs)
        if name == "replace":
            values = [a for a in args if isinstance(a, str)]
            if len(values) >= 3:
                _check_replace(*values[-3:])
        return _check_size(function(*args, **kwargs))
    for attribute in ("jinja_pass_arg", "__name__", "__doc__"):   # pass_context & co.
        if hasattr(function, attribute):
            setattr(bounded, attribute, getattr(function, attribute))
    return bounded


def render(compiled, **variables):
    """``compiled.render(**variables)`` within the bounds; TemplateLimit when one is hit."""
    watch = _Watch()
    previous = sys.gettrace()
    if previous is None:
        sys.settrace(watch.global_trace)
    try:
        pieces, total = [], 0
        for piece in compiled.generate(**variables):
            total += len(piece)
            if total > MAX_CHARS:
                raise TemplateLimit(f"output longer than {MAX_CHARS:,} characters: refused")
            pieces.append(piece)
        return "".join(pieces)
    finally:
        if previous is None:
            sys.settrace(None)


class _Watch:
    """The trace function: depth on template frame calls, time and built sizes on lines."""

    def __init__(self):
        self.deadline = time.monotonic() + MAX_SECONDS
        self.depth = 0
        self.lines = 0

    def global_trace(self, frame, event, arg):
        if frame.f_code.co_filename != _TEMPLATE_FILE:
            return None
        self.depth += 1
        if self.depth > MAX_DEPTH:
            self.depth -= 1
            raise TemplateLimit(f"recursion deeper than {MAX_DEPTH} macro calls: refused")
        return self.local_trace

    def local_trace(self, frame, event, arg):
        if event == "return":
            self.depth -= 1
        elif event == "line":
            self.lines += 1
            if self.lines % _CHECK_EVERY == 0 and time.monotonic() > self.deadline:
                raise TemplateLimit(f"rendering took longer than {MAX_SECONDS:g} s: stopped")
            for value in frame.f_locals.values():
                if _sized(value) and len(value) > MAX_CHARS:
                    raise _too_big(len(value))
                if isinstance(value, Namespace):
                    for item in _namespace_values(value):
                        _check_size(item)
        return self.local_trace


def _namespace_values(namespace):
    attrs = getattr(namespace, "_Namespace__attrs", None)     # where Namespace keeps its values
    return list(attrs.values()) if isinstance(attrs, dict) else []

