"""``dashboard.events``: the shapes pushed to browsers, and reducing step reports to chart points."""

from __future__ import annotations

from types import SimpleNamespace

from dashboard import events


def row(rank, step, loss, *, generation=1, grad_norm=1.0, spike=False, skipped=False, nan=False):
    return SimpleNamespace(rank=rank, step=step, loss=loss, generation=generation, grad_norm=grad_norm,
                           spike=spike, skipped=skipped, nan=nan)


def test_one_point_per_step_with_rank_zeros_loss_and_any_ranks_flags():
    points = events.points_from_rows([row(1, 5, 2.5, spike=True), row(0, 5, 2.0), row(0, 4, 2.2, skipped=True),
                                      row(1, 4, 2.3)])
    assert [(p.step, p.rank, p.loss, p.spike, p.skipped) for p in points] == [
        (4, 0, 2.2, False, True), (5, 0, 2.0, True, False)]


def test_generations_are_kept_apart():
    points = events.points_from_rows([row(0, 3, 1.0, generation=1), row(0, 3, 1.5, generation=2)])
    assert [(p.generation, p.loss) for p in points] == [(1, 1.0), (2, 1.5)]


def test_frames_and_messages_have_their_documented_shape():
    point = events.Point(step=1, generation=1, rank=0, loss=1.0, grad_norm=None)
    message = events.push_message(message_id="a-1", job_id=7, points=[point], sections=["banner", "banner"],
                                  relayed_at=1.0)
    assert message == {"type": "dashboard.push", "id": "a-1", "job": 7, "sections": ["banner"], "relayed_at": 1.0,
                       "nodes": [], "points": [{"step": 1, "generation": 1, "rank": 0, "loss": 1.0, "grad_norm": None,
                                   "spike": False, "skipped": False, "nan": False}]}
    assert set(events.snapshot_frame("job", {}, None)) == {"type", "page", "html", "chart"}
    assert set(events.update_frame(points=[], html={}, chart=None, relayed_at=0)) == {
        "type", "points", "html", "chart", "relayed_at"}
    assert events.job_group(7) == "job.7"
