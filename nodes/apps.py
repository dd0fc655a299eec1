from django.apps import AppConfig


class NodesConfig(AppConfig):
    name = "nodes"
    verbose_name = "GPU nodes"
