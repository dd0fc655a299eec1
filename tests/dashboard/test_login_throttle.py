"""Login throttling (django-axes) on both login forms, the dashboard's ``/login/`` and the admin's
``/admin/login/``: per user name and per address, a clear 429 page while locked, a lock that
expires, and API tokens untouched by it."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.test import Client

pytestmark = pytest.mark.django_db

LIMIT = 4


@pytest.fixture(autouse=True)
def _small_limit(settings):
    settings.AXES_FAILURE_LIMIT = LIMIT


def sign_in(url: str, username: str, password: str, *, address: str = "198.51.100.1"):
    return Client(REMOTE_ADDR=address).post(url, {"username": username, "password": password})


def signed_in(response) -> bool:
    return response.status_code == 302 and bool(response.cookies.get("sessionid"))


@pytest.fixture
def staff(cast):
    """Olga and Otto may use the admin's login too."""
    for person in (cast.oncall, cast.operator):
        person.is_staff = True
        person.save(update_fields=["is_staff"])


@pytest.mark.parametrize("url", ["/login/", "/admin/login/"])
def test_wrong_passwords_lock_the_user_name_even_for_the_right_password(url, staff):
    # The form with its error, until the failure that reaches the limit.
    answers = [sign_in(url, "olga", "wrong-password").status_code for _ in range(LIMIT)]
    assert answers == [200] * (LIMIT - 1) + [429]
    locked = sign_in(url, "olga", "olga-password-1")
    assert locked.status_code == 429
    body = locked.content.decode()
    assert "Sign-in locked" in body and "15 m 00 s" in body
    # From anywhere: it is the account that is being guessed.
    assert sign_in(url, "olga", "olga-password-1", address="203.0.113.5").status_code == 429
    # Another person from another address is not affected.
    assert signed_in(sign_in(url, "otto", "otto-password-1", address="203.0.113.6"))


def test_one_address_guessing_many_user_names_is_locked_too(cast):
    answers = [sign_in("/login/", f"nobody-{n}", "wrong-password").status_code for n in range(LIMIT)]
    assert answers == [200] * (LIMIT - 1) + [429]
    assert sign_in("/login/", "vera", "vera-password-1").status_code == 429
    assert signed_in(sign_in("/login/", "vera", "vera-password-1", address="203.0.113.7"))


def test_the_lock_lifts_after_the_cool_off(cast, time_machine):
    time_machine.move_to("2026-06-01T12:00:00Z")
    for _ in range(LIMIT):
        sign_in("/login/", "vera", "wrong-password")
    assert sign_in("/login/", "vera", "vera-password-1").status_code == 429
    # Tries during the lock do not extend it.
    time_machine.move_to("2026-06-01T12:10:00Z")
    assert sign_in("/login/", "vera", "wrong-password").status_code == 429
    time_machine.move_to("2026-06-01T12:15:01Z")
    assert signed_in(sign_in("/login/", "vera", "vera-password-1"))


def test_the_cool_off_and_limit_come_from_the_settings(settings, cast, time_machine):
    settings.AXES_COOLOFF_TIME = timedelta(minutes=1)
    time_machine.move_to("2026-06-01T12:00:00Z")
    for _ in range(LIMIT):
        sign_in("/login/", "vera", "wrong-password")
    assert sign_in("/login/", "vera", "vera-password-1").status_code == 429
    time_machine.move_to("2026-06-01T12:01:01Z")
    assert signed_in(sign_in("/login/", "vera", "vera-password-1"))


def test_api_tokens_are_untouched_by_login_lockouts(cast):
    from axes.models import AccessAttempt
    from rest_framework.test import APIClient

    for _ in range(LIMIT):
        sign_in("/login/", "vera", "wrong-password", address="127.0.0.1")
    api = APIClient(REMOTE_ADDR="127.0.0.1")
    api.credentials(HTTP_AUTHORIZATION=f"Bearer {cast.tokens['viewer']}")
    assert api.get("/api/v1/jobs").status_code == 200
    # and a bad token is the token counter's business, never a login failure
    attempts = AccessAttempt.objects.count()
    api.credentials(HTTP_AUTHORIZATION="Bearer nw_guess")
    assert api.get("/api/v1/jobs").status_code == 401
    assert AccessAttempt.objects.count() == attempts
