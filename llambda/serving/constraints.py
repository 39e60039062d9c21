"""Constrained decoding: grammars that every generated token must follow, through llguidance.

    grammar = grammar_from(json_schema={"type": "object", ...})     # or regex=, choice=, grammar= (GBNF), lark=
    constraint = Constraint(grammar, tokenizer, n_vocab)             # one per sequence (its own matcher)
    completion = engine.submit(ids, sampler, max_tokens, constraint=constraint)

A grammar is llguidance's grammar string (what ``LLMatcher`` takes); ``grammar_from`` checks it
and says what is wrong in one line naming the field. A ``Constraint`` follows one sequence: before
each of its samples the engine fills its row of the step's bitmask (``MaskBatch.fill``, all the
constrained sequences of a step in one call), sets the banned logits to -inf (``MaskBatch.apply``),
samples, and hands the token back (``consume``). Tokens the grammar forces next (``forced``) are
generated without sampling: the engine runs them as prompt rows of the sequence's next step.

llguidance's tokenizer is built once per vocabulary from llambda's own token bytes
(``ll_tokenizer``); control tokens are marked special (their bytes behind 0xFF, llguidance's
convention), so no grammar ever spells text with them, and the end-of-generation ids are its EOS
tokens: the mask allows them exactly where the grammar may end.
"""
import json
import re
import threading
import weakref

import numpy as np

import llguidance
import llguidance.numpy as llg_numpy
from llguidance.gbnf_to_lark import gbnf_to_lark, is_lark_syntax

from llambda.errors import UserError
from llambda.tokenizer.vocab import TokenType

# JSON output may put at most this much whitespace between two tokens of the JSON text (at
# most a newline and its indentation, as llama.cpp's schema grammars allow). llguidance's
# default allows any amount, and a small model at a high temperature can fill a reply with it.
JSON_WHITESPACE = r"[\x20\x0A\x0D\x09]{0,20}"
JSON_OPTIONS = {"whitespace_pattern": JSON_WHITESPACE}

# The keyword of each kind of constraint grammar_from takes, in the order it names them.
KINDS = ("json_schema", "json_object", "grammar", "regex", "choice", "lark")


class ConstraintError(UserError):
    """A grammar, schema, regex or choice list that cannot constrain generation; ``field`` names
    the option at fault (the server's ``param``)."""

    def __init__(self, field, message):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.reason = message


# ---------------------------------------------------------------------------
# Grammars
# ---------------------------------------------------------------------------

def grammar_from(*, json_schema=None, json_object=False, grammar=None, regex=None, choice=None, lark=None,
                 field=None):
    """llguidance's grammar string for the one constraint given, or None when none is.

    json_schema: a JSON schema (a dict, or its JSON text); json_object: any JSON object;
    grammar: a llama.cpp GBNF grammar (or a Lark one); regex: the whole output matches it;
    choice: a non-empty list of strings, the output is exactly one of them; lark: a grammar in
    llguidance's Lark syntax. ``field``: the name errors give (default: the keyword's own).
    Raises ConstraintError for more than one kind, or one that llguidance rejects."""
    given = {"json_schema": json_schema is not None, "json_object": bool(json_object),
             "grammar": grammar is not None, "regex": regex is not None, "choice": choice is not None,
             "lark": lark is not None}
    kinds = [kind for kind in KINDS if given[kind]]
    if not kinds:
        return None
    if len(kinds) > 1:
        names = " and ".join(kinds)
        raise ConstraintError(field or names, f"give at most one constraint, not {names}")
    kind = kinds[0]
    field = field or kind
    if kind == "json_schema":
        text = _grammar_of_schema(json_schema, field)
    elif kind == "json_object":
        text = llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)
    elif kind == "grammar":
        text = _grammar_of_gbnf(grammar, field)
    elif kind == "regex":
        text = llguidance.LLMatcher.grammar_from_regex(_string(regex, field, "a regular expression"))
    elif kind == "choice":
        text = _grammar_of_choice(choice, field)
    else:
        text = llguidance.LLMatcher.grammar_from_lark(_string(lark, field, "a Lark grammar"))
    check_grammar(text, field)
    return text


