from django.apps import AppConfig
from django.db.models.signals import post_migrate


class CoreConfig(AppConfig):
    """The bottom layer every app may import: the audit log, credentials, roles, authentication, the
    API's problem errors and helpers, and the env/log helpers."""

    name = "core"

    def ready(self):
        # At ready(), not at the top: both import auth's Group and Permission (schema through core.roles),
        # and models need the app registry loaded.
        from core import schema  # noqa: F401  (registers the token auth scheme with drf-spectacular)
        from core.roles import ensure_roles

        post_migrate.connect(ensure_roles, dispatch_uid="nightwatch.ensure_roles")
