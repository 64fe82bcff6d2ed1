"""agent/fastjson.py: the same result and the same errors as json.loads, whichever decoder answers."""

import json

import pytest

from steplens.agent import fastjson


@pytest.mark.parametrize("text", [
    '{"entries": [{"record_id": 1, "time_created_ns": 1795545310116934789, "thread_id": "140082046880640"}]}',
    '{"u64": 18446744073709551615, "neg": -9223372036854775808}',   # the 64-bit extremes stay ints
    '{"x": NaN, "y": Infinity, "z": -1.5e300}',        # literals only json accepts
    '"\\u00fc"', "[]", "0",
])
def test_same_result_as_the_standard_library(text):
    for data in (text, text.encode()):
        got, want = fastjson.loads(data), json.loads(data)
        assert json.dumps(got, sort_keys=True) == json.dumps(want, sort_keys=True)


@pytest.mark.parametrize("text", ["", "{", '{"a": 1,}', b"\xff\xfe", "[1] x"])
def test_not_json_is_a_value_error(text):
    with pytest.raises(ValueError):
        fastjson.loads(text)


def test_an_integer_beyond_64_bits_is_a_number_either_way():
    got = fastjson.loads('{"big": 123456789012345678901234567890}')["big"]
    assert got == pytest.approx(123456789012345678901234567890) and isinstance(got, (int, float))


def test_orjson_is_used_where_installed():
    pytest.importorskip("orjson")
    assert fastjson.backend() == "orjson"
