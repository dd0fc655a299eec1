"""A populated control plane for the API tests: the shared cast plus a generation, an incident and
checkpoints, so that detail endpoints and actions have real objects to answer about."""

from __future__ import annotations

from dataclasses import dataclass

import pytest


@dataclass
class World:
    cast: object
    generation: object
    incident: object
    checkpoint: object
    paused_job: object


@pytest.fixture
def world(cast, tmp_path):
    from checkpoints.models import Checkpoint
    from jobs.models import Generation, Incident, Job

    job = cast.job
    generation = Generation.objects.create(job=job, number=1, world_size=2, state="running")
    generation.nodes.add(cast.node1)
    incident = Incident.objects.create(job=job, generation=generation, kind="crash", classification="rank exited",
                                       decision="restart", evidence={"exit_codes": {"1": -9},
                                                                     "log_tail": ["step 7", "Killed"]})
    incident.nodes.add(cast.node1)
    checkpoint = Checkpoint.objects.create(job=job, generation=generation, step=10, state="verified",
                                           location=str(tmp_path / "ckpt" / "step-10"), data_cursor=320)
    paused = Job.objects.create(name="stuck", entrypoint="examples/train.py", state="paused",
                                pause_reason="circuit breaker open", created_by="test")
    return World(cast, generation, incident, checkpoint, paused)
