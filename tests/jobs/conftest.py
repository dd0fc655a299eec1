import pytest


@pytest.fixture
def eager_celery():
    """Run tasks enqueued on commit inline, so a service's follow-up work happens in the test."""
    from controlplane.celery import app

    app.conf.task_always_eager = True
    yield
    app.conf.task_always_eager = False
