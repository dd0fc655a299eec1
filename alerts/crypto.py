"""Channel secrets (webhook signing secrets, PagerDuty routing keys) encrypted at rest.

Fernet (AES-128-CBC + HMAC-SHA256, from ``cryptography``) with the key in
``NIGHTWATCH_SECRETS_KEY`` or the file named by ``NIGHTWATCH_SECRETS_KEY_FILE`` (several,
comma-separated, to rotate: the first encrypts, each decrypts). Without one, the key is derived
from ``SECRET_KEY``, so an embedded or development install works with nothing set; production
warns about it (``nightwatch.alerts.W001``): whoever reads the database and the settings file
then holds both halves.
"""

from __future__ import annotations

import base64
import hashlib

from cryptography.fernet import Fernet, InvalidToken, MultiFernet
from django.conf import settings


class SecretUnreadable(ValueError):
    """A stored secret does not decrypt with the configured key (the key was changed or lost)."""


def key_problem(key: str) -> str | None:
    """Why ``key`` is not a Fernet key, or None."""
    try:
        Fernet(key)
    except (ValueError, TypeError):
        return "must be a Fernet key: 32 random bytes, URL-safe base64 (44 characters)"
    return None


def derived_key(secret_key: str) -> bytes:
    return base64.urlsafe_b64encode(hashlib.sha256(b"nightwatch.alerts.secrets\0" + secret_key.encode()).digest())


def configured_keys() -> list[str]:
    return [k.strip() for k in settings.NIGHTWATCH["ALERTS"]["SECRETS_KEY"].split(",") if k.strip()]


def _fernet() -> MultiFernet:
    """Encrypts with the first configured key; decrypts with any of them or the derived key, so a
    deployment that sets a key (or puts a new one first) still reads what was stored before, until
    ``manage.py reencrypt_alert_secrets`` has rewritten it under the first key."""
    return MultiFernet([Fernet(k) for k in configured_keys()] + [Fernet(derived_key(settings.SECRET_KEY))])


def encrypt(plaintext: str) -> str:
    """The token to store for ``plaintext``; "" stays "" (no secret set)."""
    return _fernet().encrypt(plaintext.encode()).decode() if plaintext else ""


def reencrypted(token: str) -> str:
    """``token`` under the first key (raises SecretUnreadable like ``decrypt``)."""
    try:
        return _fernet().rotate(token.encode()).decode() if token else ""
    except InvalidToken:
        raise SecretUnreadable("the stored secret does not decrypt with NIGHTWATCH_SECRETS_KEY") from None


def decrypt(token: str) -> str:
    if not token:
        return ""
    try:
        return _fernet().decrypt(token.encode()).decode()
    except InvalidToken:
        raise SecretUnreadable("the stored secret does not decrypt with NIGHTWATCH_SECRETS_KEY") from None
