"""Tools' JSON schemas as grammar rules (Lark, llguidance's dialect), written in a family's own value syntax.

Neither family writes a tool call's arguments as JSON (Qwen puts each parameter between XML tags with string
values bare; Gemma has its own object syntax with `<|"|>` quotes), so a tool's schema cannot be handed to
llguidance's JSON compiler as it is. `SchemaGrammar` walks the schema and writes Lark rules through a
`ValueSyntax`, which says how the family writes strings, keys, objects and arrays; numbers, booleans and
null are JSON's in both families. Each family's parser types the values it reads back by the same reading
of the schema (`json_schema`), so what the grammar lets the model write is what the parser returns, and
that validates against the schema.

The subset (what real tool definitions use): `type` (one or a list), `enum`, `const`, `properties`,
`required`, `additionalProperties`, `items`, `prefixItems`, `minItems`, `maxItems`, `minLength`,
`maxLength`, `pattern`, `minimum`, `maximum`, `exclusiveMinimum`, `exclusiveMaximum`, `multipleOf`, `anyOf`,
`oneOf` whose branches cannot overlap (different types, or a property with different fixed values: a
discriminated union), `allOf` of one schema, and `$ref` within the schema (`$defs`, `definitions`;
recursive ones too). Annotations (`title`, `description`,
`default`, `examples`, `format`, ...) are ignored, as validators ignore them. Keywords that restrict values
in ways a grammar cannot enforce (`uniqueItems`, `not`, `if`, `patternProperties`, ...) raise
`SchemaNotSupported`, naming the tool and the keyword; with `lenient` they are ignored instead (and listed
in `SchemaGrammar.ignored`). Choices made for the model's sake: properties come in the schema's order, and
a tool's own arguments are only the declared ones (extra keys are valid, never needed).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from .errors import LuceboxError
from .json_schema import MAX_DEPTH, MISSING, admitted_types, member_schema, pointer, resolve, value_type

__all__ = [
    "JsonSyntax",
    "SchemaGrammar",
    "SchemaNotSupported",
    "StringShape",
    "ValueSyntax",
    "checked",
    "containing",
    "lark_string",
    "regex_item",
]

TYPES = ("string", "number", "integer", "boolean", "null", "object", "array")
ANNOTATIONS = frozenset({
    "title", "description", "default", "examples", "example", "$schema", "$id", "$comment", "$anchor",
    "deprecated", "readOnly", "writeOnly", "format", "contentMediaType", "contentEncoding", "contentSchema",
    "nullable", "discriminator", "strict", "$defs", "definitions",
})  # fmt: skip
UNSUPPORTED = {
    "not": "negation", "if": "conditionals", "then": "conditionals", "else": "conditionals",
    "patternProperties": "keys by pattern", "propertyNames": "key constraints",
    "dependentRequired": "dependencies", "dependentSchemas": "dependencies", "dependencies": "dependencies",
    "uniqueItems": "distinct items", "contains": "contained items", "minContains": "contained items",
    "maxContains": "contained items", "minProperties": "key counts", "maxProperties": "key counts",
    "unevaluatedProperties": "unevaluated keys", "unevaluatedItems": "unevaluated items",
    "additionalItems": "tuple arrays (use prefixItems)", "$dynamicRef": "dynamic references",
    "$recursiveRef": "dynamic references",
}  # fmt: skip
MAX_RULES = 20_000

# Numbers without bounds: at most 16 digits and a two-digit exponent, so no value overflows a double.
INTEGER_REGEX = r"/-?(0|[1-9][0-9]{0,15})/"
NUMBER_REGEX = r"/-?(0|[1-9][0-9]{0,15})(\.[0-9]{1,16})?([eE][+-]?[0-9]{1,2})?/"
RAW_JSON_CHAR = r'[^"\\\x00-\x1f]'  # a character JSON writes as it is
JSON_CHAR = r'(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u(?:[0-9a-cA-CefEF][0-9a-fA-F]{3}|[dD][0-7][0-9a-fA-F]{2}))'


class SchemaNotSupported(LuceboxError):
    """A tool's schema uses what a grammar cannot enforce, or is not a valid JSON schema."""


