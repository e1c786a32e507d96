"""`dcs_tasks.jsonbody`: which JSON bodies hold a string that is not Unicode text, and where."""

from __future__ import annotations

import json

from dcs_tasks.jsonbody import lone_surrogate_in


def test_usual_bodies_and_surrogate_pairs_pass() -> None:
    assert lone_surrogate_in(json.dumps({"a": ["b", {"c": 1}]}).encode()) is None
    assert lone_surrogate_in(b'{"a": "\\u00e9\xc3\xa9", "b": "\\ud83d\\ude00"}') is None


def test_a_lone_surrogate_is_found_with_where_it_is() -> None:
    assert lone_surrogate_in(b'{"a": [0, "\\ud800"]}') == (("a", 1), "'\\ud800'")
    assert lone_surrogate_in(b'{"a": {"\\udfff": 1}}') == (("a", "'\\udfff'"), "'\\udfff'")
    assert lone_surrogate_in(b'["x\xed\xa0\x80"]') == ((0,), "'x\\ud800'")  # raw bytes ED A0 80


def test_a_body_that_is_not_json_is_left_to_the_route() -> None:
    assert lone_surrogate_in(b'{"a": "\\ud800') is None
    assert lone_surrogate_in(b"\xff\xfe") is None
