"""Plain values on the wire between the candidate server and the grader: tagged JSON.

Only these cross, in either direction: None, bool, int, float (also nan/inf), str, list,
and, tagged as ``{"$": tag, "v": ...}``, tuple, dict (as a list of [key, value] pairs, so
keys keep their type), set, frozenset, bytes (hex), complex, and ``handle`` (an opaque
number naming an object that stays in the sandbox). Every JSON object on the wire is a
tag; anything else is a protocol error. The decoder builds plain Python values only,
so nothing the candidate sends can carry behaviour (an ``__eq__`` that is always True,
a ``__bool__``, a custom class) into the grader.

Standard library only; imported by the server inside the sandbox and by the grader.
"""
import json
import numbers

MAX_LINE_BYTES = 16 * 1024 * 1024
MAX_DEPTH = 200


class WireError(ValueError):
    """A message that is not a plain tagged-JSON value (or is too large / too deep)."""


def encode(value, handles=None, depth: int = 0):
    """``value`` as a JSON-ready structure. Objects that are not plain values become
    handles when ``handles`` (a registry with ``.add(obj) -> int``) is given, else
    raise ``WireError``."""
    if depth > MAX_DEPTH:
        raise WireError("value nested too deeply")
    down = depth + 1
    if value is None or type(value) in (bool, int, float, str):
        return value
    if type(value).__module__ == "numpy" and getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
        return encode(value.item(), handles, down)  # numpy scalars (bool_, int64, float32 ...)
    if isinstance(value, numbers.Integral):  # bool subclasses cannot exist; other integers can
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, str):
        return str(value)
    if isinstance(value, list):
        return [encode(v, handles, down) for v in value]
    if isinstance(value, tuple):  # named tuples too: they compare equal to tuples
        return {"$": "tuple", "v": [encode(v, handles, down) for v in value]}
    if isinstance(value, dict):
        return {"$": "dict", "v": [[encode(k, handles, down), encode(v, handles, down)] for k, v in value.items()]}
    if isinstance(value, (set, frozenset)):
        tag = "frozenset" if isinstance(value, frozenset) else "set"
        return {"$": tag, "v": [encode(v, handles, down) for v in value]}
    if isinstance(value, (bytes, bytearray)):
        return {"$": "bytes", "v": bytes(value).hex()}
    if isinstance(value, complex):
        return {"$": "complex", "v": [value.real, value.imag]}
    if handles is not None:
        return {"$": "handle", "v": handles.add(value)}
    raise WireError(f"cannot send a {type(value).__name__} (only plain values cross the sandbox boundary)")


def dumps(message) -> bytes:
    return json.dumps(message, allow_nan=True, separators=(",", ":")).encode() + b"\n"


def decode(data, depth: int = 0, make_handle=None):
    """The plain Python value of a JSON-ready structure; ``make_handle(n)`` builds the
    stand-in for a handle (the grader's remote object), else handles are refused."""
    if depth > MAX_DEPTH:
        raise WireError("value nested too deeply")
    if data is None or type(data) in (bool, int, float, str):
        return data
    down = depth + 1
    if type(data) is list:
        return [decode(v, down, make_handle) for v in data]
    if type(data) is not dict or set(data) != {"$", "v"}:
        raise WireError(f"not a plain value: {str(data)[:80]}")
    tag, raw = data["$"], data["v"]
    try:
        if tag == "tuple":
            return tuple(decode(v, down, make_handle) for v in _list(raw))
        if tag == "dict":
            return {decode(k, down, make_handle): decode(v, down, make_handle) for k, v in _pairs(raw)}
        if tag in ("set", "frozenset"):
            items = (decode(v, down, make_handle) for v in _list(raw))
            return set(items) if tag == "set" else frozenset(items)
        if tag == "bytes" and type(raw) is str:
            return bytes.fromhex(raw)
        if tag == "complex":
            real, imag = _list(raw)
            return complex(_number(real), _number(imag))
        if tag == "handle" and make_handle is not None and type(raw) is int:
            return make_handle(raw)
    except TypeError as err:  # an unhashable key or set element
        raise WireError(f"malformed {tag}: {err}") from None
    raise WireError(f"unknown or malformed tag {tag!r}")


def loads(line: bytes, make_handle=None):
    """One message (a JSON object with plain-value fields) from one line."""
    if len(line) > MAX_LINE_BYTES:
        raise WireError(f"message larger than {MAX_LINE_BYTES} bytes")
    try:
        message = json.loads(line)
    except (ValueError, RecursionError) as err:
        raise WireError(f"not JSON: {err}") from None
    if type(message) is not dict:
        raise WireError("a message must be a JSON object")
    return message


def _list(raw) -> list:
    if type(raw) is not list:
        raise WireError("expected a list")
    return raw


def _pairs(raw) -> list:
    pairs = _list(raw)
    if any(type(p) is not list or len(p) != 2 for p in pairs):
        raise WireError("a dict is a list of [key, value] pairs")
    return pairs


def _number(x) -> float:
    if type(x) not in (int, float):
        raise WireError("expected a number")
    return x
