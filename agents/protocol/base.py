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
import math
import types
import typing
from typing import Any, TypeVar

T = TypeVar("T")

#: Non-finite floats are not valid JSON; they travel as these strings.
NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


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
) -> Any:
    """A dataclass field with wire constraints (numeric bounds, length bounds, allowed values)."""
    meta = {"min": min, "max": max, "max_len": max_len, "choices": frozenset(choices) if choices else None,
            "pattern": pattern}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def parse(cls: type[T], data: Any, *, path: str = "") -> T:
    """Validate ``data`` (decoded JSON) against message class ``cls``; unknown keys are refused."""
    if not isinstance(data, dict):
        raise ProtocolError(path, f"expected an object, got {_kind(data)}")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ProtocolError(_join(path, unknown[0]), "unknown field")
    values = {}
    for f in dataclasses.fields(cls):
        where = _join(path, f.name)
        if f.name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ProtocolError(where, "this field is required")
            continue
        values[f.name] = _check(hints[f.name], data[f.name], f.metadata, where)
    return cls(**values)


def dump(message: Any) -> dict:
    """The JSON-ready dict of a message (non-finite floats become strings)."""
    return _encode(dataclasses.asdict(message))


def _encode(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: _encode(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_encode(v) for v in value]
    return value


def _check(tp: Any, value: Any, meta: typing.Mapping, where: str) -> Any:
    if tp is Any:  # free-form JSON (details, payloads): null included
        return value
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None:
            if type(None) in options:
                return None
            raise ProtocolError(where, "may not be null")
        inner = [o for o in options if o is not type(None)]
        if len(inner) != 1:  # pragma: no cover - schema authoring error
            raise TypeError(f"{where}: only Optional[X] unions are supported")
        return _check(inner[0], value, meta, where)
    if value is None:
        raise ProtocolError(where, "may not be null")
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ProtocolError(where, f"expected a list, got {_kind(value)}")
        if meta.get("max_len") is not None and len(value) > meta["max_len"]:
            raise ProtocolError(where, f"at most {meta['max_len']} items allowed, got {len(value)}")
        return [_check(item_tp, v, {}, f"{where}.{i}") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ProtocolError(where, f"expected an object, got {_kind(value)}")
        key_tp, val_tp = typing.get_args(tp)
        if meta.get("max_len") is not None and len(value) > meta["max_len"]:
            raise ProtocolError(where, f"at most {meta['max_len']} keys allowed, got {len(value)}")
        out = {}
        for k, v in value.items():
            if meta.get("choices") and k not in meta["choices"]:
                raise ProtocolError(f"{where}.{k}", f"unknown key; expected one of {sorted(meta['choices'])}")
            out[_check(key_tp, k, {}, f"{where}.{k}")] = _check(val_tp, v, {}, f"{where}.{k}")
        return out
    if dataclasses.is_dataclass(tp):
        return parse(tp, value, path=where)
    if tp is Any:
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ProtocolError(where, f"expected a boolean, got {_kind(value)}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ProtocolError(where, f"expected an integer, got {_kind(value)}")
        return _bounded(value, meta, where)
    if tp is float:
        if isinstance(value, str) and value in NONFINITE:
            return NONFINITE[value]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ProtocolError(where, f"expected a number, got {_kind(value)}")
        return _bounded(float(value), meta, where)
    if tp is str:
        if not isinstance(value, str):
            raise ProtocolError(where, f"expected a string, got {_kind(value)}")
        if meta.get("max_len") is not None and len(value) > meta["max_len"]:
            raise ProtocolError(where, f"at most {meta['max_len']} characters allowed, got {len(value)}")
        if meta.get("choices") and value not in meta["choices"]:
            raise ProtocolError(where, f"must be one of {sorted(meta['choices'])}, got {value!r}")
        if meta.get("pattern"):
            import re

            if not re.fullmatch(meta["pattern"], value):
                raise ProtocolError(where, f"does not match {meta['pattern']}")
        return value
    raise TypeError(f"{where}: unsupported schema type {tp!r}")  # pragma: no cover


def _bounded(value: float, meta: typing.Mapping, where: str):
    if isinstance(value, float) and not math.isfinite(value):
        return value
    if meta.get("min") is not None and value < meta["min"]:
        raise ProtocolError(where, f"must be >= {meta['min']}, got {value}")
    if meta.get("max") is not None and value > meta["max"]:
        raise ProtocolError(where, f"must be <= {meta['max']}, got {value}")
    return value


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _kind(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "an integer",
            float: "a number", type(None): "null"}.get(type(value), type(value).__name__)