def check_grammar(grammar, field="constraint", tokenizer=None):
    """Raise ConstraintError unless llguidance accepts ``grammar`` (with ``tokenizer``, an
    LLTokenizer, the special tokens it names are checked too)."""
    if not isinstance(grammar, str):
        raise ConstraintError(field, f"expected a grammar string, got {type(grammar).__name__}")
    try:
        error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
    except Exception as e:                 # (it reports bad grammars; a raise is a bad argument)
        error = str(e) or type(e).__name__
    if error:
        raise ConstraintError(field, one_line(error))


def _string(value, field, what):
    if not isinstance(value, str):
        raise ConstraintError(field, f"expected {what} (a string), got {type(value).__name__}")
    return value


def _grammar_of_schema(schema, field):
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise ConstraintError(field, f"not valid JSON ({e})") from None
    if isinstance(schema, bool):           # JSON Schema's true (anything) and false (nothing)
        schema = {} if schema else {"not": {}}
    if not isinstance(schema, dict):
        raise ConstraintError(field, f"expected a JSON schema (an object), got {type(schema).__name__}")
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
    except (ValueError, TypeError) as e:   # a value json cannot encode
        raise ConstraintError(field, one_line(str(e))) from None


def _grammar_of_gbnf(text, field):
    text = _string(text, field, "a GBNF grammar")
    if not is_lark_syntax(text):         # (llguidance's test: a Lark grammar has a start: rule)
        try:
            text = gbnf_to_lark(text)
        except Exception as e:             # the converter raises bare Exceptions too
            raise ConstraintError(field, f"not a valid GBNF grammar: {one_line(str(e))}") from None
    return llguidance.LLMatcher.grammar_from_lark(text)


def _grammar_of_choice(choice, field):
    if isinstance(choice, (str, bytes)) or not isinstance(choice, (list, tuple)):
        raise ConstraintError(field, f"expected a list of strings, got {type(choice).__name__}")
    if not choice:
        raise ConstraintError(field, "expected at least one choice, got an empty list")
    for i, option in enumerate(choice):
        if not isinstance(option, str):
            raise ConstraintError(f"{field}[{i}]", f"expected a string, got {type(option).__name__}")
    # each option a Lark string literal (JSON's escapes are Lark's)
    return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(o) for o in choice))


_SOURCE_LINE = re.compile(r"^\d+ \|")


def one_line(message):
    """llguidance's message on one line: its source excerpts and carets dropped."""
    lines = [line.strip() for line in str(message).splitlines()]
    kept = [line for line in lines if line and set(line) != {"^"} and not _SOURCE_LINE.match(line)]
    return " ".join(kept) or "rejected by llguidance"


# ---------------------------------------------------------------------------
# The tokenizer llguidance sees
# ---------------------------------------------------------------------------

_tokenizers = weakref.WeakKeyDictionary()       # llambda Tokenizer -> {n_vocab: LLTokenizer}
_tokenizers_lock = threading.Lock()


def ll_tokenizer(tokenizer, n_vocab):
    """llguidance's LLTokenizer for ids 0..n_vocab-1 of ``tokenizer`` (a llambda Tokenizer),
    built on first use and kept while the tokenizer lives (a large vocabulary takes a second)."""
    with _tokenizers_lock:
        built = _tokenizers.setdefault(tokenizer, {})
        if n_vocab not in built:
            built[n_vocab] = _build_ll_tokenizer(tokenizer, n_vocab)
        return built[n_vocab]


def is_special(tokenizer, token_id):
    """Tokens no grammar spells text with: control and unknown tokens, and the user-defined
    ones that look like markup tokens (``<...>``), as llguidance's own llama.cpp binding has it."""
    kind = tokenizer._types[token_id]
    if kind in (TokenType.CONTROL, TokenType.UNKNOWN):
        return True
    text = tokenizer.token_text(token_id)
    return kind == TokenType.USER_DEFINED and text.startswith("<") and text.endswith(">")


