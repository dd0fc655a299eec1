"""What a launch runs: the torchrun command line, its fixed environment, the files it may name."""

from __future__ import annotations

import sys
from pathlib import Path

#: The agent's own interpreter: torch is installed next to the agent on a GPU node.
DEFAULT_TORCHRUN = (sys.executable, "-m", "torch.distributed.run")
#: torch 2.13 shares the rendezvous store across restarts and restarted workers then dial a dead
#: peer (see PLATFORM-NOTES). Unbuffered: a crash must not eat the last lines.
_TORCHRUN_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "PYTHONUNBUFFERED": "1"}


def _file_of(root: Path, name: str) -> bool:
    """Whether ``name`` is a regular file inside ``root`` once every symlink is resolved."""
    path = (root / name).resolve()
    return path.is_relative_to(root) and path != root and path.is_file()


#: Command line of the warm launcher; it only replaces the default torchrun, not a custom one.
WARM_LAUNCHER = (sys.executable, "-m", "agents.launcher")
