"""The request bodies of the OpenAI API that llambda serves, as pydantic models.

Validation is strict (a string is not a number, a number is not a string), so an ill-typed field
is a 400 naming it rather than a silent coercion; unknown fields are ignored, as OpenAI's own
clients send fields a local server has no use for (``user``, ``metadata``, ...). Ranges follow
the OpenAI API reference; ``top_k``, ``min_p``, ``repeat_penalty`` and ``ignore_eos`` are
llama.cpp's extras, ``stop_token_ids`` and ``min_tokens`` vLLM's. Options llambda cannot honour
(best_of, suffix, ...) are refused by ``unsupported()`` instead of being dropped. Tools and reasoning:
llambda/chat/turn.py.

Structured output (``constraint_options``): OpenAI's ``response_format`` (json_object,
json_schema), llama.cpp's ``grammar`` (GBNF) and ``json_schema``, vLLM's ``regex`` / ``choice``
and its ``guided_*`` and ``structured_outputs`` spellings, on both endpoints; at most one.
"""
from typing import Annotated, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from .errors import ApiError

# OpenAI takes any 64-bit seed; the sampler wants a non-negative one (see sampling_options).
Seed = Annotated[int, Field(ge=-(2 ** 63), lt=2 ** 64)]
Stop = Union[str, Annotated[list[str], Field(max_length=16)]]


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


JsonSchema = Union[dict, bool]             # JSON Schema's true and false are schemas too


class StructuredOutputs(_Body):
    """vLLM's ``structured_outputs`` (its newer spelling of the guided_* fields)."""
    json_: Optional[Union[JsonSchema, str]] = Field(None, alias="json")
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None


class JsonSchemaFormat(_Body):
    name: Optional[str] = None
    description: Optional[str] = None
    schema_: Optional[JsonSchema] = Field(None, alias="schema")
    strict: Optional[bool] = None            # the schema binds either way (as llama.cpp does)


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None
    schema_: Optional[JsonSchema] = Field(None, alias="schema")     # llama.cpp: json_object with a schema


class _Sampling(_Body):
    """Fields both endpoints share."""
    model: str
    max_tokens: Optional[Annotated[int, Field(ge=0)]] = None
    temperature: Optional[Annotated[float, Field(ge=0.0, le=2.0)]] = None
    top_p: Optional[Annotated[float, Field(ge=0.0, le=1.0)]] = None
    n: Optional[Annotated[int, Field(ge=1, le=128)]] = None
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    stop: Optional[Stop] = None
    presence_penalty: Optional[Annotated[float, Field(ge=-2.0, le=2.0)]] = None
    frequency_penalty: Optional[Annotated[float, Field(ge=-2.0, le=2.0)]] = None
    seed: Optional[Seed] = None
    # {token id as text: bias}: ids checked against the vocabulary by Model.submit (400 naming logit_bias)
    logit_bias: Optional[dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]]] = None
    user: Optional[str] = None
    # llama.cpp's extras
    top_k: Optional[Annotated[int, Field(ge=0)]] = None
    min_p: Optional[Annotated[float, Field(ge=0.0, lt=1.0)]] = None
    repeat_penalty: Optional[Annotated[float, Field(gt=0.0)]] = None
    ignore_eos: bool = False
    # vLLM's extras
    stop_token_ids: Optional[list[int]] = None
    min_tokens: Optional[Annotated[int, Field(ge=0)]] = None
    # structured output (constraint_options)
    response_format: Optional[ResponseFormat] = None
    grammar: Optional[str] = None
    json_schema: Optional[JsonSchema] = None
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    guided_json: Optional[Union[JsonSchema, str]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None
    structured_outputs: Optional[StructuredOutputs] = None


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ContentPart(_Body):
    """Any part; only text parts are understood (see unsupported)."""
    model_config = ConfigDict(strict=True, extra="allow")
    type: str
    text: Optional[str] = None


class FunctionCall(_Body):
    name: str
    arguments: str                           # JSON text, as OpenAI sends it


class ToolCall(_Body):
    id: Optional[str] = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Body):
    model_config = ConfigDict(strict=True, extra="allow")     # name, ... reach the template
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[ContentPart], None] = None
    tool_calls: Optional[list[ToolCall]] = None              # an assistant's earlier calls
    tool_call_id: Optional[str] = None                       # a tool result's call
    reasoning_content: Optional[str] = None                  # an assistant's earlier reasoning


class ChatRequest(_Sampling):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Optional[Annotated[int, Field(ge=0)]] = None
    logprobs: Optional[bool] = False
    top_logprobs: Optional[Annotated[int, Field(ge=0, le=20)]] = None
    # checked by llambda/chat/tools.py (400 naming the entry at fault)
    tools: Optional[list[dict]] = None
    tool_choice: Optional[Union[str, dict]] = None
    parallel_tool_calls: Optional[bool] = None
    # more variables for the chat template ({"enable_thinking": false}), llama.cpp's and vLLM's
    chat_template_kwargs: Optional[dict] = None
    # llama.cpp's: "auto" puts a <think> block in reasoning_content, "none" leaves it in the content
    reasoning_format: Optional[Literal["auto", "none", "deepseek"]] = None


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[Annotated[int, Field(ge=0)]] = 16       # OpenAI's default for completions
    logprobs: Optional[Annotated[int, Field(ge=0, le=20)]] = None
    echo: Optional[bool] = False
    best_of: Optional[Annotated[int, Field(ge=1)]] = None
    suffix: Optional[str] = None


