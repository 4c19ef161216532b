"""Chat templates: turn a conversation into the prompt text a model was trained on.

A model ships its chat template as jinja source (GGUF key `tokenizer.chat_template`, or a file given
with `--chat-template-file`). Templates come from model repositories, so they are untrusted code: they
run in jinja's immutable sandbox, and anything that goes wrong (a syntax error, the template's own
`raise_exception(...)`, an undefined value, a reach for Python internals) surfaces as one
`TemplateError` that names the template and, where jinja knows it, the line.

The output matches `transformers`' `apply_chat_template(..., tokenize=False)` exactly: the same
environment options, the same globals and filters (`raise_exception`, `strftime_now`, `tojson`,
`namespace`, `dict`), the same `{% generation %}` tag, and the same preparation of the inputs
(keys whose value is None dropped, reasoning copied under `reasoning_content` and `thinking`).
One deliberate difference: reading an unsafe attribute (`''.__class__`) raises at once, where jinja
alone would quietly render an empty string.
"""

from __future__ import annotations

import json
import operator
from collections.abc import Mapping, Sequence
from datetime import datetime
from importlib.metadata import version
from pathlib import Path
from types import TracebackType
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment, modifies_known_mutable

from .errors import TemplateError

# Older jinja2 releases have known sandbox escapes, and templates are untrusted.
_MIN_JINJA = (3, 1, 6)

# The names a message's reasoning arrives under. Templates read `reasoning_content` (most) or
# `thinking` (gpt-oss), so whichever the caller used is copied to both, as transformers does.
_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


