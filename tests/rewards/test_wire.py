"""The plain-value wire between the sandbox and the grader: exact round trips, and
nothing but plain values out of a decode."""
import math

import pytest

from asyncrl.rewards.standalone import wire


class Handles:
    def __init__(self):
        self.objects = []

    def add(self, obj):
        self.objects.append(obj)
        return len(self.objects)


@pytest.mark.parametrize("value", [
    None, True, 0, -3, 2 ** 80, 1.5, "x", [1, [2, "a"]], (1, (2,)), {"a": 1, 2: [3], (1, 2): None},
    {1, 2}, frozenset({"a"}), b"\x00\xff", 1 + 2j, [], (), {},
])
def test_plain_values_round_trip_exactly(value):
    back = wire.decode(wire.loads(wire.dumps({"v": wire.encode(value)}))["v"])
    assert back == value and type(back) is type(value)


def test_special_floats_and_numpy_scalars():
    back = wire.decode(wire.loads(wire.dumps({"v": wire.encode([math.inf, -math.inf])}))["v"])
    assert back == [math.inf, -math.inf]
    np = pytest.importorskip("numpy")
    assert wire.encode(np.int64(3)) == 3 and wire.encode(np.bool_(True)) is True and wire.encode(np.float32(0.5)) == 0.5


def test_objects_become_handles_or_are_refused():
    class Thing:
        def __eq__(self, other):
            return True

    handles = Handles()
    assert wire.encode([Thing()], handles) == [{"$": "handle", "v": 1}]
    with pytest.raises(wire.WireError, match="only plain values"):
        wire.encode(Thing())
    made = wire.decode({"$": "handle", "v": 1}, make_handle=lambda key: ("remote", key))
    assert made == ("remote", 1)
    with pytest.raises(wire.WireError):  # no handle maker: handles are not values
        wire.decode({"$": "handle", "v": 1})


@pytest.mark.parametrize("data", [
    {"a": 1}, {"$": "object", "v": 1}, {"$": "dict", "v": [[[1], 2]]}, {"$": "set", "v": [[1]]},
    {"$": "tuple", "v": 5}, {"$": "complex", "v": ["1", 2]}, {"$": "bytes", "v": 3},
])
def test_malformed_values_are_protocol_errors(data):
    with pytest.raises(wire.WireError):
        wire.decode(data)


def test_size_and_depth_limits():
    deep = []
    for _ in range(wire.MAX_DEPTH + 5):
        deep = [deep]
    with pytest.raises(wire.WireError):
        wire.encode(deep)
    with pytest.raises(wire.WireError):
        wire.loads(b"[" * 10 + b"]" * 10)  # not an object
    with pytest.raises(wire.WireError):
        wire.loads(b" " * (wire.MAX_LINE_BYTES + 1))
