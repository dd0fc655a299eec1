"""The user and token commands operators run."""

from __future__ import annotations

import io

import pytest
from django.core.management import CommandError, call_command

from controlplane.models import ApiToken, hash_token


def run(*args, **kwargs) -> str:
    out = io.StringIO()
    call_command(*args, stdout=out, **kwargs)
    return out.getvalue().strip()


@pytest.mark.django_db
def test_user_gets_exactly_one_role(monkeypatch):
    from django.contrib.auth.models import User

    monkeypatch.setenv("PW", "a-long-password-1")
    run("nightwatch_user", "ada", role="viewer", password_env="PW")
    run("nightwatch_user", "ada", role="oncall")
    user = User.objects.get(username="ada")
    assert list(user.groups.values_list("name", flat=True)) == ["oncall"]
    assert user.check_password("a-long-password-1")
    assert user.has_perm("jobs.approve_resume")


@pytest.mark.django_db
def test_token_is_printed_once_stored_hashed_and_rotatable(monkeypatch):
    run("nightwatch_user", "ci-bot", role="operator")
    raw = run("nightwatch_token", "issue", name="pipeline", scope="ci", user="ci-bot")
    assert raw.startswith("nw_")
    token = ApiToken.objects.get(name="pipeline")
    assert token.digest == hash_token(raw) and raw not in run("nightwatch_token", "list")
    new_raw = run("nightwatch_token", "rotate", name="pipeline")
    assert new_raw != raw
    assert ApiToken.objects.usable().get(name="pipeline").digest == hash_token(new_raw)
    assert not ApiToken.objects.usable().filter(digest=hash_token(raw)).exists()


@pytest.mark.django_db
def test_person_scopes_need_an_owner_and_agent_scope_needs_a_node():
    with pytest.raises(CommandError, match="--user is required"):
        run("nightwatch_token", "issue", name="x", scope="operator")
    with pytest.raises(CommandError, match="--node must name a registered node"):
        run("nightwatch_token", "issue", name="x", scope="agent", node="nope")
    assert run("nightwatch_token", "issue", name="boot", scope="bootstrap").startswith("nw_")
    assert ApiToken.objects.get(name="boot").single_use
