"""The dashboard's Clear lemon button (where Drain / Undrain are) and the undrain warning for a lemon."""

from __future__ import annotations


def test_clear_lemon_is_its_own_audited_action_and_undrain_of_a_lemon_warns(signed_in, cast):
    from jobs.models import Event
    from nodes.models import Node

    Node.objects.filter(pk=cast.node1.pk).update(lemon_count=3, schedulability="drained")
    operator = signed_in(cast.operator)
    for page in (f"/nodes/{cast.node1.pk}/", "/nodes/"):
        assert ">Clear lemon</button>" in operator.get(page).content.decode(), page
    assert ">Clear lemon</button>" not in signed_in(cast.viewer).get(f"/nodes/{cast.node1.pk}/").content.decode()

    answer = operator.post(f"/nodes/{cast.node1.pk}/undrain", {"reason": "back"}).json()
    assert answer["ok"] and "undrained, but gpu-01 is a lemon" in answer["message"]
    assert Node.objects.get(pk=cast.node1.pk).lemon_count == 3  # an undrain clears nothing

    answer = operator.post(f"/nodes/{cast.node1.pk}/clear-lemon", {"reason": "PSU replaced"}).json()
    assert answer == {"ok": True, "message": "gpu-01: lemon count 3 cleared; placement may pick it again"}
    assert Node.objects.get(pk=cast.node1.pk).lemon_count == 0
    assert Event.objects.filter(kind="node.lemon_cleared", node=cast.node1, actor="user:otto").exists()
    again = operator.post(f"/nodes/{cast.node1.pk}/clear-lemon", {"reason": "again"})
    assert again.status_code == 409 and "no lemon count" in again.json()["detail"]
    assert signed_in(cast.viewer).post(f"/nodes/{cast.node1.pk}/clear-lemon", {"reason": "x"}).status_code == 403
