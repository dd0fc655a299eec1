"""The wire parser on thousands of mutated agent messages: every one is either accepted or refused
with a ``ProtocolError`` naming a field — never another exception, which would be a 500 on the
server or a crashed agent. And bench/ingest.py's bodies are valid agent messages."""

from __future__ import annotations

import copy
import json
import random

import pytest

from agents.protocol import ProtocolError, dump, parse
from agents.protocol import agent as wire
from bench import ingest as bench
from tests.nodes.conftest import event, register_body, sample


class _Node:
    pk = 7


EXIT = {"exit_code": 1, "ranks": [{"rank": 1, "local_rank": 1, "exit_code": 1}], "root_cause_rank": 1,
        "signature": "oom", "error_line": "x", "log_tail": ["a", "b"]}
MESSAGES = [
    (wire.TelemetryBatch, {"samples": [sample(_Node, g, 1.7e9 + g, recent_xid_codes=[13]) for g in range(3)]}),
    (wire.Register, register_body("nw_token")),
    (wire.Heartbeat, {"node_id": "7", "seq": 3, "time": 1.7e9, "running": [{"job": "1", "generation": 2}]}),
    (wire.CommandAck, {"command_id": "5", "idempotency_key": "k", "status": "done", "time": 1.7e9}),
    (wire.EventBatch, {"events": [event("k", "exited", job=1, generation=1, detail=EXIT)]}),
    (wire.HealthReport, {"ok": False, "reason": "r", "checks": [{"name": "temperature", "ok": False, "detail": "d",
                                                                  "gpu": 0, "value": 91.0}],
                         "bandwidth": [{"peer": "2", "address": "a", "expected_mbps": 1.0, "ok": True}]}),
    (wire.HeartbeatResponse, {"commands": [{"id": "1", "kind": "stop", "idempotency_key": "k", "job": "1",
                                            "generation": 1, "payload": {"grace_s": 1.0, "reason": None}}]}),
]
JUNK = [None, True, False, 0, -1, 2**70, 1.5, float("nan"), "nan", "inf", "", "x", "../e", [], [1], {}, {"a": 1},
        "y" * 300, 64, 63]


def mutate(message, rng: random.Random):
    message = copy.deepcopy(message)
    node = message
    while True:
        if isinstance(node, dict) and node:
            key = rng.choice(sorted(node))
            if isinstance(node[key], (dict, list)) and node[key] and rng.random() < 0.6:
                node = node[key]
                continue
            roll = rng.random()
            if roll < 0.1:
                del node[key]
            elif roll < 0.15:
                node["unexpected"] = 1
            else:
                node[key] = rng.choice(JUNK)
        elif isinstance(node, list) and node:
            index = rng.randrange(len(node))
            if isinstance(node[index], (dict, list)) and rng.random() < 0.7:
                node = node[index]
                continue
            node[index] = rng.choice(JUNK)
        return message


def outcome(cls, data):
    try:
        return "ok", json.dumps(dump(parse(cls, data)), sort_keys=True, default=str)
    except ProtocolError as exc:
        return "error", exc.field, exc.reason


def path_exists(data, field: str) -> bool:
    """Whether a refusal's dotted field names something in the message (or a key it lacks)."""
    node = data
    for segment in field.split(".")[:-1] if field else []:
        if isinstance(node, dict) and segment in node:
            node = node[segment]
        elif isinstance(node, list) and segment.isdigit() and int(segment) < len(node):
            node = node[int(segment)]
        else:
            return False
    return True


@pytest.mark.parametrize(("cls", "message"), MESSAGES, ids=[cls.__name__ for cls, _ in MESSAGES])
def test_mutated_messages_are_accepted_or_refused_with_a_field(cls, message):
    rng = random.Random(cls.__name__)
    assert outcome(cls, message)[0] == "ok"
    errors = 0
    for _ in range(400):
        mutated = mutate(message, rng) if rng.random() < 0.95 else rng.choice(JUNK)
        result = outcome(cls, mutated)  # anything but ProtocolError propagates and fails the test
        if result[0] == "error":
            errors += 1
            assert result[2], mutated
            assert path_exists(mutated, result[1]), (result, mutated)
    assert errors > 100  # the mutations do reach the error paths


def test_the_benchmark_posts_valid_telemetry():
    bodies = bench.workload([(7, "token")], batches=2, batch=256, epoch=1.7e9)
    batches = [parse(wire.TelemetryBatch, json.loads(body)) for body in bodies[0]]
    assert [len(b.samples) for b in batches] == [256, 256]
    keys = {(s.gpu, s.time) for b in batches for s in b.samples}
    assert len(keys) == 512  # every sample is new: the run measures inserts, not duplicates
