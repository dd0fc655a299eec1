"""Nightwatch training hooks: verified checkpoints, exact resume, guards and reporting in ``train.py``.

    from agents.hooks import Hooks

    nw = Hooks(model, optimizer, scheduler=scheduler, dataset=dataset, batch_size=8, ckpt_dir="ckpt",
               checkpoint_every=100, config=vars(args))
    for batch in nw.batches(max_steps=args.steps):
        loss = compute_loss(model, batch)
        loss.backward()
        nw.step(loss)
    nw.close()

See docs/hooks.md for the user's guide. Names are imported on first use, so that the control
plane can use ``agents.hooks.manifest.verify`` without importing torch until it reads DCP metadata.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "Hooks": "agents.hooks.api",
    "StepOutcome": "agents.hooks.api",
    "StopTraining": "agents.hooks.api",
    "config_fingerprint": "agents.hooks.api",
    "GlobalCursorSampler": "agents.hooks.data",
    "GuardSettings": "agents.hooks.guards",
    "Verdict": "agents.hooks.manifest",
    "latest_verified": "agents.hooks.manifest",
    "verify": "agents.hooks.manifest",
    "Environment": "agents.hooks.settings",
}

#: Submodules a script may use by name (``from agents.hooks import inprocess``).
_MODULES = {"inprocess"}

__all__ = [
    "Environment",
    "GlobalCursorSampler",
    "GuardSettings",
    "Hooks",
    "StepOutcome",
    "StopTraining",
    "Verdict",
    "config_fingerprint",
    "inprocess",
    "latest_verified",
    "verify",
]

if TYPE_CHECKING:
    from agents.hooks import inprocess
    from agents.hooks.api import Hooks, StepOutcome, StopTraining, config_fingerprint
    from agents.hooks.data import GlobalCursorSampler
    from agents.hooks.guards import GuardSettings
    from agents.hooks.manifest import Verdict, latest_verified, verify
    from agents.hooks.settings import Environment


def __getattr__(name: str) -> Any:
    if name in _MODULES:
        return importlib.import_module(f"agents.hooks.{name}")
    if name not in _EXPORTS:
        raise AttributeError(f"module 'agents.hooks' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