def lark_string(text: str) -> str:
    """`text` as a Lark string literal (UTF-8 as it is; quotes, backslashes and control characters escaped)."""
    out = []
    for char in text:
        if char in '"\\':
            out.append("\\" + char)
        elif char == "\n":
            out.append("\\n")
        elif char == "\t":
            out.append("\\t")
        elif char == "\r":
            out.append("\\r")
        elif ord(char) < 0x20 or ord(char) == 0x7F:
            out.append(f"\\u{ord(char):04x}")
        else:
            out.append(char)
    return '"' + "".join(out) + '"'


def regex_item(body: str) -> str:
    """A regex as a Lark `/.../` item: unescaped slashes escaped."""
    out, escaped = [], False
    for char in body:
        if char == "/" and not escaped:
            out.append("\\/")
        else:
            out.append(char)
        escaped = char == "\\" and not escaped
    return "/" + "".join(out) + "/"


def regex_escape(text: str) -> str:
    """`text` as a regex matching it literally (Rust syntax: only meta characters escaped, control characters
    by code point)."""
    out = []
    for char in text:
        if char in "\\.+*?()|[]{}^$":
            out.append("\\" + char)
        elif ord(char) < 0x20 or ord(char) == 0x7F:
            out.append(f"\\x{{{ord(char):X}}}")
        else:
            out.append(char)
    return "".join(out)


def containing(text: str) -> str:
    """A Lark regex item for any text containing `text`."""
    return regex_item("(?s:.*)" + regex_escape(text) + "(?s:.*)")


@attrs.frozen
class StringShape:
    """What a string value must be: its length in characters, and a regex the whole of it matches."""

    min_length: int = 0
    max_length: int | None = None
    pattern: str | None = None  # Rust regex syntax, anchors already resolved

    def length(self) -> str:
        return f"{{{self.min_length},{'' if self.max_length is None else self.max_length}}}"


def pattern_regex(pattern: str) -> str:
    """A JSON schema `pattern` (matched anywhere in the string, as validators search for it) as a regex the
    whole string must match: free text on each side the pattern does not anchor."""
    head = tail = "(?s:.*)"
    if pattern.startswith("^"):
        pattern, head = pattern[1:], ""
    if pattern.endswith("$") and (len(pattern) - 1 - len(pattern[:-1].rstrip("\\"))) % 2 == 0:
        pattern, tail = pattern[:-1], ""
    return f"{head}(?:{pattern}){tail}"


class ValueSyntax:
    """How a family writes a value (the defaults: JSON, as `json.dumps` spaces it).

    `forbidden` is text no string of the family may contain: its own delimiters, which its parser would
    take for the end of the value. Methods return Lark expressions; `grammar` makes the rules they need.
    """

    forbidden: tuple[str, ...] = ()
    object_open, object_close = '"{"', '"}"'
    array_open, array_close = '"["', '"]"'
    member_separator = item_separator = '", "'

    def key(self, name: str) -> str | None:
        """A member's key and what comes between it and the value; None when this syntax cannot write it."""
        if any(f in json.dumps(name, ensure_ascii=False) for f in self.forbidden):
            return None
        return lark_string(json.dumps(name, ensure_ascii=False) + ": ")

    def any_key(self, grammar: SchemaGrammar) -> str:
        return grammar.terminal(f'{self.string_terminal(StringShape())} ": "', "any_key")

    def string(self, grammar: SchemaGrammar, shape: StringShape) -> str:
        return grammar.terminal(self.string_terminal(shape), ("string", shape))

    def string_terminal(self, shape: StringShape) -> str:
        body = regex_item(f"{JSON_CHAR}{shape.length()}")
        if shape.pattern is not None:  # patterned strings keep to characters JSON writes as they are
            body = f"{regex_item(shape.pattern)} & {regex_item(RAW_JSON_CHAR + shape.length())}"
        for text in self.forbidden:
            body = f"({body}) & ~{containing(text)}"
        return f'"\\"" ({body}) "\\""'

    def string_literal(self, text: str) -> str | None:
        written = json.dumps(text, ensure_ascii=False)
        return None if any(f in written for f in self.forbidden) else lark_string(written)

    def render(self, value: Any) -> str | None:
        """The exact text of `value` in this syntax (enum and const values), None when it cannot be written."""
        written = json.dumps(value, ensure_ascii=False)
        return None if any(f in written for f in self.forbidden) else written


