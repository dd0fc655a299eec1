from django.apps import AppConfig


class ControlPlaneConfig(AppConfig):
    """The project: settings, URLs, ASGI/WSGI, the Celery app, routing and the deployment checks.

    Its migrations stay: they created the token and idempotency tables that ``core`` now owns.
    """

    name = "controlplane"
    verbose_name = "Nightwatch control plane"

    def ready(self):
        # At ready(), Django's place for registering system checks: importing the module registers them.
        from controlplane import checks  # noqa: F401  (registers the deployment checks)
