"""The outbox's delivery rules, against a spool on disk and a control plane that judges batches."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from agents.agent.outbox import Outbox
from agents.http import Unreachable
from agents.protocol.agent import (
    ACK_PATH,
    EVENTS_PATH,
    MAX_SAMPLES_PER_BATCH,
    TELEMETRY_PATH,
    CommandAck,
    GpuSample,
    XidDetail,
)


class JudgingControlPlane:
    """Refuses (422) any batch holding an Xid event with a code in ``poison``, like the real
    endpoint refuses a whole batch when one record is malformed; records what it accepted."""

    def __init__(self, poison: set[int]) -> None:
        self.poison = poison
        self.accepted: list[str] = []
        self.requests = 0

    def request(self, method: str, path: str, body: Any = None, headers: Any = None) -> tuple[int, dict]:
        assert (method, path) == ("POST", EVENTS_PATH.format(node_id="n1"))
        self.requests += 1
        events = body["events"]
        if any(event["detail"]["code"] in self.poison for event in events):
            return 422, {"title": "invalid event"}
        self.accepted += [event["key"] for event in events]
        return 200, {}


def test_one_malformed_record_is_dropped_alone_and_order_is_kept(tmp_path: Path) -> None:
    outbox = Outbox(tmp_path / "spool.sqlite3", max_records=1000)
    keys = [outbox.add_event("xid", XidDetail(gpu=0, code=i), key=f"e{i}").key for i in range(20)]
    server = JudgingControlPlane(poison={5, 6})

    delivered = outbox.flush(server, "n1", on_stale_ack=lambda ack: None)

    assert server.accepted == [k for i, k in enumerate(keys) if i not in (5, 6)]
    assert delivered == 18 and len(outbox) == 0
    # Splitting costs a few requests (one batch, then halves down to the bad pair), not one per record.
    assert server.requests < 12
    outbox.close()


class SheddingControlPlane:
    """Accepts events and acks, refuses telemetry as an overloaded control plane sheds bulk data
    (503 + Retry-After, which the client raises as ``Unreachable``); records every request's path."""

    def __init__(self) -> None:
        self.paths: list[str] = []
        self.events: list[str] = []

    def request(self, method: str, path: str, body: Any = None, headers: Any = None) -> tuple[int, dict]:
        self.paths.append(path)
        if path == TELEMETRY_PATH.format(node_id="n1"):
            raise Unreachable("503: overloaded", retry_after=2.0)
        self.events += [event["key"] for event in body["events"]]
        return 200, {}


def test_an_xid_behind_a_telemetry_backlog_goes_first_and_the_backlog_is_kept(tmp_path: Path) -> None:
    outbox = Outbox(tmp_path / "spool.sqlite3", max_records=10_000)
    outbox.add_samples([sample(t) for t in range(3 * MAX_SAMPLES_PER_BATCH)])  # an outage's worth
    outbox.add_event("xid", XidDetail(gpu=3, code=79), key="xid-1")
    outbox.add_event("xid", XidDetail(gpu=4, code=79), key="xid-2")
    server = SheddingControlPlane()

    with pytest.raises(Unreachable):
        outbox.flush(server, "n1", on_stale_ack=lambda ack: None)

    assert server.paths[0] == EVENTS_PATH.format(node_id="n1")
    assert server.events == ["xid-1", "xid-2"]  # in their own order, one request
    assert len(outbox) == 3 * MAX_SAMPLES_PER_BATCH  # the refused telemetry waits in the spool
    outbox.close()


def test_the_urgent_lane_alone_and_which_lane_a_refusal_came_from(tmp_path: Path) -> None:
    outbox = Outbox(tmp_path / "spool.sqlite3", max_records=10_000)
    outbox.add_samples([sample(t) for t in range(10)])
    outbox.add_event("xid", XidDetail(gpu=3, code=79), key="xid-1")
    server = SheddingControlPlane()

    # While telemetry backs off, the daemon sends the urgent lane alone: telemetry is not even tried.
    assert outbox.flush(server, "n1", on_stale_ack=lambda ack: None, bulk=False) == 1
    assert server.paths == [EVENTS_PATH.format(node_id="n1")] and not outbox.urgent
    assert len(outbox) == 10

    # Telemetry refused after the urgent lane went: ``urgent`` says the urgent lane is not to back off.
    outbox.add_event("xid", XidDetail(gpu=4, code=79), key="xid-2")
    with pytest.raises(Unreachable):
        outbox.flush(server, "n1", on_stale_ack=lambda ack: None)
    assert server.events == ["xid-1", "xid-2"] and not outbox.urgent

    # The urgent lane itself refused: it stays urgent, for the daemon to back off both.
    outbox.add_event("xid", XidDetail(gpu=5, code=79), key="xid-3")
    with pytest.raises(Unreachable):
        outbox.flush(DownControlPlane(), "n1", on_stale_ack=lambda ack: None, bulk=False)
    assert outbox.urgent and len(outbox) == 11
    outbox.close()


class DownControlPlane:
    def request(self, method: str, path: str, body: Any = None, headers: Any = None) -> tuple[int, dict]:
        raise Unreachable("connection refused")


