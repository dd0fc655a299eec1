"""A tiny declarative schema for the wire protocol, shared by both ends.

Every message that crosses the wire (agent -> server, hooks -> server, server -> agent/hooks)
is a frozen dataclass whose fields carry their constraints in ``metadata``. ``parse(cls, data)``
validates a decoded JSON object against it and returns the dataclass, or raises
``ProtocolError`` naming the offending field and the reason. The control plane calls the very
same ``parse`` in its views, so the two sides cannot drift apart.

No third-party dependency on purpose: this module is imported inside ``train.py`` and on GPU
nodes where only the standard library and torch can be assumed.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import types
import typing
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

#: Non-finite floats are not valid JSON; they travel as these strings, and only in fields that
#: admit them (``field(nonfinite=True)``: a loss may be NaN, a time may not).
NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
#: Every integer is a signed 64-bit one: what PostgreSQL's bigint and the agent's counters hold.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
#: Times are Unix epoch seconds up to 2106: far future, but keeps obviously broken clocks out.
MAX_TIME = 2**32
#: How deep free-form values (``Any``: event details, manifests, payloads) may nest.
MAX_ANY_DEPTH = 16


class ProtocolError(ValueError):
    """A message does not match its schema. ``field`` is a dotted path such as ``reports.3.loss``."""

    def __init__(self, field: str, reason: str):
        super().__init__(f"{field}: {reason}" if field else reason)
        self.field = field
        self.reason = reason


def field(
    *,
    default: Any = dataclasses.MISSING,
    default_factory: Any = dataclasses.MISSING,
    min: float | None = None,
    max: float | None = None,
    max_len: int | None = None,
    choices: typing.Iterable[str] | None = None,
    pattern: str | None = None,
    nonfinite: bool = False,
) -> Any:
    """A dataclass field with wire constraints (numeric bounds, length bounds, allowed values).

    Beyond these, every message refuses what no field may hold: integers outside int64, NaN and
    infinities (unless ``nonfinite``), and NUL characters in strings and keys.
    """
    meta = {"min": min, "max": max, "max_len": max_len, "choices": frozenset(choices) if choices else None,
            "pattern": pattern, "nonfinite": nonfinite}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


Check = Callable[[Any], Any]
_INF = float("inf")


class _Invalid(Exception):
    """A bad value; ``path`` is the segments below the value being checked (innermost last)."""

    def __init__(self, reason: str, path: tuple[str, ...] = ()):
        self.reason, self.path = reason, path


def parse(cls: type[T], data: Any, *, path: str = "") -> T:
    """Validate ``data`` (decoded JSON) against message class ``cls``; unknown keys are refused.

    Each class is compiled once into a closure per field (``_validator``), so the hot paths —
    thousands of GPU samples a second — do plain type tests and build a field path only on error.
    """
    try:
        return _validator(cls)(data)
    except _Invalid as exc:
        where = path
        for segment in exc.path:
            where = _join(where, segment)
        raise ProtocolError(where, exc.reason) from None


def _compile_class(cls: type) -> Check:
    hints = typing.get_type_hints(cls)
    fields = [(f.name, _compile(hints[f.name], f.metadata),
               f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
              for f in dataclasses.fields(cls)]
    known = frozenset(name for name, _, _ in fields)

    def check(data: Any) -> Any:
        if not isinstance(data, dict):
            raise _Invalid(f"expected an object, got {_kind(data)}")
        if not known.issuperset(data):
            raise _Invalid("unknown field", (sorted(set(data) - known)[0],))
        values = {}
        for name, check_field, required in fields:
            if name in data:
                try:
                    values[name] = check_field(data[name])
                except _Invalid as exc:
                    raise _Invalid(exc.reason, (name, *exc.path)) from None
            elif required:
                raise _Invalid("this field is required", (name,))
        return cls(**values)

    return check


#: Each message class compiled once. Typed as a plain callable because typeshed's cache wrapper
#: takes ``Hashable`` arguments and mypy does not count a class object as one.
_validator: Callable[[type], Check] = functools.cache(_compile_class)


def _null(value: Any) -> _Invalid:
    return _Invalid("may not be null")


def _compile(tp: Any, meta: typing.Mapping) -> Check:
    if tp is Any:
        return _any
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(tp)
        inner = [o for o in options if o is not type(None)]
        if len(inner) != 1:  # pragma: no cover - schema authoring error
            raise TypeError(f"only Optional[X] unions are supported, not {tp!r}")
        check_inner = _compile(inner[0], meta)
        if type(None) not in options:
            return check_inner

        def optional(value: Any) -> Any:
            return None if value is None else check_inner(value)
        return optional
    if origin is list:
        return _list(typing.get_args(tp)[0], meta.get("max_len"))
    if origin is dict:
        key_tp, value_tp = typing.get_args(tp)
        return _dict(key_tp, value_tp, meta.get("max_len"), meta.get("choices"))
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        validator = _validator(tp)

        def nested(value: Any) -> Any:
            if value is None:
                raise _null(value)
            return validator(value)
        return nested
    if tp is bool:
        return _bool
    if tp is int:
        return _number(meta, integer=True)
    if tp is float:
        return _number(meta, integer=False)
    if tp is str:
        return _str(meta)
    raise TypeError(f"unsupported schema type {tp!r}")  # pragma: no cover


def _bool(value: Any) -> bool:
    if value is True or value is False:
        return value
    if value is None:
        raise _null(value)
    raise _Invalid(f"expected a boolean, got {_kind(value)}")


def _number(meta: typing.Mapping, *, integer: bool) -> Check:
    low, high, nonfinite = meta.get("min"), meta.get("max"), meta.get("nonfinite")

    def bounded(number: Any) -> Any:
        if low is not None and number < low:
            raise _Invalid(f"must be >= {low}, got {number}")
        if high is not None and number > high:
            raise _Invalid(f"must be <= {high}, got {number}")
        return number

    def check_int(value: Any) -> int:
        if value.__class__ is not int and (isinstance(value, bool) or not isinstance(value, int)):
            if value is None:
                raise _null(value)
            raise _Invalid(f"expected an integer, got {_kind(value)}")
        if not INT64_MIN <= value <= INT64_MAX:
            raise _Invalid(f"must be a 64-bit integer (from {INT64_MIN} to {INT64_MAX})")
        return bounded(value)

    def check_float(value: Any) -> float:
        kind = value.__class__
        if kind is not float and kind is not int:
            if isinstance(value, str) and value in NONFINITE:
                value = NONFINITE[value]
            elif value is None:
                raise _null(value)
            elif isinstance(value, bool) or not isinstance(value, (int, float)):
                raise _Invalid(f"expected a number, got {_kind(value)}")
        try:
            number = float(value)
        except OverflowError:  # an integer literal beyond the float range
            raise _Invalid("must be a finite number") from None
        if number != number or number == _INF or number == -_INF:
            if nonfinite:
                return number
            raise _Invalid(f"must be a finite number, got {dump_float(number)}")
        return bounded(number)

    return check_int if integer else check_float


def _str(meta: typing.Mapping) -> Check:
    max_len, choices, pattern = meta.get("max_len"), meta.get("choices"), meta.get("pattern")
    compiled = re.compile(pattern) if pattern else None

    def check(value: Any) -> str:
        if value.__class__ is not str and not isinstance(value, str):
            if value is None:
                raise _null(value)
            raise _Invalid(f"expected a string, got {_kind(value)}")
        if "\x00" in value:
            raise _Invalid(_NUL)
        if max_len is not None and len(value) > max_len:
            raise _Invalid(f"at most {max_len} characters allowed, got {len(value)}")
        if choices and value not in choices:
            raise _Invalid(f"must be one of {sorted(choices)}, got {value!r}")
        if compiled is not None and not compiled.fullmatch(value):
            raise _Invalid(f"does not match {pattern}")
        return value

    return check


_NUL = "may not contain NUL characters"


def _any(value: Any, depth: int = 0) -> Any:
    """A free-form JSON value: nested at most ``MAX_ANY_DEPTH`` deep, with the same limits on its
    numbers and strings as typed fields (PostgreSQL stores it as jsonb, which holds no NUL)."""
    kind = value.__class__
    if kind is str:
        if "\x00" in value:
            raise _Invalid(_NUL)
    elif kind is int:
        if not INT64_MIN <= value <= INT64_MAX:
            raise _Invalid(f"must be a 64-bit integer (from {INT64_MIN} to {INT64_MAX})")
    elif kind is float:
        if value != value or value in (_INF, -_INF):
            raise _Invalid("must be a finite number")
    elif kind is dict or kind is list:
        if depth >= MAX_ANY_DEPTH:
            raise _Invalid(f"nested more than {MAX_ANY_DEPTH} levels deep")
        items = value.items() if kind is dict else enumerate(value)
        for key, item in items:
            if kind is dict and (not isinstance(key, str) or "\x00" in key):
                raise _Invalid("keys must be strings without NUL characters", (str(key).replace("\x00", ""),))
            try:
                _any(item, depth + 1)
            except _Invalid as exc:
                raise _Invalid(exc.reason, (str(key), *exc.path)) from None
    elif value is not None and kind is not bool:
        raise _Invalid(f"expected a JSON value, got {_kind(value)}")
    return value


def _list(item_tp: Any, max_len: int | None) -> Check:
    check_item = _compile(item_tp, {})

    def check(value: Any) -> list:
        if value.__class__ is not list and not isinstance(value, list):
            if value is None:
                raise _null(value)
            raise _Invalid(f"expected a list, got {_kind(value)}")
        if max_len is not None and len(value) > max_len:
            raise _Invalid(f"at most {max_len} items allowed, got {len(value)}")
        out = []
        index = 0
        try:
            for index, item in enumerate(value):  # noqa: B007 - read in the handler
                out.append(check_item(item))
        except _Invalid as exc:
            raise _Invalid(exc.reason, (str(index), *exc.path)) from None
        return out

    return check


def _dict(key_tp: Any, value_tp: Any, max_len: int | None, choices: frozenset | None) -> Check:
    check_key, check_value = _compile(key_tp, {}), _compile(value_tp, {})

    def check(value: Any) -> dict:
        if not isinstance(value, dict):
            if value is None:
                raise _null(value)
            raise _Invalid(f"expected an object, got {_kind(value)}")
        if max_len is not None and len(value) > max_len:
            raise _Invalid(f"at most {max_len} keys allowed, got {len(value)}")
        out = {}
        for key, item in value.items():
            if choices and key not in choices:
                raise _Invalid(f"unknown key; expected one of {sorted(choices)}", (str(key),))
            try:
                out[check_key(key)] = check_value(item)
            except _Invalid as exc:
                raise _Invalid(exc.reason, (str(key), *exc.path)) from None
        return out

    return check


def dump_float(number: float) -> Any:
    """A float as it travels: non-finite ones as ``"nan"``, ``"inf"`` or ``"-inf"``."""
    if math.isfinite(number):
        return number
    return "nan" if math.isnan(number) else ("inf" if number > 0 else "-inf")


def dump(message: Any) -> dict:
    """The JSON-ready dict of a message (non-finite floats become strings)."""
    return _encode(dataclasses.asdict(message))


def _encode(value: Any) -> Any:
    if isinstance(value, float):
        return dump_float(value)
    if isinstance(value, dict):
        return {k: _encode(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_encode(v) for v in value]
    return value


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _kind(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "an integer",
            float: "a number", type(None): "null"}.get(type(value), type(value).__name__)
