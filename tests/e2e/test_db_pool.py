"""Database connections under daphne, with and without the pool (DB_POOL_MAX_SIZE).

Counted from PostgreSQL's side (``pg_stat_activity``, by the ``application_name`` each server is
given through libpq's ``PGAPPNAME``): with the pool a burst of requests shares at most
``DB_POOL_MAX_SIZE`` connections, which stay open for the next burst; without it each request opens
and closes its own, so none is left between requests.
"""

from __future__ import annotations

import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from django.db import connection

from tests.e2e.cluster import Cluster
from tests.e2e.conftest import REDIS_DB
from tests.waiting import wait_for


def open_connections(application_name: str) -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name = %s", [application_name])
        return cursor.fetchone()[0]


def burst(url: str, requests: int = 24) -> list[int]:
    def get(_):
        with urllib.request.urlopen(f"{url}/readyz", timeout=30) as response:  # noqa: S310 - loopback
            return response.status

    with ThreadPoolExecutor(max_workers=8) as pool:
        return list(pool.map(get, range(requests)))


@pytest.mark.parametrize("pool_size", [2, 0])
def test_a_burst_of_requests_shares_the_pools_connections(transactional_db, tmp_path, pool_size):
    name = f"nw-db-pool-{pool_size}"
    settings = {"PGAPPNAME": name, **({"DB_POOL_MAX_SIZE": str(pool_size)} if pool_size else {})}
    cluster = Cluster(tmp_path, database_name=connection.settings_dict["NAME"], redis_db=REDIS_DB, settings=settings)
    try:
        cluster.start_web()
        for _ in range(2):
            assert burst(cluster.url) == [200] * 24  # readyz queries the database on every request
            if pool_size:
                # kept open between bursts, never more than the pool's bound
                wait_for(lambda: 1 <= open_connections(name) <= pool_size, timeout=10,
                         what="the pool's connections to stay open and bounded")
            else:
                wait_for(lambda: open_connections(name) == 0, timeout=10,
                         what="every per-request connection to close")
    finally:
        cluster.close()
