"""The wire protocol between training hooks, node agents and the control plane.

Defined once here and validated on both sides (``parse``). ``hooks`` holds what ``train.py``
sends and receives; ``agent`` holds what the node agent sends and receives.
"""

from agents.protocol.base import ProtocolError, dump, field, parse

__all__ = ["ProtocolError", "dump", "field", "parse"]
