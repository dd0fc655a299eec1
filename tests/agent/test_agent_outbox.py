"""The outbox's delivery rules, against a spool on disk and a control plane that judges batches."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from agents.agent.outbox import Outbox
from agents.protocol.agent import EVENTS_PATH, XidDetail


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
