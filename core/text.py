"""Text that came from a node, an agent or a training process, made safe to store.

Such text is whatever a crashing program printed: a 10 KB exception message, bytes that are not
UTF-8, a traceback over many lines, a NUL. A bounded column (``CharField(max_length=…)``) refuses a
longer value with a database error, PostgreSQL refuses NUL in text and in jsonb, and a lone
surrogate cannot be encoded at all: any of these would make the write that records the fault fail,
and the fault would be lost. Every writer of such text into a bounded column goes through ``clip``
(and keeps the full text in a JSON evidence field next to it).

Pure Python, no Django: the pure policy modules use it too.
"""

from __future__ import annotations

import re
from typing import Any

#: What marks a clipped text: one character, so that the bound is kept exactly.
ELLIPSIS = "…"
_SURROGATES = re.compile("[\ud800-\udfff]")
_WHITESPACE = re.compile(r"\s+")


def clean(text: str) -> str:
    """``text`` without what no column can hold: NUL goes, a lone surrogate becomes U+FFFD."""
    if "\x00" in text:
        text = text.replace("\x00", "")
    return _SURROGATES.sub("\ufffd", text)


def one_line(text: str) -> str:
    """``text`` (a multi-line traceback, say) on one line: runs of whitespace become one space."""
    return _WHITESPACE.sub(" ", text).strip()


def clip(text: str | None, limit: int) -> str:
    """``text`` cleaned and cut to at most ``limit`` characters, ending in "…" when it was cut."""
    text = clean(text or "")
    if len(text) <= limit:
        return text
    return text[:max(0, limit - len(ELLIPSIS))] + ELLIPSIS


def clean_json(value: Any, *, depth: int = 0) -> Any:
    """``value`` (decoded JSON) with every string and key ``clean``: safe for a jsonb column."""
    if depth > 32:
        return None
    if isinstance(value, str):
        return clean(value)
    if isinstance(value, dict):
        return {clean(str(k)): clean_json(v, depth=depth + 1) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [clean_json(v, depth=depth + 1) for v in value]
    return value