def unsupported_content(messages):
    """(param, message) of the first content part that is not text, else None."""
    for i, m in enumerate(messages):
        if isinstance(m.content, list):
            for j, part in enumerate(m.content):
                if part.type != "text" or part.text is None:
                    return f"messages[{i}].content[{j}]", f"content part of type {part.type!r} is not supported (only 'text')"
    return None


def unsupported(req):
    """(param, message) of the first option of ``req`` llambda does not implement, else None."""
    if isinstance(req, ChatRequest):
        if req.top_logprobs is not None and not req.logprobs:
            return "top_logprobs", "top_logprobs needs logprobs: true"
        problem = unsupported_content(req.messages)
        if problem is not None:
            return problem
    else:
        if req.best_of not in (None, 1):
            return "best_of", "only best_of=1 is supported"
        if req.suffix:
            return "suffix", "suffix is not supported"
        if req.echo and req.logprobs is not None:
            return "echo", "echo with logprobs is not supported"
        if isinstance(req.prompt, list) and req.prompt and not isinstance(req.prompt[0], int):
            if len(req.prompt) != 1:
                return "prompt", "only one prompt per request is supported"
    return None


def constraint_options(req):
    """(field, {kind: value}) of the one constraint a request asks for, for Model.constraint
    (field: the request field that names it, for errors), or None. A request asking for two
    gets a 400 naming both."""
    found = []
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        found.append(("response_format", {"json_schema": rf.schema_} if rf.schema_ is not None
                      else {"json_object": True}))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise ApiError(400, "response_format of type 'json_schema' needs json_schema.schema",
                           param="response_format.json_schema", code="missing_required_parameter")
        found.append(("response_format.json_schema.schema", {"json_schema": rf.json_schema.schema_}))
    so = req.structured_outputs
    for field, kind, value in (
            ("grammar", "grammar", req.grammar), ("json_schema", "json_schema", req.json_schema),
            ("regex", "regex", req.regex), ("choice", "choice", req.choice),
            ("guided_json", "json_schema", req.guided_json), ("guided_regex", "regex", req.guided_regex),
            ("guided_choice", "choice", req.guided_choice), ("guided_grammar", "grammar", req.guided_grammar),
            ("structured_outputs.json", "json_schema", so and so.json_),
            ("structured_outputs.regex", "regex", so and so.regex),
            ("structured_outputs.choice", "choice", so and so.choice),
            ("structured_outputs.grammar", "grammar", so and so.grammar)):
        if value is not None:
            found.append((field, {kind: value}))
    if len(found) > 1:
        names = " and ".join(field for field, _ in found)
        raise ApiError(400, f"give at most one structured-output constraint, not {names}",
                       param=found[1][0], code="invalid_request")
    return found[0] if found else None


def message_dicts(req):
    """The messages as the chat template takes them: text content, OpenAI's developer role as system."""
    out = []
    for m in req.messages:
        d = m.model_dump(exclude_none=True)
        if isinstance(m.content, list):
            d["content"] = "".join(part.text for part in m.content)
        elif m.content is None:
            d["content"] = ""
        if d["role"] == "developer":
            d["role"] = "system"
        out.append(d)
    return out


def completion_prompt(req):
    """The prompt of a completion request: a string or a list of token ids."""
    p = req.prompt
    if isinstance(p, list) and p and isinstance(p[0], str):
        return p[0]
    if isinstance(p, list) and p and isinstance(p[0], list):
        if len(p) != 1:
            return None
        return p[0]
    return p


def sampling_options(req, n_ctx_left):
    """Model.submit's keyword arguments from a request, with OpenAI's defaults (temperature 1,
    top_p 1, no top_k / min_p / penalties unless asked for)."""
    if isinstance(req, ChatRequest) and req.max_completion_tokens is not None:
        max_tokens = req.max_completion_tokens
    else:
        max_tokens = req.max_tokens
    if max_tokens is None:
        max_tokens = n_ctx_left          # chat's default: as long as the context allows
    temperature = 1.0 if req.temperature is None else req.temperature
    top_p = 1.0 if req.top_p is None else req.top_p
    if top_p == 0.0:                     # only the most likely token survives: greedy
        temperature, top_p = 0.0, 1.0
    seed = None if req.seed is None else req.seed % 2 ** 64
    stop = req.stop if req.stop is not None else []
    return dict(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                top_k=req.top_k or 0, min_p=req.min_p or 0.0,
                repeat_penalty=1.0 if req.repeat_penalty is None else req.repeat_penalty,
                presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
                seed=seed, stop=stop, ignore_eos=req.ignore_eos, logit_bias=req.logit_bias,
                stop_token_ids=req.stop_token_ids or (), min_tokens=req.min_tokens or 0)
