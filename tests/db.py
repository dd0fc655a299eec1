"""For tests that watch the database from outside while the code under test holds a transaction:
a second connection of their own, and the code run in a thread with its own Django connection."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import psycopg
from django.db import connection


def other_connection() -> psycopg.Connection:
    """A plain psycopg connection to the test database, outside Django (close it yourself)."""
    db = connection.settings_dict
    return psycopg.connect(dbname=db["NAME"], host=db["HOST"] or None, port=db["PORT"] or None,
                           user=db["USER"] or None, password=db["PASSWORD"] or None)


class InThread:
    """``fn()`` in a thread: ``outcome`` holds its result or its exception once it ended."""

    def __init__(self, fn: Callable[[], Any]):
        self.outcome: list[Any] = []
        self.thread = threading.Thread(target=self._run, args=(fn,))

    def _run(self, fn: Callable[[], Any]) -> None:
        from django.db import connection as thread_connection

        try:
            self.outcome.append(fn())
        except Exception as error:  # noqa: BLE001 - handed to the test's thread
            self.outcome.append(error)
        finally:
            thread_connection.close()

    def start(self) -> None:
        self.thread.start()

    def join(self, timeout: float) -> Any:
        """The result, once the thread ended within ``timeout`` (its exception is raised here)."""
        self.thread.join(timeout=timeout)
        assert not self.thread.is_alive(), f"still running after {timeout} s"
        [result] = self.outcome
        if isinstance(result, Exception):
            raise result
        return result
