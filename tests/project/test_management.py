"""The user and token commands operators run."""

from __future__ import annotations

import io

import pytest
from django.core.management import CommandError, call_command

from core.models import ApiToken, hash_token


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


@pytest.mark.django_db
def test_bootstrap_tokens_expire_and_bind_to_a_new_host_or_an_existing_node(settings):
    from datetime import timedelta

    from django.utils import timezone

    from jobs.models import Event
    from nodes.models import Node

    settings.NIGHTWATCH = {**settings.NIGHTWATCH, "BOOTSTRAP_TOKEN_TTL_S": 600}
    run("nightwatch_token", "issue", name="any", scope="bootstrap")
    run("nightwatch_token", "issue", name="new", scope="bootstrap", hostname="gpu-09")
    node = Node.objects.create(hostname="gpu-01", address="10.0.0.1")
    raw = run("nightwatch_token", "issue", name="again", scope="bootstrap", node="gpu-01")
    tokens = {t.name: t for t in ApiToken.objects.all()}
    for token in tokens.values():
        assert token.single_use and timedelta(0) < token.expires_at - timezone.now() <= timedelta(seconds=600)
    assert [(tokens[n].hostname, tokens[n].node) for n in ("any", "new", "again")] == [
        ("", None), ("gpu-09", None), ("gpu-01", node)]
    assert tokens["again"].digest == hash_token(raw)
    approval = Event.objects.get(kind="node.bootstrap_token", node=node)
    assert approval.actor == "system:nightwatch_token" and raw not in str(approval.evidence)
    with pytest.raises(CommandError, match="no node named 'gpu-77'"):
        run("nightwatch_token", "issue", name="x", scope="bootstrap", node="gpu-77")
    with pytest.raises(CommandError, match="not both"):
        run("nightwatch_token", "issue", name="x", scope="bootstrap", node="gpu-01", hostname="gpu-01")
    with pytest.raises(CommandError, match="bootstrap tokens only"):
        run("nightwatch_token", "issue", name="x", scope="agent", node="gpu-01", hostname="gpu-01")