class ChatTemplate:
    """A compiled chat template, ready to render conversations.

    `name` says which template this is in error messages ("chat template /path/x.jinja").
    """

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "", name: str = "chat template"):
        if not isinstance(source, str):
            raise TemplateError(f"{name}: the template must be a string, not {type(source).__name__}")
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.name = name
        try:
            self._template = _environment().from_string(source)
        except Exception as exc:  # syntax errors, and anything else the compiler trips on
            raise _template_error(name, exc) from None

    def __repr__(self) -> str:
        return f"ChatTemplate(name={self.name!r}, {len(self.source)} chars)"

    @classmethod
    def from_metadata(
        cls, metadata: Mapping[str, Any], tokens: Sequence[str] | None = None, *, name: str | None = None
    ) -> ChatTemplate | None:
        """The template stored in GGUF metadata, or None when the file has none.

        BOS/EOS strings come from `special_token_strings(metadata, tokens)`.
        """
        source = metadata.get("tokenizer.chat_template")
        if source is None:
            return None
        label = name or "chat template (GGUF key tokenizer.chat_template)"
        if not isinstance(source, str):
            raise TemplateError(f"{label}: expected a string, got {type(source).__name__}")
        bos_token, eos_token = special_token_strings(metadata, tokens)
        return cls(source, bos_token=bos_token, eos_token=eos_token, name=label)

    @classmethod
    def from_file(cls, path: str | Path, *, bos_token: str = "", eos_token: str = "") -> ChatTemplate:
        """A template read from a jinja file (`--chat-template-file`).

        The file holds no BOS/EOS strings; take them from the model with `special_token_strings`.
        """
        label = f"chat template {path}"
        try:
            source = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise TemplateError(f"{label}: cannot read the file: {exc}") from None
        return cls(source, bos_token=bos_token, eos_token=eos_token, name=label)

    def render(
        self,
        messages: list[dict],
        *,
        tools: list[dict] | None = None,
        documents: list[dict] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """The prompt text for `messages`.

        `tools` are JSON schemas (OpenAI style), `documents` are dicts for RAG templates. Any other
        keyword (`enable_thinking=False`, ...) is passed to the template as a variable, and may
        override `bos_token`/`eos_token`.
        """
        context = _plain(
            {
                "bos_token": self.bos_token,
                "eos_token": self.eos_token,
                **template_kwargs,
                "messages": _prepare_messages(messages, self.name),
                "tools": _list_of_dicts(tools, "tools", self.name),
                "documents": _list_of_dicts(documents, "documents", self.name),
                "add_generation_prompt": add_generation_prompt,
            }
        )
        try:
            return self._template.render(context)
        except Exception as exc:  # the template is untrusted: whatever it trips on is its error
            raise _template_error(self.name, exc) from None


def decode_tool_arguments(messages: list[dict]) -> list[dict]:
    """A copy of `messages` whose tool-call arguments given as JSON object strings are dicts.

    OpenAI clients send `function.arguments` as a JSON string, but several templates (Qwen3.5,
    Qwen3-Coder, Laguna) iterate over the arguments and only accept a dict, while others (Gemma 4)
    print a string as is. transformers passes arguments through untouched, so `render` does too;
    a server calls this first for templates that need dicts. Strings that do not decode to a JSON
    object stay as they are.
    """
    decoded = []
    for message in messages:
        tool_calls = message.get("tool_calls") if isinstance(message, Mapping) else None
        if isinstance(tool_calls, list):
            message = {**message, "tool_calls": [_decode_call(call) for call in tool_calls]}
        decoded.append(message)
    return decoded


def _decode_call(call: Any) -> Any:
    function = call.get("function") if isinstance(call, Mapping) else None
    arguments = function.get("arguments") if isinstance(function, Mapping) else None
    if not isinstance(arguments, str):
        return call
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return call
    if not isinstance(parsed, dict):
        return call
    return {**call, "function": {**function, "arguments": parsed}}


# --- inputs -------------------------------------------------------------------------------------


def special_token_strings(
    metadata: Mapping[str, Any], tokens: Sequence[str] | None = None
) -> tuple[str, str]:
    """The (BOS, EOS) strings templates see as `bos_token`/`eos_token`, from GGUF tokenizer metadata.

    Ids come from `tokenizer.ggml.{bos,eos}_token_id`, strings from `tokens` (default: the metadata's
    `tokenizer.ggml.tokens`); a missing id gives "".
    """
    if tokens is None:
        tokens = metadata.get("tokenizer.ggml.tokens", ())
    return (
        _token_text(metadata.get("tokenizer.ggml.bos_token_id"), tokens),
        _token_text(metadata.get("tokenizer.ggml.eos_token_id"), tokens),
    )


def _token_text(token_id: Any, tokens: Sequence[str]) -> str:
    # An id outside the vocabulary is the tokenizer's problem to report, not the template's.
    try:
        index = operator.index(token_id)  # ints, numpy integers
    except TypeError:
        return ""
    return str(tokens[index]) if 0 <= index < len(tokens) else ""


def _prepare_messages(messages: Any, name: str) -> list[dict]:
    if not isinstance(messages, (list, tuple)):
        raise TemplateError(f"{name}: messages must be a list of dicts, not {type(messages).__name__}")
    prepared = []
    for message in messages:
        if not isinstance(message, Mapping):
            raise TemplateError(f"{name}: each message must be a dict, got {message!r:.80}")
        # APIs send `"tool_calls": null` and the like; templates handle a missing key, not a None.
        message = {key: value for key, value in message.items() if value is not None}
        reasoning = next((message[key] for key in _REASONING_KEYS if key in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        prepared.append(message)
    return prepared


def _list_of_dicts(items: Any, what: str, name: str) -> list[Any] | None:
    if items is None:
        return None
    if not isinstance(items, (list, tuple)) or not all(isinstance(item, Mapping) for item in items):
        raise TemplateError(f"{name}: {what} must be a list of dicts")
    return list(items)


def _plain(value: Any) -> Any:
    """A copy of `value` built only from JSON-like types.

    The sandbox vets attribute access, but not the methods of arbitrary objects a caller might pass
    (some write files), so the template only ever sees plain types; anything else becomes an inert
    "<TypeName>" string. Subclasses of str/int/float are reduced to the base type for the same reason.
    """
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_plain(item) for item in value)
    return f"<{type(value).__name__}>"


# --- the sandbox --------------------------------------------------------------------------------


class _TemplateRaised(jinja2.TemplateError):
    """The template called `raise_exception(message)`: the conversation is not one it accepts."""


class _StrictSandbox(ImmutableSandboxedEnvironment):
    """jinja's immutable sandbox, except that reading an unsafe attribute fails at once.

    Plain jinja returns an undefined value there, which prints as "" and only fails when used further,
    so `{{ ''.__class__ }}` would render quietly. Mutating methods (`list.append`) keep jinja's lazy
    behaviour, so a template that only tests for them renders as it does under transformers; calling
    one still fails.
    """

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        if modifies_known_mutable(obj, attribute):
            return super().unsafe_undefined(obj, attribute)
        raise jinja2.exceptions.SecurityError(
            f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe"
        )


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks the assistant's own text for training masks.

    Rendering ignores the mark; the body still runs as a call block, as in transformers, so variables
    set inside it stay inside it.
    """

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """`namespace(...)` that refuses underscore names, which could shadow Python internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # `self` in *args, so `namespace(self=1)` works
        self, attributes = args[0], dict(*args[1:], **kwargs)
        for key in attributes:
            _check_namespace_key(key)
        jinja2.utils.Namespace.__init__(self, attributes)

    def __setitem__(self, key: str, value: Any) -> None:
        _check_namespace_key(key)
        super().__setitem__(key, value)


def _check_namespace_key(key: Any) -> None:
    if isinstance(key, str) and key.startswith("_"):
        raise jinja2.exceptions.SecurityError(f"a namespace cannot hold the underscore name {key!r}")


class _DictFactory:
    """The `dict` global: builds dicts, but is not the `dict` type, so it offers no way into it."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, keys: Any, value: Any = None) -> dict:
        return dict.fromkeys(keys, value)


def _raise_exception(message: Any) -> None:
    raise _TemplateRaised(str(message))


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: Any = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # jinja's own `tojson` HTML-escapes `<>&'` and always sorts keys; prompts need the text unchanged.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


_ENVIRONMENT: _StrictSandbox | None = None


def _environment() -> _StrictSandbox:
    global _ENVIRONMENT
    if _ENVIRONMENT is None:
        installed = tuple(int(part) for part in version("jinja2").split(".")[:3] if part.isdigit())
        if installed < _MIN_JINJA:
            raise TemplateError(
                f"jinja2 {version('jinja2')} has known sandbox escapes; chat templates need jinja2 >= 3.1.6"
            )
        environment = _StrictSandbox(
            trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
        )
        environment.filters["tojson"] = _tojson
        environment.globals.update(
            raise_exception=_raise_exception,
            strftime_now=_strftime_now,
            namespace=_Namespace,
            dict=_DictFactory(),
        )
        _ENVIRONMENT = environment
    return _ENVIRONMENT


# --- errors -------------------------------------------------------------------------------------


def _template_error(name: str, exc: BaseException) -> TemplateError:
    """One readable `TemplateError` for whatever went wrong inside the template."""
    line = exc.lineno if isinstance(exc, jinja2.TemplateSyntaxError) else _template_line(exc.__traceback__)
    where = f" at line {line}" if line else ""
    if isinstance(exc, jinja2.TemplateSyntaxError):
        what = f"syntax error{where}: {exc.message}"
    elif isinstance(exc, _TemplateRaised):
        what = f"raised an error{where}: {exc}"
    elif isinstance(exc, jinja2.exceptions.SecurityError):
        what = f"tried to reach outside its sandbox{where}: {exc}"
    elif isinstance(exc, jinja2.UndefinedError):
        what = f"used an undefined value{where}: {exc}"
    elif isinstance(exc, RecursionError):
        what = f"recursed too deeply{where}"
    else:
        what = f"failed to render{where}: {type(exc).__name__}: {exc}"
    return TemplateError(f"{name} {what}")


def _template_line(traceback: TracebackType | None) -> int | None:
    # jinja rewrites tracebacks so that template frames carry the template's own line numbers, under
    # the file name "<template>" for templates made from strings; the innermost one is where it failed.
    line = None
    while traceback is not None:
        if traceback.tb_frame.f_code.co_filename == "<template>":
            line = traceback.tb_lineno
        traceback = traceback.tb_next
    return line
