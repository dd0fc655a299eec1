"""``core.auth.usable_token``: the compiled-once token lookup answers exactly what the ORM query does."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db.models.signals import post_init
from django.utils import timezone

from core.auth import usable_token
from core.models import ApiToken, hash_token
from nodes.models import Node


def orm_lookup(raw: str) -> ApiToken | None:
    return ApiToken.objects.usable().select_related("user", "node").filter(digest=hash_token(raw)).first()


def same(found: ApiToken | None, expected: ApiToken | None) -> None:
    assert (found is None) == (expected is None)
    if expected is None:
        return
    fields = [f.attname for f in ApiToken._meta.concrete_fields]
    assert [getattr(found, f) for f in fields] == [getattr(expected, f) for f in fields]
    for relation in ("user", "node"):
        assert ApiToken._meta.get_field(relation).is_cached(found), f"{relation} is not joined"
        ours, theirs = getattr(found, relation), getattr(expected, relation)
        assert (ours is None) == (theirs is None)
        if theirs is not None:
            columns = [f.attname for f in type(theirs)._meta.concrete_fields]
            assert [getattr(ours, c) for c in columns] == [getattr(theirs, c) for c in columns]


@pytest.mark.django_db
def test_every_kind_of_token_comes_back_as_the_orm_builds_it(cast, django_assert_num_queries):
    node = Node.objects.get(pk=cast.node1.pk)
    node.running = [{"job": "1", "generation": 2, "pids": [7], "started_at": 1.5}]
    node.labels = {"rack": "r7"}
    node.save(update_fields=["running", "labels"])
    for name in ("viewer", "operator", "agent", "agent2", "bootstrap"):
        with django_assert_num_queries(1):
            found = usable_token(hash_token(cast.tokens[name]))
        assert found is not None, name
        same(found, orm_lookup(cast.tokens[name]))
    agent = usable_token(hash_token(cast.tokens["agent"]))
    # Values come through the fields' converters: JSON decoded, datetimes aware, the node usable as is.
    assert agent.node.running == [{"job": "1", "generation": 2, "pids": [7], "started_at": 1.5}]
    assert agent.node.labels == {"rack": "r7"}
    assert agent.created_at.tzinfo is not None
    assert agent.user is None and agent.node.hostname == "gpu-01"


@pytest.mark.django_db
def test_unknown_revoked_and_expired_tokens_are_not_found(cast):
    assert usable_token(hash_token("nw_not-a-token")) is None
    ApiToken.objects.filter(digest=hash_token(cast.tokens["viewer"])).update(revoked_at=timezone.now())
    ApiToken.objects.filter(digest=hash_token(cast.tokens["agent"])).update(
        expires_at=timezone.now() - timedelta(seconds=1))
    ApiToken.objects.filter(digest=hash_token(cast.tokens["agent2"])).update(
        expires_at=timezone.now() + timedelta(hours=1))
    for name, usable in (("viewer", False), ("agent", False), ("agent2", True), ("operator", True)):
        same(usable_token(hash_token(cast.tokens[name])), orm_lookup(cast.tokens[name]))
        assert (usable_token(hash_token(cast.tokens[name])) is not None) is usable, name


@pytest.mark.django_db
def test_the_models_are_built_through_from_db(cast):
    """Built as the ORM builds loaded rows (``Model.from_db``): saved state, signals, deferred nothing."""
    seen = []
    post_init.connect(lambda sender, instance, **kw: seen.append(sender), weak=False, dispatch_uid="token-lookup")
    try:
        token = usable_token(hash_token(cast.tokens["operator"]))
    finally:
        post_init.disconnect(dispatch_uid="token-lookup")
    assert token._state.adding is False and token._state.db == "default"
    assert token.user._state.adding is False and token.get_deferred_fields() == set()
    assert ApiToken in seen and type(token.user) in seen
