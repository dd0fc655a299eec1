"""Training output (issue 21): the agents ship each generation's torchrun output with their node
token, only for generations placed on their node; it is stored sanitised and bounded (a cap per
generation, a retention) and read by job, generation and rank, with a cursor to follow."""

from __future__ import annotations

from datetime import timedelta

import pytest

from jobs.models import Generation, LogLine, LogStream

PROBLEM = "application/problem+json"


@pytest.fixture
def placed(cast):
    """cast.job's generation 1 runs on gpu-01 (node1)."""
    generation = Generation.objects.create(job=cast.job, number=1, world_size=2, state="running")
    generation.nodes.add(cast.node1)
    return cast


def ship(api, cast, lines, *, first=0, generation=1, token="agent", node=None):  # noqa: S107 - a name in cast.tokens
    node = node or cast.node1
    body = {"job": str(cast.job.pk), "generation": generation, "first_line": first, "lines": lines}
    return api(cast.tokens[token]).post(f"/api/v1/nodes/{node.pk}/logs", body, format="json")


def read(api, cast, **params):
    answer = api(cast.tokens["viewer"]).get(f"/api/v1/jobs/{cast.job.pk}/logs", params)
    assert answer.status_code == 200, answer.content
    return answer.json()


@pytest.mark.django_db
def test_the_agent_ships_lines_that_are_stored_sanitised_and_read_back_in_order(placed, api):
    cast = placed
    nul = ship(api, cast, ["bad\x00byte"])  # the agent writes NUL as U+FFFD (agents.supervisor.decode_line)
    assert nul.status_code == 400 and not LogLine.objects.exists()
    answer = ship(api, cast, ["step 1 loss 2.5", "[rank1]: Traceback (most recent call last):", "bad\ufffdbyte",
                              "x" * 3000])
    assert answer.status_code == 202 and answer.json() == {"accepted": 4, "duplicates": 0, "dropped": 0}
    again = ship(api, cast, ["[rank1]: Traceback (most recent call last):", "bad\ufffdbyte", "x" * 3000, "step 2"],
                 first=1)
    assert again.json() == {"accepted": 1, "duplicates": 3, "dropped": 0}  # a retry is stored once
    body = read(api, cast)
    assert [line["text"][:20] for line in body["lines"]] == ["step 1 loss 2.5", "[rank1]: Traceback (", "bad\ufffdbyte",
                                                             "x" * 20, "step 2"]
    assert [line["line"] for line in body["lines"]] == [0, 1, 2, 3, 4]
    assert len(body["lines"][3]["text"]) == 2000 and body["lines"][3]["text"].endswith("…")
    assert [line["rank"] for line in body["lines"]] == [None, 1, None, None, None]
    assert {line["node"] for line in body["lines"]} == {"gpu-01"} and body["cursor"] == body["lines"][-1]["id"]
    assert body["streams"] == [{"generation": 1, "node": "gpu-01", "lines": 5,
                                "bytes": sum(len(line["text"]) for line in body["lines"]), "dropped": 0}]
    assert [line["text"] for line in read(api, cast, rank=1)["lines"]] == ["[rank1]: Traceback (most recent call "
                                                                           "last):"]
    assert [line["text"] for line in read(api, cast, tail=2)["lines"]][-1] == "step 2"
    # Follow: only what came after the cursor; a gap in the line numbers is counted as dropped.
    cursor = body["cursor"]
    assert read(api, cast, after=cursor)["lines"] == []
    assert ship(api, cast, ["step 9"], first=9).json() == {"accepted": 1, "duplicates": 0, "dropped": 4}
    followed = read(api, cast, after=cursor)
    assert [line["text"] for line in followed["lines"]] == ["step 9"] and followed["cursor"] > cursor
    assert read(api, cast, generation=2)["lines"] == []


@pytest.mark.django_db
def test_only_the_agent_of_a_node_the_generation_is_placed_on_may_write(placed, api):
    from core.tokens import job_token_for

    cast = placed
    other = ship(api, cast, ["forged"], token="agent2", node=cast.node2)
    assert other.status_code == 403 and other["Content-Type"] == PROBLEM
    assert "not placed on node" in other.json()["detail"]
    assert ship(api, cast, ["forged"], token="agent2").status_code == 403  # and never another node's URL
    assert ship(api, cast, ["forged"], generation=7).status_code == 403  # no such generation
    token = job_token_for(cast.job, 1, cast.node1)
    hooks = api(token).post(f"/api/v1/nodes/{cast.node1.pk}/logs",
                            {"job": str(cast.job.pk), "generation": 1, "first_line": 0, "lines": ["x"]},
                            format="json")
    assert hooks.status_code == 403  # the training process holds no agent capability
    assert not LogLine.objects.exists()
    assert api(cast.tokens["agent"]).get(f"/api/v1/jobs/{cast.job.pk}/logs").status_code == 403  # no reading
    bad = api(cast.tokens["viewer"]).get(f"/api/v1/jobs/{cast.job.pk}/logs", {"rank": "one"})
    assert bad.status_code == 400 and bad.json()["errors"][0]["field"] == "rank"
    malformed = ship(api, cast, "not a list")
    assert malformed.status_code == 400 and malformed.json()["errors"][0]["field"] == "lines"


@pytest.mark.django_db
def test_a_generation_keeps_its_tail_within_the_cap_and_old_output_is_pruned(placed, api, settings):
    from django.utils import timezone

    from jobs import logs

    cast = placed
    settings.NIGHTWATCH = {**settings.NIGHTWATCH, "LOG_MAX_BYTES": 1000}
    for n in range(10):
        assert ship(api, cast, [f"{n:03d} " + "y" * 96 for _ in range(5)], first=5 * n).status_code == 202
    stream = LogStream.objects.get()
    kept = list(LogLine.objects.order_by("id").values_list("line", flat=True))
    assert stream.bytes <= 1000 and stream.bytes == sum(len(t) for t in LogLine.objects.values_list("text", flat=True))
    assert kept == list(range(50 - len(kept), 50)) and len(kept) >= 8  # the tail stays, the head went
    assert stream.dropped == 50 - len(kept)
    LogLine.objects.filter(line__lt=45).update(received_at=timezone.now() - timedelta(days=8))
    assert logs.prune() == len([n for n in kept if n < 45])
    assert list(LogLine.objects.order_by("id").values_list("line", flat=True)) == [45, 46, 47, 48, 49]
