"""A URL conf whose views find no free database connection, as under a reconnect storm: a page and
an API path, with the project's own error handlers (``tests/api/test_boundary.py``)."""

from __future__ import annotations

from django.db import OperationalError, connection
from django.urls import path
from psycopg.conninfo import make_conninfo
from psycopg_pool import ConnectionPool


def pool_exhausted() -> OperationalError:
    """The error Django raises when its psycopg pool stays empty for its whole timeout, made for
    real: a pool of one connection, held, asked for another."""
    db = connection.settings_dict
    conninfo = make_conninfo(dbname=db["NAME"], host=db["HOST"], port=db["PORT"] or None, user=db["USER"])
    with ConnectionPool(conninfo, min_size=1, max_size=1, timeout=0.2) as pool:
        held = pool.getconn()
        try:
            with connection.wrap_database_errors:
                pool.getconn()
        except OperationalError as error:
            return error
        finally:
            pool.putconn(held)
    raise AssertionError("the pool gave a second connection")


def busy(request):
    raise pool_exhausted()


urlpatterns = [path("jobs/", busy), path("api/v1/jobs", busy)]
handler500 = "controlplane.urls.server_error"
