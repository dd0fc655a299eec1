"""The nodes app's periodic tasks, for ``CELERY_BEAT_SCHEDULE`` in ``controlplane/settings.py``.

The heartbeat sweep runs every ``HEARTBEAT_SWEEP_S`` (1 s), so a node is marked unreachable at most
that long after its deadline; ``expires`` drops a sweep that waited in the queue past the next ones.
Once per heartbeat interval (5 s) was too slow for issue 18's target (node death found within the
heartbeat timeout + 2 s): a node that died just after a heartbeat was found up to 5 s after its
deadline (bench.fleet, 2026-12-02: 18.7 s at 64 nodes, 4.4 s after the deadline). A sweep is one
query on the ``heartbeat_deadline`` index that finds nothing in the usual second, so its cost does
not grow with the fleet.
"""

from __future__ import annotations

from core.env import env_bool, env_float, env_str

HEARTBEAT_SWEEP_S = env_float("NIGHTWATCH_HEARTBEAT_SWEEP_INTERVAL_S", 1.0)
#: How often Slurm's job and node states are read (each read is one squeue / sinfo call).
SLURM_POLL_S = float(env_str("NIGHTWATCH_SLURM_POLL_INTERVAL_S", "2"))

#: Run once as beat starts, not first an interval later: the telemetry partitions of the coming hours
#: (a fresh deployment, or a database restored from an older dump, has at most the hour it was
#: migrated in, and samples would land in the default partition for up to 10 minutes).
AT_START: tuple[str, ...] = ("nodes.tasks.prepare_telemetry_partitions",)

BEAT_SCHEDULE: dict = {
    "nodes-expire-heartbeats": {
        "task": "nodes.tasks.expire_heartbeats",
        "schedule": HEARTBEAT_SWEEP_S,
        "options": {"expires": 3 * HEARTBEAT_SWEEP_S},
    },
    "nodes-prune-telemetry": {
        "task": "nodes.tasks.prune_telemetry",
        "schedule": 3600.0,
        "options": {"expires": 3600},
    },
    # Raw partitions are made six hours ahead: a beat down for less than that loses nothing to the
    # default partition.
    "nodes-prepare-telemetry-partitions": {
        "task": "nodes.tasks.prepare_telemetry_partitions",
        "schedule": 600.0,
        "options": {"expires": 600},
    },
    "nodes-roll-up-telemetry": {
        "task": "nodes.tasks.roll_up_telemetry",
        "schedule": 60.0,
        "options": {"expires": 60},
    },
}

if env_bool("NIGHTWATCH_SLURM_ENABLED", False):
    BEAT_SCHEDULE |= {
        "nodes-slurm-jobs": {"task": "nodes.tasks.poll_slurm_jobs", "schedule": SLURM_POLL_S,
                             "options": {"expires": 2 * SLURM_POLL_S}},
        "nodes-slurm-nodes": {"task": "nodes.tasks.mirror_slurm_nodes", "schedule": 5 * SLURM_POLL_S,
                              "options": {"expires": 10 * SLURM_POLL_S}},
    }
