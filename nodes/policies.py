"""When a node is a lemon, typed: the fleet's failure policy for blaming nodes.

The defaults are written here and nowhere else; ``NIGHTWATCH["LEMON_…"]`` (environment
``NIGHTWATCH_LEMON_…``) overrides each. Every reader goes through ``LemonPolicy.current()``:
placement (``jobs.launching``), the Slurm exclusion list, the orchestrator's blame, and the undrain
warning.

- A node's ``lemon_count`` counts the incidents it was blamed for. At ``incidents`` or more it is a
  lemon: placement never picks it, drained or not, until an operator clears the count
  (``nodes.services.clear_lemon``: API ``POST /api/v1/nodes/<id>/clear-lemon``, CLI
  ``nightwatch clear-lemon``, the dashboard's **Clear lemon**). An undrain alone does not make it
  placeable again, and says so.
- Hardware incidents blame the nodes they name; ``incidents`` of them within ``window_s`` also
  drain the node.
- A crash blames no node by itself (a program's bug is not the node's fault), but crashes of
  ``crash_jobs`` *different* jobs on one node within ``crash_window_s`` point at the node: it is
  blamed once for each further job that crashes there, and drained as suspect.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from django.conf import settings

#: Settings keys (``NIGHTWATCH[...]``) of each field.
SETTINGS_KEYS = {"incidents": "LEMON_INCIDENTS", "window_s": "LEMON_WINDOW_S", "crash_jobs": "LEMON_CRASH_JOBS",
                 "crash_window_s": "LEMON_CRASH_WINDOW_S"}


@dataclass(frozen=True)
class LemonPolicy:
    #: Blamed this many times, a node is a lemon: kept out of placement until cleared.
    incidents: int = 3
    #: Hardware incidents this close together drain the node as a lemon.
    window_s: int = 7 * 24 * 3600
    #: Crashes of this many different jobs on one node inside ``crash_window_s`` blame the node.
    crash_jobs: int = 3
    crash_window_s: int = 24 * 3600

    @classmethod
    def of(cls, nightwatch: Mapping[str, Any]) -> LemonPolicy:
        """The policy from a ``NIGHTWATCH`` settings mapping; a key it lacks keeps the default."""
        return cls(**{name: int(nightwatch[key]) for name, key in SETTINGS_KEYS.items()
                      if nightwatch.get(key) is not None})

    @classmethod
    def current(cls) -> LemonPolicy:
        return cls.of(settings.NIGHTWATCH)

    def is_lemon(self, lemon_count: int) -> bool:
        return lemon_count >= self.incidents

    def warning(self, hostname: str, lemon_count: int) -> str | None:
        """What an undrain of a lemon answers and records; None for a node that is not one."""
        if not self.is_lemon(lemon_count):
            return None
        return (f"{hostname} is a lemon (blamed in {lemon_count} incidents, threshold {self.incidents}): placement "
                "keeps it out until an operator clears its lemon count (clear-lemon)")