def test_the_urgent_lane_is_drained_again_before_each_telemetry_batch(tmp_path: Path) -> None:
    outbox = Outbox(tmp_path / "spool.sqlite3", max_records=10_000)
    outbox.add_samples([sample(t) for t in range(2 * MAX_SAMPLES_PER_BATCH)])
    sent: list[str] = []

    class Server:
        def request(self, method: str, path: str, body: Any = None, headers: Any = None) -> tuple[int, dict]:
            sent.append("telemetry" if "samples" in body else "events")
            if len(sent) == 1:  # an exit noticed while the first telemetry batch is on its way
                outbox.add_event("xid", XidDetail(gpu=0, code=79), key="late")
            return 200, {}

    assert outbox.flush(Server(), "n1", on_stale_ack=lambda ack: None) == 2 * MAX_SAMPLES_PER_BATCH + 1
    assert sent == ["telemetry", "events", "telemetry"]
    assert len(outbox) == 0
    outbox.close()


class RecordingControlPlane:
    """Takes everything; records each request's path."""

    def __init__(self) -> None:
        self.paths: list[str] = []

    def request(self, method: str, path: str, body: Any = None, headers: Any = None) -> tuple[int, dict]:
        self.paths.append(path)
        return 200, {}


class CountingDownControlPlane(DownControlPlane):
    def __init__(self, status: int | None = None, retry_after: float | None = None) -> None:
        self.tries, self.status, self.retry_after = 0, status, retry_after

    def request(self, method: str, path: str, body: Any = None, headers: Any = None) -> tuple[int, dict]:
        self.tries += 1
        raise Unreachable("no answer", status=self.status, retry_after=self.retry_after)


def test_the_urgent_lane_goes_to_its_own_url_and_the_bulk_lane_does_not(tmp_path: Path) -> None:
    outbox = Outbox(tmp_path / "spool.sqlite3", max_records=10_000)
    outbox.add_samples([sample(t) for t in range(10)])
    outbox.add_event("xid", XidDetail(gpu=3, code=79), key="xid-1")
    outbox.add_ack(CommandAck(command_id="c1", idempotency_key="k1", status="done", time=1_700_000_000.0))
    main, urgent = RecordingControlPlane(), RecordingControlPlane()

    assert outbox.flush(main, "n1", on_stale_ack=lambda ack: None, urgent_client=urgent) == 12
    assert urgent.paths == [EVENTS_PATH.format(node_id="n1"), ACK_PATH.format(node_id="n1", command_id="c1")]
    assert main.paths == [TELEMETRY_PATH.format(node_id="n1")]
    outbox.close()


@pytest.mark.parametrize("status", [None, 502, 504])  # no response; a proxy saying the process did not answer
def test_an_urgent_url_that_does_not_answer_is_no_single_point_of_failure(tmp_path: Path, monkeypatch,
                                                                          status: int | None) -> None:
    outbox = Outbox(tmp_path / "spool.sqlite3", max_records=10_000)
    main, down = RecordingControlPlane(), CountingDownControlPlane(status=status)
    outbox.add_event("xid", XidDetail(gpu=3, code=79), key="xid-1")

    # No answer there: the same event goes to the control plane's URL in the same flush.
    assert outbox.flush(main, "n1", on_stale_ack=lambda ack: None, urgent_client=down) == 1
    assert down.tries == 1 and main.paths == [EVENTS_PATH.format(node_id="n1")] and len(outbox) == 0

    # Meanwhile the urgent URL is not tried (a timeout there would delay every event) ...
    outbox.add_event("xid", XidDetail(gpu=4, code=79), key="xid-2")
    outbox.flush(main, "n1", on_stale_ack=lambda ack: None, urgent_client=down)
    assert down.tries == 1 and len(main.paths) == 2

    # ... until its retry time: then it is, and takes the lane again once it answers.
    monkeypatch.setattr(outbox, "_urgent_retry_at", 0.0)
    back = RecordingControlPlane()
    outbox.add_event("xid", XidDetail(gpu=5, code=79), key="xid-3")
    outbox.flush(main, "n1", on_stale_ack=lambda ack: None, urgent_client=back)
    assert back.paths == [EVENTS_PATH.format(node_id="n1")] and len(main.paths) == 2
    outbox.close()


def test_an_urgent_url_that_refuses_is_waited_out_not_gone_around(tmp_path: Path) -> None:
    """A 503 with ``Retry-After`` is the urgent processes' admission control answering: sending the
    lane to the ingest processes instead would take away what the split is for."""
    outbox = Outbox(tmp_path / "spool.sqlite3", max_records=10_000)
    main, shedding = RecordingControlPlane(), CountingDownControlPlane(status=503, retry_after=1.0)
    outbox.add_event("xid", XidDetail(gpu=3, code=79), key="xid-1")

    with pytest.raises(Unreachable):
        outbox.flush(main, "n1", on_stale_ack=lambda ack: None, urgent_client=shedding)
    assert shedding.tries == 1 and main.paths == [] and outbox.urgent and len(outbox) == 1
    outbox.close()


def sample(t: int) -> GpuSample:
    return GpuSample(node="n1", gpu=t % 8, time=1_700_000_000.0 + t, temperature_c=50.0, utilization_pct=90.0)
