"""Reading a tool's JSON schema the way its grammar and its family's parser both must: local references
followed, the types a value may have, the schema of an object's member or an array's item.

A family's parser types each value it reads by these (`admitted_types` of the schema `member_schema` gives
for the key), and its grammar (`schema_grammar`) decides how to write each value by the same answers, so
the two agree on every value.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Mapping
from typing import Any
from urllib.parse import unquote

__all__ = ["MAX_DEPTH", "admitted_types", "coerce_value", "is_text_parameter", "item_schema", "member_schema",
           "pointer", "resolve", "value_type"]

MAX_DEPTH = 32  # how far references and nesting are followed

MISSING = object()  # what `pointer` gives for a reference to nothing


def pointer(root: Any, ref: str) -> Any:
    """The schema a local `$ref` ("#", "#/$defs/Name", any JSON pointer) names, else `MISSING`."""
    if not ref.startswith("#"):
        return MISSING
    node = root
    for part in unquote(ref[1:]).split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, Mapping) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return MISSING
    return node


def resolve(schema: Any, root: Any) -> Any:
    """`schema` with local `$ref`s and an `allOf` of one schema followed to the schema that describes the value."""
    for _ in range(MAX_DEPTH):
        if not isinstance(schema, Mapping):
            return schema
        ref = schema.get("$ref")
        all_of = schema.get("allOf")
        if isinstance(ref, str):
            schema = pointer(root, ref)
            if schema is MISSING:
                return None
        elif isinstance(all_of, list) and len(all_of) == 1:
            schema = all_of[0]
        else:
            return schema
    return None


def value_type(value: Any) -> str:
    """The JSON type of a Python value read from JSON."""
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if value is None:
        return "null"
    return "array" if isinstance(value, list) else "object"


def admitted_types(schema: Any, root: Any = None, _depth: int = 0) -> frozenset[str] | None:
    """The JSON types a value under `schema` may have; None when any type may do. "number" covers integers."""
    schema = resolve(schema, root)
    if schema is False:
        return frozenset()
    if not isinstance(schema, Mapping) or _depth > MAX_DEPTH:
        return None
    admitted: frozenset[str] | None = None
    if "const" in schema:
        admitted = frozenset({value_type(schema["const"])})
    elif isinstance(schema.get("enum"), list):
        admitted = frozenset(value_type(v) for v in schema["enum"])
    declared = schema.get("type")
    if isinstance(declared, str) or isinstance(declared, list):
        names = frozenset(t for t in ([declared] if isinstance(declared, str) else declared) if isinstance(t, str))
        if "number" in names:
            names |= {"integer"}
        admitted = names if admitted is None else admitted & (names | ({"number"} if "integer" in names else set()))
    branches = schema.get("anyOf") if isinstance(schema.get("anyOf"), list) else schema.get("oneOf")
    if isinstance(branches, list) and branches:
        union: set[str] = set()
        for branch in branches:
            types = admitted_types(branch, root, _depth + 1)
            if types is None:
                return admitted
            union |= types
        admitted = frozenset(union) if admitted is None else admitted & union
    return admitted


def member_schema(schema: Any, key: str, root: Any = None, _depth: int = 0) -> Any:
    """The schema of member `key` of an object under `schema` (None: not known, so any value)."""
    schema = resolve(schema, root)
    if not isinstance(schema, Mapping) or _depth > MAX_DEPTH:
        return None
    properties = schema.get("properties")
    if isinstance(properties, Mapping) and key in properties:
        return properties[key]
    branches = schema.get("anyOf") if isinstance(schema.get("anyOf"), list) else schema.get("oneOf")
    if isinstance(branches, list):
        found = [s for s in (member_schema(b, key, root, _depth + 1) for b in branches) if s is not None]
        if found and all(s == found[0] for s in found):
            return found[0]
        return None
    extra = schema.get("additionalProperties")
    return extra if isinstance(extra, Mapping) else None


def item_schema(schema: Any, index: int, root: Any = None, _depth: int = 0) -> Any:
    """The schema of item `index` of an array under `schema` (None: not known)."""
    schema = resolve(schema, root)
    if not isinstance(schema, Mapping) or _depth > MAX_DEPTH:
        return None
    prefix = schema.get("prefixItems")
    if isinstance(prefix, list) and index < len(prefix):
        return prefix[index]
    branches = schema.get("anyOf") if isinstance(schema.get("anyOf"), list) else schema.get("oneOf")
    if isinstance(branches, list):
        found = [s for s in (item_schema(b, index, root, _depth + 1) for b in branches) if s is not None]
        return found[0] if found and all(s == found[0] for s in found) else None
    items = schema.get("items")
    return items if isinstance(items, Mapping) else None


# -- values written as text or JSON (Qwen's and Laguna's tool-call parameters) ---------------------------


def is_text_parameter(schema: Any, root: Any = None) -> bool:
    """Whether a parameter's value is written as bare text (its schema admits strings only) rather than JSON."""
    return schema is None or admitted_types(schema, root) == {"string"}


def coerce_value(text: str, schema: Mapping[str, Any] | None, root: Any = None) -> Any:
    """A parameter's text as the value its schema asks for; text that does not parse stays a string.

    `root`: the tool's whole parameters schema, which `$ref`s in `schema` point into.
    """
    if is_text_parameter(schema, root):
        return text
    types = admitted_types(schema, root)
    stripped = text.strip()
    if types is not None and "null" in types and stripped in ("null", "None"):
        return None
    if types is not None and "boolean" in types and stripped.lower() in ("true", "false"):
        return stripped.lower() == "true"  # the template renders Python's True/False
    try:
        value = json.loads(stripped)
    except ValueError:
        value = text
        if types is not None and types & {"object", "array"}:  # a Python literal ({'a': 1}) is a common slip
            try:
                value = ast.literal_eval(stripped)
            except (ValueError, SyntaxError, MemoryError, RecursionError, TypeError):
                value = text
            if not isinstance(value, (dict, list)):  # a set, a tuple, bytes...: not JSON, so the text
                value = text
    if types is None:
        return value
    if "integer" in types and "number" not in types and isinstance(value, float) and value.is_integer():
        value = int(value)
    kind = value_type(value)
    if "string" in types and kind not in types and not (kind == "integer" and "number" in types):
        return text  # not one of the other types it may be: the text it was
    return value
