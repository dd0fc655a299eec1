"""The Slurm transport: Slurm allocates and launches, Nightwatch watches, decides and asks Slurm to act.

- ``cli``: the one adapter every Slurm command goes through (typed errors, parsed output);
- ``script``: a generation as ``sbatch`` options and a batch script (pure);
- ``launch``: ``SlurmTransport`` (launch/stop), ``submit`` (sbatch) and ``cancel`` (scancel);
- ``watch``: the exit-detection one-shot, which feeds the orchestrator like an agent's exit report;
- ``mirror``: the node-state one-shot (health, drains both ways without ping-pong);
- ``controller``: whether Slurm answers — the degraded state and the back-off.
"""

from nodes.transports.slurm.launch import SlurmTransport

__all__ = ["SlurmTransport"]
