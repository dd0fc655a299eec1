from django.apps import AppConfig
from django.db.models.signals import post_migrate


class ControlPlaneConfig(AppConfig):
    name = "controlplane"
    verbose_name = "Nightwatch control plane"

    def ready(self):
        from controlplane import checks, schema  # noqa: F401  (register the checks and the auth scheme)
        from controlplane.roles import ensure_roles

        post_migrate.connect(ensure_roles, dispatch_uid="nightwatch.ensure_roles")
