"""``python -m agents.agent`` / ``nightwatch-agent``: run the node agent until SIGTERM or SIGINT."""

from __future__ import annotations

import logging
import signal
import sys
from collections.abc import Sequence
from types import FrameType

from agents.agent.config import ConfigError, load_config
from agents.agent.daemon import Agent


def main(argv: Sequence[str] | None = None) -> int:
    try:
        config = load_config(argv)
    except ConfigError as exc:
        print(f"nightwatch-agent: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=config.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    agent = Agent(config)

    def request_stop(signum: int, frame: FrameType | None) -> None:
        logging.getLogger(__name__).info("signal %d: stopping", signum)
        agent.stop()

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    return agent.run()


if __name__ == "__main__":
    sys.exit(main())
