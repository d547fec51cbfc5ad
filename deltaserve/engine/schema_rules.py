"""Which JSON schemas structured output serves: fail-closed, never silently unconstrained.

xgrammar compiles some schemas into a grammar that does not enforce them: it ignores `not` and
`if`/`then`/`else`, treats an empty `type` list or a conflicting `allOf` as "any value", and an
external `$ref` as "any value". Such a schema is refused here, naming the keyword and where it is,
before anything compiles. Refused as well: schemas nested deeper than MAX_SCHEMA_DEPTH (compile time
grows steeply with depth: 128 levels take about a second) and contradictions that accept nothing
(`const`/`enum` outside the declared `type`, an empty `anyOf`). `oneOf` is served as `anyOf` (as
xgrammar does); unknown keywords are annotations, as JSON Schema says.
"""

from __future__ import annotations

from typing import Any

MAX_SCHEMA_DEPTH = 64  # JSON nesting levels of the whole schema document

UNSUPPORTED_KEYWORDS = (
    "not",
    "if",
    "then",
    "else",
    "$dynamicRef",
    "$dynamicAnchor",
    "$recursiveRef",
    "$recursiveAnchor",
)
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_SCHEMA_VALUES = (
    "items",
    "additionalProperties",
    "unevaluatedProperties",
    "unevaluatedItems",
    "propertyNames",
    "contains",
)


class SchemaRuleError(ValueError):
    """A schema structured output cannot enforce; the message names the keyword and its place."""


def json_depth(value: object) -> int:
    """Nesting depth of a JSON value (a scalar is 0), without recursion."""
    deepest = 0
    stack: list[tuple[object, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, depth + 1)
        stack.extend((child, depth + 1) for child in children)
    return deepest


def check_depth(schema: object, max_depth: int = MAX_SCHEMA_DEPTH) -> None:
    depth = json_depth(schema)
    if depth > max_depth:
        raise SchemaRuleError(f"the JSON schema nests {depth} levels deep; at most {max_depth} are supported")


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "integer" if value.is_integer() else "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def _declared_types(schema: dict[str, Any], where: str) -> list[str] | None:
    declared = schema.get("type")
    if declared is None:
        return None
    types = [declared] if isinstance(declared, str) else declared
    if not isinstance(types, list) or not types:
        raise SchemaRuleError(
            f"{where}: 'type' must be a type name or a non-empty list of them, got {declared!r}"
        )
    return types  # a name the compiler does not know, it refuses itself


def _allows(types: list[str], value: object) -> bool:
    kind = _json_type(value)
    return kind in types or (kind == "integer" and "number" in types)


def _check_one(schema: dict[str, Any], where: str) -> None:
    for keyword in UNSUPPORTED_KEYWORDS:
        if keyword in schema:
            raise SchemaRuleError(f"{where}: the keyword {keyword!r} is not supported by structured output")
    types = _declared_types(schema, where)
    ref = schema.get("$ref")
    if ref is not None and not (isinstance(ref, str) and (ref == "#" or ref.startswith("#/"))):
        raise SchemaRuleError(
            f"{where}: '$ref' {ref!r} is not supported: only references inside the schema ('#/...')"
        )
    all_of = schema.get("allOf")
    if isinstance(all_of, list) and len(all_of) > 1:
        raise SchemaRuleError(f"{where}: 'allOf' with more than one subschema is not supported")
    for keyword in ("anyOf", "oneOf"):
        if schema.get(keyword) == []:
            raise SchemaRuleError(f"{where}: {keyword!r} must not be empty (it would accept nothing)")
    if types is not None:
        if "const" in schema and not _allows(types, schema["const"]):
            raise SchemaRuleError(f"{where}: 'const' {schema['const']!r} is not of the declared type {types}")
        enum = schema.get("enum")
        if isinstance(enum, list) and enum and not any(_allows(types, v) for v in enum):
            raise SchemaRuleError(f"{where}: no 'enum' value is of the declared type {types}")


def _subschemas(schema: dict[str, Any], where: str) -> list[tuple[object, str]]:
    out: list[tuple[object, str]] = []
    for keyword in _SCHEMA_MAPS:
        children = schema.get(keyword)
        if isinstance(children, dict):
            out += [(child, f"{where}.{keyword}.{name}") for name, child in children.items()]
    for keyword in _SCHEMA_LISTS:
        children = schema.get(keyword)
        if isinstance(children, list):
            out += [(child, f"{where}.{keyword}[{i}]") for i, child in enumerate(children)]
    for keyword in _SCHEMA_VALUES:
        if keyword in schema:
            out.append((schema[keyword], f"{where}.{keyword}"))
    return out


def check_schema(schema: object) -> None:
    """Raises SchemaRuleError for a schema structured output would not enforce (see the module doc)."""
    check_depth(schema)
    if schema is False:
        raise SchemaRuleError("the schema `false` accepts nothing")
    stack: list[tuple[object, str]] = [(schema, "schema")]
    while stack:
        node, where = stack.pop()
        if isinstance(node, dict):
            _check_one(node, where)
            stack.extend(_subschemas(node, where))
