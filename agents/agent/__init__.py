"""The Nightwatch node agent (``python -m agents.agent``, or the ``nightwatch-agent`` script).

``daemon.Agent`` is the loop; ``config`` reads its settings; ``registration`` trades the
bootstrap token for a node token; ``outbox`` spools and replays what is reported;
``commands`` executes commands once per idempotency key.
"""

from agents.agent.config import AgentConfig, ConfigError, load_config
from agents.agent.daemon import Agent

__all__ = ["Agent", "AgentConfig", "ConfigError", "load_config"]
