"""Webhook signatures: a receiver can check them, and a tampered or replayed message fails."""

from alerts import signing


def test_a_signed_body_verifies_and_a_tampered_or_stale_one_does_not():
    body = b'{"action":"trigger"}'
    header = signing.header_value("k" * 20, 1_000_000, body)
    assert signing.verify("k" * 20, header, body, now=1_000_010)
    assert not signing.verify("k" * 20, header, body + b" ", now=1_000_010)
    assert not signing.verify("x" * 20, header, body, now=1_000_010)
    assert not signing.verify("k" * 20, header, body, now=1_000_000 + signing.DEFAULT_TOLERANCE_S + 1)
    assert not signing.verify("k" * 20, "garbage", body, now=1_000_000)
