from django.apps import AppConfig


class CoreConfig(AppConfig):
    """The bottom layer every app may import: the audit log's vocabulary and its one writer."""

    name = "core"