class JsonSyntax(ValueSyntax):
    """JSON, with `forbidden` text kept out of strings (Qwen: a parameter's closing tag)."""

    def __init__(self, forbidden: Sequence[str] = ()) -> None:
        self.forbidden = tuple(forbidden)


# -- the walker ------------------------------------------------------------------------------------------


@attrs.frozen
class Member:
    """A key an object's grammar writes: its schema, and whether it must be there."""

    name: str
    schema: Any
    required: bool
    where: str


class SchemaGrammar:
    """Lark rules for the values of one tool's schemas (see the module docstring).

    `value(schema, where)` is the Lark expression of a value under `schema` (None: no value can satisfy it);
    the rules it needs collect in `rules`. `tool` and `where` (the path inside the tool's parameters) name
    what an error is about.
    """

    def __init__(self, syntax: ValueSyntax, *, tool: str, root: Any, lenient: bool = False, prefix: str = "s") -> None:
        self.syntax, self.tool, self.root, self.lenient = syntax, tool, root, lenient
        self.rules: list[str] = []
        self.ignored: list[str] = []  # "where: keyword" of what lenient mode did not enforce
        self._prefix = prefix
        self._count = 0
        self._named: dict[Any, str] = {}
        self._refs: dict[str, str] = {}
        self._depth = 0

    # -- errors --

    def fail(self, where: str, message: str) -> SchemaNotSupported:
        return SchemaNotSupported(f"tool {self.tool!r}, {where}: {message}")

    def unsupported(self, where: str, keyword: str, why: str) -> None:
        if self.lenient:
            self.ignored.append(f"{where}: {keyword}")
            return
        raise self.fail(where, f"{keyword!r} is not supported ({why} cannot be enforced by a grammar); "
                               "leave it out, or use tool_choice 'auto'")

    # -- rules --

    def rule(self, body: str) -> str:
        if len(self.rules) >= MAX_RULES:
            raise SchemaNotSupported(f"tool {self.tool!r}: the schema is too large to enforce")
        self._count += 1
        name = f"{self._prefix}_{self._count}"
        self.rules.append(f"{name}: {body}")
        return name

    def terminal(self, body: str, key: Any = None) -> str:
        """A named terminal (a lexeme: what a regex can match), made once per `key`."""
        if key is not None and key in self._named:
            return self._named[key]
        self._count += 1
        name = f"{self._prefix.upper()}_{self._count}"
        self.rules.append(f"{name}: {body}")
        if key is not None:
            self._named[key] = name
        return name

    def sequence(self, parts: Sequence[tuple[str, bool]], separator: str) -> str:
        """Parts in order, each there or (when not required) not, with `separator` between those there ("":
        none of them need be there, or there are none)."""
        sep = f"{separator} " if separator else ""
        after = ""  # the parts from here on, once one has been written (each behind a separator)
        first, nullable = "", True  # the parts from here on, none written yet; whether none may be written
        for expr, required in reversed(parts):
            after = self._short(after)  # long chains become rules, so no expression grows with the key count
            opening = f"{expr} {after}".strip()
            if required:
                after = f"{sep}{opening}"
                first, nullable = opening, False
            else:
                after = f"({sep}{expr})? {after}".strip()
                first = f"({opening} | {self._short(first)})" if first else f"({opening})"
        return f"{first}?" if first and nullable else first

    def _short(self, expr: str) -> str:
        return self.rule(expr) if len(expr) > 160 else expr

    # -- values --

    def value(self, schema: Any, where: str) -> str | None:
        if self._depth > MAX_DEPTH:
            raise self.fail(where, f"the schema is nested deeper than {MAX_DEPTH} levels")
        self._depth += 1
        try:
            return self._value(schema, where)
        finally:
            self._depth -= 1

    def _value(self, schema: Any, where: str) -> str | None:
        if schema is True:
            return self.any_value()
        if schema is False:
            return None
        if not isinstance(schema, Mapping):
            raise self.fail(where, f"a schema must be an object or a boolean, not {type(schema).__name__}")
        for keyword in schema:
            if keyword in UNSUPPORTED and not (keyword == "uniqueItems" and schema[keyword] is False) \
                    and not (keyword in ("minProperties", "minContains") and schema[keyword] == 0):
                self.unsupported(where, keyword, UNSUPPORTED[keyword])
        constraints = {k: v for k, v in schema.items() if k not in ANNOTATIONS and k not in UNSUPPORTED
                       and not k.startswith("x-")}
        if "$ref" in constraints:
            return self._reference(constraints, where)
        if "allOf" in constraints:
            return self._all_of(constraints, where)
        for keyword in ("anyOf", "oneOf"):
            if keyword in constraints:
                return self._any_of(constraints, keyword, where)
        if "enum" in constraints or "const" in constraints:
            return self._choices(constraints, where)
        types = self._types(constraints, where)
        parts = [p for p in (self._typed(t, constraints, where) for t in types) if p is not None]
        if not parts:
            return None
        return parts[0] if len(parts) == 1 else "(" + " | ".join(parts) + ")"

    def _types(self, schema: Mapping[str, Any], where: str) -> list[str]:
        declared = schema.get("type", list(TYPES))
        names = [declared] if isinstance(declared, str) else declared
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise self.fail(f"{where}.type", "must be a type name or a list of them")
        unknown = [n for n in names if n not in TYPES]
        if unknown:
            raise self.fail(f"{where}.type", f"{unknown[0]!r} is not a JSON type ({', '.join(TYPES)})")
        if "number" in names:  # integers are numbers: one rule covers both
            names = [n for n in names if n != "integer"]
        return list(dict.fromkeys(names))

    def _reference(self, schema: Mapping[str, Any], where: str) -> str | None:
        ref = schema["$ref"]
        if not isinstance(ref, str):
            raise self.fail(f"{where}.$ref", "must be a string")
        if len(schema) > 1:
            self.unsupported(where, "$ref", "other constraints beside a reference")
        if ref in self._refs:
            return self._refs[ref]
        target = pointer(self.root, ref)
        if target is MISSING:
            if not ref.startswith("#"):
                raise self.fail(where, f"$ref {ref!r} is not supported (only references within the schema are)")
            raise self.fail(where, f"$ref {ref!r} names nothing in the schema")
        self._count += 1
        name = f"{self._prefix}_ref_{self._count}"
        self._refs[ref] = name
        expr = self.value(target, ref)
        if expr is None:
            raise self.fail(where, f"no value can satisfy {ref!r}")
        self.rules.append(f"{name}: {expr}")
        return name

    def _all_of(self, schema: Mapping[str, Any], where: str) -> str | None:
        parts = schema["allOf"]
        if not isinstance(parts, list) or not parts:
            raise self.fail(f"{where}.allOf", "must be a non-empty list of schemas")
        if len(parts) > 1 or len(schema) > 1:
            self.unsupported(where, "allOf", "an intersection of several schemas")
        return self.value(parts[0], f"{where}.allOf[0]")

    def _any_of(self, schema: Mapping[str, Any], keyword: str, where: str) -> str | None:
        branches = schema[keyword]
        if not isinstance(branches, list) or not branches:
            raise self.fail(f"{where}.{keyword}", "must be a non-empty list of schemas")
        shared = {k: v for k, v in schema.items() if k != keyword}
        if keyword == "oneOf" and not self._exclusive(branches):
            self.unsupported(where, "oneOf", "exactly one of branches that may overlap")
        options = []
        for index, branch in enumerate(branches):
            if shared:  # keywords beside the branches hold in each of them
                if not isinstance(branch, Mapping) or set(branch) & set(shared):
                    self.unsupported(where, keyword, "branches that restate the keywords beside them")
                    branch = branch if isinstance(branch, Mapping) else {}
                branch = {**shared, **branch}
            expr = self.value(branch, f"{where}.{keyword}[{index}]")
            if expr is not None and expr not in options:
                options.append(expr)
        if not options:
            return None
        return options[0] if len(options) == 1 else "(" + " | ".join(options) + ")"

    def _exclusive(self, branches: list[Any]) -> bool:
        """Whether no value can fit two of `branches`: their types differ, or a property both require has
        different fixed values in each (a discriminated union)."""
        def fixed(schema: Any, key: str) -> set[str] | None:
            member = resolve(member_schema(schema, key, self.root), self.root)
            if not isinstance(member, Mapping):
                return None
            values = [member["const"]] if "const" in member else member.get("enum")
            return {json.dumps(v, sort_keys=True) for v in values} if isinstance(values, list) else None

        def required(schema: Any) -> set[str]:
            keys = resolved.get("required") if isinstance(resolved := resolve(schema, self.root), Mapping) else None
            return {k for k in keys if isinstance(k, str)} if isinstance(keys, list) else set()

        for i, first in enumerate(branches):
            for second in branches[i + 1 :]:
                a, b = admitted_types(first, self.root), admitted_types(second, self.root)
                if a is not None and b is not None and not (a & b):
                    continue
                told_apart = False
                for key in required(first) & required(second):
                    f, g = fixed(first, key), fixed(second, key)
                    told_apart = told_apart or (f is not None and g is not None and not (f & g))
                if not told_apart:
                    return False
        return True

    def _choices(self, schema: Mapping[str, Any], where: str) -> str | None:
        if "const" in schema:
            values = [schema["const"]]
            if "enum" in schema and values[0] not in (schema["enum"] if isinstance(schema["enum"], list) else []):
                return None
        else:
            values = schema["enum"]
            if not isinstance(values, list):
                raise self.fail(f"{where}.enum", "must be a list")
        rest = {k: v for k, v in schema.items() if k not in ("enum", "const")}
        written = []
        for value in values:
            if not self._fits(value, rest, where):
                continue
            literal = self.literal(value)
            if literal is not None and literal not in written:
                written.append(literal)
        if not written:
            return None
        return written[0] if len(written) == 1 else "(" + " | ".join(written) + ")"

    def literal(self, value: Any) -> str | None:
        """One exact value, as the syntax writes it."""
        if isinstance(value, str):
            return self.syntax.string_literal(value)
        text = self.syntax.render(value)
        return None if text is None else lark_string(text)

    def _fits(self, value: Any, schema: Mapping[str, Any], where: str) -> bool:
        """Whether an enum or const value meets the keywords beside it (types, lengths, bounds, pattern)."""
        kind = value_type(value)
        if "type" in schema:
            types = self._types(schema, where)
            if kind not in types and not (kind == "integer" and "number" in types) \
                    and not (kind == "number" and "integer" in types and float(value).is_integer()):
                return False
        if kind == "string":
            shape = self._string_shape(schema, where)
            if shape is None or len(value) < shape.min_length or (shape.max_length is not None and len(value) > shape.max_length):
                return False
            pattern = schema.get("pattern")
            try:
                return not isinstance(pattern, str) or re.search(pattern, value) is not None
            except re.error:
                return True
        if kind in ("integer", "number"):
            low, high = self._bounds(schema, where)
            return (low is None or value > low[0] or (value == low[0] and not low[1])) and \
                   (high is None or value < high[0] or (value == high[0] and not high[1]))
        return True

    def _typed(self, kind: str, schema: Mapping[str, Any], where: str) -> str | None:
        if kind == "string":
            shape = self._string_shape(schema, where)
            return None if shape is None else self.syntax.string(self, shape)
        if kind in ("integer", "number"):
            return self._number(kind, schema, where)
        if kind == "boolean":
            return '("true" | "false")'
        if kind == "null":
            return '"null"'
        if kind == "object":
            return self._object(schema, where)
        return self._array(schema, where)

    def _count_keyword(self, schema: Mapping[str, Any], keyword: str, where: str) -> int | None:
        value = schema.get(keyword)
        if value is None:
            return None
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise self.fail(f"{where}.{keyword}", "must be a non-negative integer")
        return value

    def _string_shape(self, schema: Mapping[str, Any], where: str) -> StringShape | None:
        low = self._count_keyword(schema, "minLength", where) or 0
        high = self._count_keyword(schema, "maxLength", where)
        if high is not None and high < low:
            return None
        pattern = schema.get("pattern")
        if pattern is None:
            return StringShape(low, high)
        if not isinstance(pattern, str):
            raise self.fail(f"{where}.pattern", "must be a string")
        regex = pattern_regex(pattern)
        from llguidance import LLMatcher

        problem = LLMatcher.validate_grammar(LLMatcher.grammar_from_lark(f"start: T\nT: {regex_item(regex)}"))
        if problem:
            raise self.fail(f"{where}.pattern", f"{pattern!r} cannot be enforced: {problem.splitlines()[0]}")
        return StringShape(low, high, regex)

    def _number_keyword(self, schema: Mapping[str, Any], keyword: str, where: str) -> Any:
        value = schema.get(keyword)
        if value is None or (isinstance(value, bool) and keyword.startswith("exclusive")):
            return value  # draft 4 wrote exclusiveMinimum: true to make minimum strict
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise self.fail(f"{where}.{keyword}", "must be a number")
        return value

    def _bounds(self, schema: Mapping[str, Any], where: str) -> tuple[tuple[Any, bool] | None, tuple[Any, bool] | None]:
        """(value, strict) of the tightest lower and upper bound, from either draft's way of writing them."""
        found: list[tuple[Any, bool] | None] = []
        for inclusive, exclusive in (("minimum", "exclusiveMinimum"), ("maximum", "exclusiveMaximum")):
            bound = self._number_keyword(schema, inclusive, where)
            strict = self._number_keyword(schema, exclusive, where)
            limits = []
            if bound is not None:
                limits.append((bound, strict is True))
            if strict is not None and not isinstance(strict, bool):
                limits.append((strict, True))
            if not limits:
                found.append(None)
            elif inclusive == "minimum":  # the largest lower bound; a strict one wins a tie
                found.append(max(limits, key=lambda b: (b[0], b[1])))
            else:
                found.append(min(limits, key=lambda b: (b[0], not b[1])))
        return found[0], found[1]

    def _number(self, kind: str, schema: Mapping[str, Any], where: str) -> str | None:
        low, high = self._bounds(schema, where)
        step = schema.get("multipleOf")
        if step is not None and (isinstance(step, bool) or not isinstance(step, (int, float)) or step <= 0):
            raise self.fail(f"{where}.multipleOf", "must be a positive number")
        if low is None and high is None and step is None:
            return self.terminal(INTEGER_REGEX if kind == "integer" else NUMBER_REGEX, kind)
        if low is not None and high is not None and (low[0] > high[0] or (low[0] == high[0] and (low[1] or high[1]))):
            return None
        leaf: dict[str, Any] = {"type": kind}
        if low is not None:
            leaf["exclusiveMinimum" if low[1] else "minimum"] = low[0]
        if high is not None:
            leaf["exclusiveMaximum" if high[1] else "maximum"] = high[0]
        if step is not None:
            leaf["multipleOf"] = step
        from llguidance import LLMatcher

        problem = LLMatcher.validate_grammar(LLMatcher.grammar_from_json_schema(json.dumps(leaf)))
        if problem:
            keywords = ", ".join(k for k in leaf if k != "type")
            raise self.fail(where, f"{keywords} cannot be enforced: {problem.splitlines()[0]}")
        leaf["x-guidance"] = {"whitespace_flexible": False}
        return f"%json {json.dumps(leaf)}"

    def members(self, schema: Mapping[str, Any], where: str, *, declared_only: bool) -> tuple[list[Member], Any]:
        """The keys an object's grammar writes, in order, and the schema of other keys (False: none).

        `declared_only`: write no keys but the declared and required ones even where others are allowed
        (a tool's own arguments).
        """
        properties = schema.get("properties", {})
        if not isinstance(properties, Mapping):
            raise self.fail(f"{where}.properties", "must be an object of schemas")
        required = schema.get("required", [])
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise self.fail(f"{where}.required", "must be a list of property names")
        extra = schema.get("additionalProperties", True)
        if not isinstance(extra, (bool, Mapping)):
            raise self.fail(f"{where}.additionalProperties", "must be a boolean or a schema")
        members = [Member(str(name), sub, name in required, f"{where}.properties.{name}")
                   for name, sub in properties.items()]
        for name in dict.fromkeys(required):
            if name not in properties:
                if extra is False:
                    raise self.fail(where, f"{name!r} is required but not allowed (additionalProperties is false)")
                members.append(Member(name, extra, True, f"{where}.additionalProperties"))
        return members, (False if declared_only or properties else extra)

    def object_body(self, members: list[Member], where: str) -> str | None:
        """The members of an object between its braces (syntax keys and separators); None when unsatisfiable."""
        parts = []
        for member in members:
            key = self.syntax.key(member.name)
            expr = self.value(member.schema, member.where) if key is not None else None
            if expr is None:
                if member.required:
                    reason = "cannot be written" if key is None else "cannot be satisfied"
                    raise self.fail(member.where, f"the required key {member.name!r} {reason}")
                continue
            parts.append((f"{key} {expr}", member.required))
        return self.sequence(parts, self.syntax.member_separator)

    def _object(self, schema: Mapping[str, Any], where: str, *, declared_only: bool = False) -> str | None:
        members, extra = self.members(schema, where, declared_only=declared_only)
        syntax = self.syntax
        if not members and extra is not False:  # a free-form object: any keys, values under `extra`
            value = self.value(extra, f"{where}.additionalProperties")
            if value is None:
                return f"{syntax.object_open} {syntax.object_close}"
            pair = self.rule(f"{syntax.any_key(self)} {value}")
            return self.rule(f"{syntax.object_open} ({pair} ({syntax.member_separator} {pair})*)? {syntax.object_close}")
        body = self.object_body(members, where)
        return self.rule(f"{syntax.object_open} {body} {syntax.object_close}".replace("  ", " "))

    def tool_object(self, schema: Any, where: str = "parameters") -> str:
        """A tool's arguments as an object in this syntax: the declared keys only."""
        schema = self._tool_schema(schema, where)
        expr = self._object(schema, where, declared_only=True)
        if expr is None:
            raise self.fail(where, "no arguments can satisfy the schema")
        return expr

    def _tool_schema(self, schema: Any, where: str) -> Mapping[str, Any]:
        """A tool's parameters schema, checked to describe an object (its references followed)."""
        resolved = resolve(schema, self.root)
        if resolved is True or resolved == {}:
            return {}
        if not isinstance(resolved, Mapping):
            raise self.fail(where, "must be a JSON schema object describing the arguments")
        for keyword in resolved:
            if keyword in UNSUPPORTED:
                self.unsupported(where, keyword, UNSUPPORTED[keyword])
        types = resolved.get("type", "object")
        if types != "object" and not (isinstance(types, list) and "object" in types):
            raise self.fail(f"{where}.type", f"a tool's arguments are an object, not {types!r}")
        if any(k in resolved for k in ("anyOf", "oneOf", "allOf", "enum", "const")):
            self.unsupported(where, next(k for k in ("anyOf", "oneOf", "allOf", "enum", "const") if k in resolved),
                             "alternatives for the whole of a tool's arguments")
        return resolved

    def tool_members(self, schema: Any, where: str = "parameters") -> list[Member]:
        """A tool's arguments as keys (families that write each argument on its own, as Qwen's XML does)."""
        members, _ = self.members(self._tool_schema(schema, where), where, declared_only=True)
        return members

    def _array(self, schema: Mapping[str, Any], where: str) -> str | None:
        syntax = self.syntax
        low = self._count_keyword(schema, "minItems", where) or 0
        high = self._count_keyword(schema, "maxItems", where)
        if high is not None and high < low:
            return None
        items = schema.get("items", True)
        prefix = schema.get("prefixItems", [])
        if isinstance(items, list):
            self.unsupported(where, "items", "a list of item schemas (use prefixItems)")
            items = True
        if not isinstance(items, (bool, Mapping)) or not isinstance(prefix, list):
            raise self.fail(where, "items must be a schema and prefixItems a list of schemas")
        rest = self.value(items, f"{where}.items")
        fixed = []
        for index, sub in enumerate(prefix):
            expr = self.value(sub, f"{where}.prefixItems[{index}]")
            if expr is None:  # no item can be here: the array ends before it
                rest = None
                break
            fixed.append(expr)
        sep, options = syntax.item_separator, []
        for length in range(low, min(len(fixed), high if high is not None else len(fixed)) + 1):
            options.append(f" {sep} ".join(fixed[:length]))
        if rest is not None and len(fixed) == len(prefix) and (high is None or high > len(fixed)):
            more_low = max(low - len(fixed), 1)  # items past the fixed ones
            more_high = None if high is None else high - len(fixed)
            if fixed:
                options.append(f" {sep} ".join(fixed) + f" ({sep} {rest}){{{more_low},{_bound(more_high)}}}")
            elif more_high == 1:
                options.append(rest)
            else:
                options.append(f"{rest} ({sep} {rest}){{{more_low - 1},{_bound(more_high, -1)}}}")
        written = [o for o in options if o]
        if not options:
            return None
        inner = ""
        if written:
            inner = "(" + " | ".join(f"({o})" for o in written) + ")" + ("?" if "" in options else "")
        return self.rule(f"{syntax.array_open} {inner} {syntax.array_close}".replace("  ", " "))

    def any_value(self) -> str:
        """Any value at all, in this syntax."""
        if "any" in self._named:
            return self._named["any"]
        syntax = self.syntax
        self._named["any"] = value = f"{self._prefix}_any"
        string = syntax.string(self, StringShape())
        number = self.terminal(NUMBER_REGEX, "number")
        key = syntax.any_key(self)
        self.rules += [
            f'{value}: {string} | {number} | "true" | "false" | "null" | {value}_object | {value}_array',
            f"{value}_object: {syntax.object_open} ({key} {value} ({syntax.member_separator} {key} {value})*)? "
            f"{syntax.object_close}",
            f"{value}_array: {syntax.array_open} ({value} ({syntax.item_separator} {value})*)? {syntax.array_close}",
        ]
        return value


def _bound(count: int | None, offset: int = 0) -> str:
    return "" if count is None else str(count + offset)


def checked(build: Callable[[], str]) -> str:
    """Run a grammar builder, turning a Python recursion overflow on a hostile schema into a clear error."""
    try:
        return build()
    except RecursionError:
        raise SchemaNotSupported("a tool's schema is nested too deeply to enforce") from None