def _build_ll_tokenizer(tokenizer, n_vocab):
    end_ids = sorted(i for i in tokenizer.eog_ids if i < n_vocab)
    if tokenizer.eos_id is not None and tokenizer.eos_id < n_vocab and tokenizer.eos_id not in end_ids:
        end_ids.append(tokenizer.eos_id)
    if not end_ids:
        raise ConstraintError("constraint", "the model's vocabulary has no end-of-generation token, "
                                            "which constrained generation needs")
    tokens, special = [], []
    for i in range(n_vocab):
        piece = tokenizer.token_bytes(i)
        if is_special(tokenizer, i):
            piece = b"\xff" + piece
            special.append(i)
        tokens.append(piece)
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Vocabulary(tokenizer, tokens, special, end_ids)),
                                  n_vocab=n_vocab, eos_token=end_ids)


class _Vocabulary:
    """What llguidance.TokenizerWrapper reads: the token bytes, the special ids, and an encoder
    of text (llguidance tokenizes forced text with it)."""

    def __init__(self, tokenizer, tokens, special, end_ids):
        self._tokenizer = tokenizer
        self.tokens = tokens
        self.special_token_ids = special
        self.eos_token_id = tokenizer.eos_id if tokenizer.eos_id in end_ids else end_ids[0]
        self.bos_token_id = tokenizer.bos_id

    def __call__(self, text):
        # a str (the wrapper tries bytes first; encode refuses them, so it passes str)
        return self._tokenizer.encode(text, add_special=False, parse_special=False)


# ---------------------------------------------------------------------------
# One sequence's constraint
# ---------------------------------------------------------------------------

class ConstraintFailed(UserError):
    """A sequence's grammar failed while it generated (llguidance's matcher went into its
    error state, or refused a token): the request's constraint is at fault, not the model.
    ``field`` names the constraint's option."""

    def __init__(self, field, message):
        super().__init__(message)
        self.field = field


class Constraint:
    """One sequence's grammar state (one llguidance LLMatcher): which tokens may come next.

    grammar: a string from grammar_from (or any llguidance grammar); tokenizer: the model's
    llambda Tokenizer; n_vocab: ids from here on are banned. Raises ConstraintError when the
    grammar does not build (``field`` names it). Only the engine thread uses it once submitted.
    """

    def __init__(self, grammar, tokenizer, n_vocab, field="constraint", _matcher=None):
        self.field = field
        self.n_vocab = n_vocab
        self.failure = None           # a ConstraintFailed when its mask could not be computed (MaskBatch.fill)
        if _matcher is not None:
            self.matcher = _matcher
            return
        lltok = ll_tokenizer(tokenizer, n_vocab)
        if not isinstance(grammar, str):
            raise ConstraintError(field, f"expected a grammar string, got {type(grammar).__name__}")
        try:
            self.matcher = llguidance.LLMatcher(lltok, grammar, log_level=0)
        except Exception as e:
            raise ConstraintError(field, one_line(str(e) or type(e).__name__)) from None
        if self.matcher.is_error():
            raise ConstraintError(field, one_line(self.matcher.get_error()))

    def copy(self):
        """An independent copy in the same state (a forked sequence's own)."""
        return Constraint(None, None, self.n_vocab, self.field, _matcher=self.matcher.deep_copy())

    @property
    def error(self):
        """llguidance's message once the matcher failed, else None."""
        if not self.matcher.is_error():
            return None
        return one_line(self.matcher.get_error())

    @property
    def stopped(self):
        """True when the grammar takes no more tokens: the output is complete."""
        return self.matcher.is_stopped()

    @property
    def accepting(self):
        """True when the output may end here (the mask then allows the end-of-generation ids)."""
        return self.matcher.is_accepting()

    def forced(self):
        """The tokens the grammar forces next, whatever the model says (often none)."""
        return self.matcher.compute_ff_tokens()

    def allows(self, token):
        """Whether the grammar takes ``token`` next (nothing is consumed)."""
        return self.matcher.validate_tokens([token]) == 1

    def consume(self, token):
        """Advance over a generated token; raises ConstraintFailed if the grammar refuses it."""
        if not self.matcher.consume_token(token):
            raise self.failed(self.matcher.get_error() or f"it refuses token {token}")

    def failed(self, reason):
        """The ConstraintFailed to end this sequence with, for ``reason`` (text or exception)."""
        reason = one_line(str(reason) or type(reason).__name__)
        return ConstraintFailed(self.field, f"the grammar ({self.field}) failed: {reason}")


