"""Nightwatch training hooks: verified checkpoints, exact resume, guards and reporting in ``train.py``.

    from agents.hooks import Hooks

    nw = Hooks(model, optimizer, scheduler=scheduler, dataset=dataset, batch_size=8, ckpt_dir="ckpt",
               checkpoint_every=100, config=vars(args))
    for batch in nw.batches(max_steps=args.steps):
        loss = compute_loss(model, batch)
        loss.backward()
        nw.step(loss)
    nw.close()

See docs/hooks.md for the user's guide.
"""

from agents.hooks.api import Hooks, StepOutcome, StopTraining, config_fingerprint
from agents.hooks.data import GlobalCursorSampler
from agents.hooks.guards import GuardSettings
from agents.hooks.manifest import Verdict, latest_verified, verify
from agents.hooks.settings import Environment

__all__ = [
    "Environment",
    "GlobalCursorSampler",
    "GuardSettings",
    "Hooks",
    "StepOutcome",
    "StopTraining",
    "Verdict",
    "config_fingerprint",
    "latest_verified",
    "verify",
]
