"""The typed policies: one set of defaults, which the API's serializers and the CLI's spec follow."""

from __future__ import annotations

import dataclasses
import typing
from types import SimpleNamespace

import pytest
from rest_framework.fields import empty

from agents.cli import spec as cli_spec
from checkpoints.policies import CheckpointPolicy
from jobs.api.serializers import CheckpointPolicySerializer, RecoveryPolicySerializer
from jobs.policies import RecoveryPolicy

PAIRS = [(RecoveryPolicy, RecoveryPolicySerializer, "recovery_policy"),
         (CheckpointPolicy, CheckpointPolicySerializer, "checkpoint_policy")]


@pytest.mark.parametrize(("policy", "serializer", "_"), PAIRS)
def test_the_serializer_fills_in_the_dataclass_defaults_for_every_field(policy, serializer, _):
    fields = serializer().fields
    assert set(fields) == {f.name for f in dataclasses.fields(policy)}
    for f in dataclasses.fields(policy):
        # A field without a default (the directories) is left out of the stored policy: None here.
        sent = None if fields[f.name].default is empty else fields[f.name].default
        assert (f.name, sent) == (f.name, f.default)
        assert not fields[f.name].required


def test_the_cli_spec_accepts_null_where_the_serializers_do():
    nullable = {f"{key}.{name}" for _, serializer, key in PAIRS
                for name, field in serializer().fields.items() if field.allow_null}
    assert nullable == cli_spec.NULLABLE


def test_the_interval_choices_are_the_dataclass_literal():
    choices = CheckpointPolicySerializer().fields["interval"].choices
    hints = typing.get_type_hints(CheckpointPolicy)
    assert set(choices) == set(typing.get_args(hints["interval"]))


@pytest.mark.parametrize(("policy", "_", "key"), PAIRS)
def test_the_cli_spec_knows_the_same_fields(policy, _, key):
    assert set(cli_spec.TOP_LEVEL[key]) == {f.name for f in dataclasses.fields(policy)}


def job(**policies):
    return SimpleNamespace(**{"recovery_policy": {}, "checkpoint_policy": {}, **policies})


def test_a_policy_stored_empty_or_absent_reads_as_the_defaults():
    assert RecoveryPolicy.of(job()) == RecoveryPolicy()
    assert RecoveryPolicy.of(job(recovery_policy=None)) == RecoveryPolicy()
    assert CheckpointPolicy.of(job(checkpoint_policy=None)) == CheckpointPolicy()


def test_a_stored_value_wins_a_null_or_missing_one_falls_back_and_an_unknown_key_is_ignored():
    stored = {"loss_spike_limit": 7, "max_restarts": None, "allow_shrink": True, "retired_field": 1}
    policy = RecoveryPolicy.of(job(recovery_policy=stored))
    assert policy == RecoveryPolicy(loss_spike_limit=7, allow_shrink=True)
    assert policy.max_restarts == RecoveryPolicy().max_restarts


def test_a_stored_checkpoint_policy_reads_back_field_by_field():
    stored = {"dir": "/ckpt/a", "interval": "auto", "interval_steps": 10, "keep_last": 2, "permanent_every_hours": 0}
    assert CheckpointPolicy.of(job(checkpoint_policy=stored)) == CheckpointPolicy(**stored)


def test_a_policy_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        RecoveryPolicy().max_restarts = 1  # type: ignore[misc]
