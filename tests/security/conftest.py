"""Fixtures of the security tests: each attack runs against the real server.

The control plane here is the end-to-end ``Cluster`` (daphne + a Celery worker with beat, on the test
PostgreSQL database and a private Redis database), and the cast is the same as the end-to-end tests'.
A test attacks through real HTTP and asserts that the attack fails cleanly: a 4xx, nothing acted on,
nothing outside its root read, written or deleted.
"""

from __future__ import annotations

from tests.e2e.conftest import cluster, tokens  # noqa: F401 - fixtures re-exported for tests/security
