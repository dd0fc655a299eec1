"""``python -m agents.agent`` / ``nightwatch-agent``: run the node agent until SIGTERM or SIGINT."""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Sequence
from types import FrameType

from agents import jsonlog
from agents.agent.config import ConfigError, load_config
from agents.agent.daemon import Agent


def main(argv: Sequence[str] | None = None) -> int:
    try:
        config = load_config(argv)
    except ConfigError as exc:
        print(f"nightwatch-agent: {exc}", file=sys.stderr)
        return 2
    # JSON lines carrying this node's hostname (and job/generation where bound); NIGHTWATCH_LOG_FORMAT=plain
    # for reading at a terminal.
    jsonlog.configure(config.log_level.upper(), service="agent", node=config.hostname,
                      fmt=os.environ.get("NIGHTWATCH_LOG_FORMAT", "json"))
    agent = Agent(config)

    def request_stop(signum: int, frame: FrameType | None) -> None:
        logging.getLogger(__name__).info("signal %d: stopping", signum)
        agent.stop()

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    return agent.run()


if __name__ == "__main__":
    sys.exit(main())
