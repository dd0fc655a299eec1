"""Webhook signatures: HMAC-SHA256 over the timestamp and the exact body bytes.

    X-Nightwatch-Timestamp: 1767225600
    X-Nightwatch-Signature: t=1767225600,v1=<hex HMAC-SHA256(secret, "1767225600." + body)>

A receiver recomputes the HMAC with the shared secret, compares in constant time, and refuses a
timestamp too far from its clock (a replayed old message). ``verify`` is that check, for
receivers written in Python and for the tests.
"""

from __future__ import annotations

import hashlib
import hmac

SIGNATURE_HEADER = "X-Nightwatch-Signature"
TIMESTAMP_HEADER = "X-Nightwatch-Timestamp"
DEFAULT_TOLERANCE_S = 300


def signature(secret: str, timestamp: int, body: bytes) -> str:
    return hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256).hexdigest()


def header_value(secret: str, timestamp: int, body: bytes) -> str:
    return f"t={timestamp},v1={signature(secret, timestamp, body)}"


def verify(secret: str, header: str, body: bytes, *, now: float, tolerance_s: float = DEFAULT_TOLERANCE_S) -> bool:
    """True when ``header`` signs ``body`` with ``secret`` and its timestamp is within tolerance."""
    parts = dict(item.split("=", 1) for item in header.split(",") if "=" in item)
    try:
        timestamp = int(parts["t"])
    except (KeyError, ValueError):
        return False
    if abs(now - timestamp) > tolerance_s:
        return False
    return hmac.compare_digest(parts.get("v1", ""), signature(secret, timestamp, body))
