"""The pure request guards: schema rules, lone surrogates, fan-out and queue admission, hang policy."""

from __future__ import annotations

import json
from typing import Any

import pytest

from deltaserve.engine.liveness import HangLimits, hang_reason
from deltaserve.engine.protocol import Heartbeat, LoadSnapshot
from deltaserve.engine.schema_rules import SchemaRuleError, check_schema, json_depth
from deltaserve.server.admission import Admission
from deltaserve.server.errors import APIError
from deltaserve.server.text_checks import format_path, lone_surrogate_path

ENFORCED = [
    {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0}}, "required": ["a"]},
    {"$defs": {"n": {"type": "number"}}, "type": "array", "items": {"$ref": "#/$defs/n"}},
    {"anyOf": [{"type": "string", "pattern": "^a+$"}, {"type": "null"}]},
    {"oneOf": [{"const": 1}, {"const": "one"}]},
    {"allOf": [{"$ref": "#"}]},
    {"type": ["integer", "string"], "enum": [1, "a"], "title": "t", "x-vendor": True},
    {"type": "integer", "const": 2.0},
    True,
]


@pytest.mark.parametrize("schema", ENFORCED)
def test_schemas_xgrammar_enforces_pass(schema: Any) -> None:
    check_schema(schema)


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        ({"not": {}}, "schema: the keyword 'not' is not supported"),
        ({"if": {}, "then": {}}, "schema: the keyword 'if' is not supported"),
        ({"type": []}, "schema: 'type' must be a type name or a non-empty list of them, got []"),
        (
            {"allOf": [{"type": "string"}, {"type": "integer"}]},
            "schema: 'allOf' with more than one subschema",
        ),
        ({"$ref": "other.json#/a"}, "schema: '$ref' 'other.json#/a' is not supported"),
        ({"anyOf": []}, "schema: 'anyOf' must not be empty"),
        ({"type": "integer", "const": "x"}, "schema: 'const' 'x' is not of the declared type ['integer']"),
        ({"type": "string", "enum": [1, 2]}, "schema: no 'enum' value is of the declared type ['string']"),
        ({"items": {"properties": {"b": {"not": {}}}}}, "schema.items.properties.b: the keyword 'not'"),
        ({"$defs": {"d": {"else": {}}}}, "schema.$defs.d: the keyword 'else'"),
        (False, "the schema `false` accepts nothing"),
    ],
)
def test_schemas_that_would_not_be_enforced_are_refused_by_keyword_and_place(
    schema: Any, message: str
) -> None:
    with pytest.raises(SchemaRuleError) as raised:
        check_schema(schema)
    assert str(raised.value).startswith(message)


def test_schema_depth_is_measured_without_recursion_and_limited() -> None:
    deep: Any = {}
    for _ in range(100_000):
        deep = {"items": deep}
    assert json_depth(deep) == 100_001
    assert json_depth({"a": [1, {"b": 2}]}) == 3 and json_depth(5) == 0
    with pytest.raises(SchemaRuleError, match="nests 100001 levels deep; at most 64"):
        check_schema(deep)


def test_numbers_are_passed_over_and_text_among_them_is_still_found() -> None:
    assert lone_surrogate_path({"prompt": list(range(4096)), "max_tokens": 1}) is None
    assert lone_surrogate_path({"prompt": [1, 2.5, True, None, "x\udfff"]}) == ["prompt", 4]
    assert lone_surrogate_path({"prompt": [[1, 2], [3, ["\ud800"]]]}) == ["prompt", 1, 1, 0]
    assert lone_surrogate_path({"logit_bias": {"5": 1.0, "6": {"x": "\ud800"}}}) == ["logit_bias", "6", "x"]


def test_lone_surrogates_are_found_anywhere_and_pairs_are_text() -> None:
    escaped_pair = json.loads('"\\ud83d\\ude00"')  # JSON's escaped pair decodes to one code point
    assert lone_surrogate_path({"messages": [{"content": "fine 😀"}], "stop": [escaped_pair]}) is None
    assert lone_surrogate_path({"messages": [{"content": "ok"}, {"content": "x\udfff"}]}) == [
        "messages",
        1,
        "content",
    ]
    assert lone_surrogate_path({"tools": [{"function": {"name": "\ud800"}}]}) == [
        "tools",
        0,
        "function",
        "name",
    ]
    assert lone_surrogate_path({"logit_bias": {"\ud800": 1}}) == ["logit_bias"]
    assert format_path(["messages", 1, "content"]) == "messages[1].content"


def test_fanout_over_the_limit_is_a_400_naming_the_flag() -> None:
    admission = Admission(max_choices=256, max_queued=1024, on_shed=lambda: None)
    admission.check_fanout(2, 128)
    with pytest.raises(APIError) as raised:
        admission.check_fanout(129, 128)
    err = raised.value
    assert (err.status, err.param, err.code) == (400, "prompt", "too_many_choices")
    assert "16512 choices (129 prompts x n=128)" in err.message and "--max-choices-per-request" in err.message


def test_queue_places_shed_past_the_bound_and_each_is_released_once() -> None:
    shed: list[int] = []
    admission = Admission(max_choices=4, max_queued=5, on_shed=lambda: shed.append(1))
    first = admission.reserve(4)
    with pytest.raises(APIError) as raised:
        admission.reserve(2)
    assert raised.value.status == 503 and raised.value.headers == {"Retry-After": "1"}
    assert raised.value.code == "queue_full" and shed == [1]
    first.release()
    first.release()
    assert admission.queued == 2
    first.release_all()
    first.release_all()
    assert admission.queued == 0
    admission.reserve(5).release_all()
    assert admission.queued == 0


def _beat(stalled_s: float) -> Heartbeat:
    return Heartbeat(stalled_s=stalled_s, load=LoadSnapshot())


LIMITS = HangLimits(heartbeat_timeout_s=10.0, step_timeout_s=600.0)


@pytest.mark.parametrize(
    ("silent_s", "beat", "pending", "hung"),
    [
        (0.4, _beat(0.0), True, None),
        (0.4, None, True, None),  # no heartbeat yet, but recently started
        (0.4, _beat(3000.0), False, None),  # nothing waits on the loop
        (0.4, _beat(599.0), True, None),  # a long but working step
        (0.4, _beat(601.0), True, "stuck"),
        (10.5, _beat(0.0), False, "frozen"),  # a stopped process sends nothing at all
        (10.5, None, True, "frozen"),
    ],
)
def test_hang_policy(silent_s: float, beat: Heartbeat | None, pending: bool, hung: str | None) -> None:
    reason = hang_reason(silent_s, beat, pending, LIMITS)
    if hung is None:
        assert reason is None
    else:
        assert reason is not None and hung in reason and "--engine-" in reason