# ---------------------------------------------------------------------------
# The masks of a step
# ---------------------------------------------------------------------------

# _BANNED[b] holds, for a mask byte b, whether each of its 8 tokens is banned (bit 0 first:
# llguidance's masks are little-endian 32-bit words, bit i of word w for token 32w + i)
_BANNED = np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little") == 0


class MaskBatch:
    """The engine's bitmask of a step: one row per constrained sequence sampled in it, filled
    together, and applied to each logits row in place. Its arrays are allocated once."""

    def __init__(self, rows, n_vocab):
        self.rows = rows
        self.n_vocab = n_vocab
        # int32 [rows + 1, words]: the last row is fill_one's
        self.bitmask = llg_numpy.allocate_token_bitmask(rows + 1, n_vocab)
        n_bytes = self.bitmask.shape[1] * 4
        self._banned = np.empty((n_bytes, 8), dtype=bool)                   # one row's, unpacked
        self._row_of = {}
        self._executor = None

    def fill(self, constraints):
        """Compute the next-token mask of every constraint (at most ``rows``), in parallel when
        there are several; then ``apply`` each. A constraint whose mask could not be computed
        (its matcher went wrong) gets the reason in its ``failure``. Never raises."""
        self._row_of = {c: i for i, c in enumerate(constraints)}
        try:
            if len(constraints) > self.rows:
                raise ValueError(f"{len(constraints)} constraints for a mask of {self.rows} rows")
            if len(constraints) > 1:
                if self._executor is None:
                    self._executor = llguidance.LLExecutor()
                llg_numpy.fill_next_token_bitmask_par(
                    self._executor, [(c.matcher, i) for i, c in enumerate(constraints)], self.bitmask)
            elif constraints:
                llg_numpy.fill_next_token_bitmask(constraints[0].matcher, self.bitmask, 0)
        except Exception:                # find out which one failed: each on its own
            for i, c in enumerate(constraints[:self.rows]):
                self._fill_one(c, i)
        for c in constraints:
            if self._row_of[c] >= self.rows:
                c.failure = c.failed("it has no mask row")
            elif c.failure is None and c.matcher.is_error():
                c.failure = c.failed(c.matcher.get_error())

    def fill_one(self, constraint):
        """Compute one more constraint's mask, in a row of its own, keeping the masks ``fill``
        made for this step (a draw-first sequence whose draw its grammar refused)."""
        self._row_of[constraint] = self.rows
        self._fill_one(constraint, self.rows)
        if constraint.failure is None and constraint.matcher.is_error():
            constraint.failure = constraint.failed(constraint.matcher.get_error())

    def _fill_one(self, c, i):
        try:
            llg_numpy.fill_next_token_bitmask(c.matcher, self.bitmask, i)
        except Exception as e:
            c.failure = c.failed(e)

    def apply(self, constraint, logits):
        """Set the logits of the tokens ``constraint`` bans now to -inf, in place (ids from
        n_vocab on too); its mask must come from the last ``fill``."""
        row = self._row_of[constraint]
        apply_bitmask(self.bitmask[row], logits, self.n_vocab, self._banned)


def apply_bitmask(mask_row, logits, n_vocab, banned=None):
    """logits[i] = -inf for every id i < n_vocab whose bit in ``mask_row`` (llguidance's int32
    words) is 0, and for every i >= n_vocab. ``banned``: a bool scratch array of shape
    (4 * words, 8), reused; without it one is allocated."""
    if banned is None:
        banned = np.empty((mask_row.size * 4, 8), dtype=bool)
    np.take(_BANNED, mask_row.view(np.uint8), axis=0, out=banned)
    n = min(n_vocab, logits.size)
    np.copyto(logits[:n], -np.inf, where=banned.reshape(-1)[:n])
    logits[n:] = -np.inf
