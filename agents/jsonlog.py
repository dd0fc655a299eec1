"""JSON log lines that one incident can be followed by, across the web, the workers and the agents.

Every line is one JSON object: time, level, logger, message, the service, and whichever of the
ids ``job``, ``generation``, ``node``, ``incident``, ``checkpoint`` and ``rank`` are known — bound
for a stretch of work with ``log_context(...)`` (a context variable, so threads and asyncio
tasks keep their own) or passed per call as ``logger.info(..., extra={"job": 7})``. A log
aggregator then finds every line of job 7 in every process with one query.

What is never logged: only the fields listed here leave a record (an ``extra`` named ``prompt``
or ``samples`` is dropped, not serialised), and anything shaped like a Nightwatch token or a
bearer credential is masked in the message and in tracebacks. Lives in ``agents`` (no Django) so
the node agent and the control plane share one format.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import UTC, datetime

#: the ids a line may carry, in the order they are written
ID_FIELDS = ("job", "generation", "node", "incident", "checkpoint", "rank")
#: other ``extra`` fields allowed through: bounded, never payloads
EXTRA_FIELDS = ("task", "task_id", "method", "route", "status", "duration_ms", "kind", "state", "decision")

_context: ContextVar[dict] = ContextVar("nightwatch_log_context", default={})  # noqa: B039 - never mutated

_SECRETS = [
    (re.compile(r"nw_[A-Za-z0-9_\-]{8,}"), "nw_…[redacted]"),
    (re.compile(r"(?i)(bearer\s+)[^\s'\",]+"), r"\1[redacted]"),
    (re.compile(r"(?i)((?:password|secret|token)[\"']?\s*[=:]\s*[\"']?)[A-Za-z0-9_\-+/=]{12,}"), r"\1[redacted]"),
]


def redact(text: str) -> str:
    """``text`` with token-shaped strings and credentials masked."""
    for pattern, replacement in _SECRETS:
        text = pattern.sub(replacement, text)
    return text


@contextmanager
def log_context(**ids) -> Iterator[None]:
    """Attach ``ids`` (job=…, node=…) to every line logged inside the block; None values are skipped."""
    token = _context.set({**_context.get(), **{k: v for k, v in ids.items() if v is not None}})
    try:
        yield
    finally:
        _context.reset(token)


def start_context(**ids) -> None:
    """Replace the bound ids outright, at the start of a unit of work (a web request): unlike
    ``log_context`` nothing is restored afterwards, so lines logged after the unit returns (Django
    logs 4xx/5xx answers last) still carry its ids; the next unit starts afresh."""
    _context.set({k: v for k, v in ids.items() if v is not None})


def current_context() -> dict:
    return dict(_context.get())


class JsonFormatter(logging.Formatter):
    """One JSON object per record (see the module docstring for what goes in and what never does)."""

    def __init__(self, *args, service: str = "", static: dict | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.service = service
        #: ids true for the whole process (the agent's node), under whatever is bound later
        self.static = {k: v for k, v in (static or {}).items() if v is not None}

    def extra_context(self, record: logging.LogRecord) -> dict:
        """Ids known from elsewhere (the control plane adds the running Celery task's)."""
        return {}

    def format(self, record: logging.LogRecord) -> str:
        line = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": redact(record.getMessage()),
        }
        if self.service:
            line["service"] = self.service
        fields = {**self.static, **self.extra_context(record), **_context.get()}
        for name in (*ID_FIELDS, *EXTRA_FIELDS):
            value = getattr(record, name, None)
            if value is not None:
                fields[name] = value
        for name in (*ID_FIELDS, *EXTRA_FIELDS):
            if name in fields:
                line[name] = _scalar(fields[name])
        if record.exc_info:
            line["exception"] = redact(self.formatException(record.exc_info))
        return json.dumps(line, ensure_ascii=False)


def _scalar(value):
    if isinstance(value, (int, float, bool)) or value is None:
        return value
    return redact(str(value))[:200]


def configure(level: str = "INFO", *, service: str, fmt: str = "json", **ids) -> None:
    """Root logging for a process that is not Django (the agent): JSON lines on stderr, each with
    ``ids`` (e.g. ``node="gpu-01"``); ``fmt="plain"`` for a person at a terminal."""
    handler = logging.StreamHandler()
    if fmt == "json":
        handler.setFormatter(JsonFormatter(service=service, static=ids))
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
