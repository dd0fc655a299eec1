from django.apps import AppConfig


class JobsConfig(AppConfig):
    name = "jobs"
    verbose_name = "Training jobs"

    def ready(self):
        from jobs import receivers  # noqa: F401  (connects to the nodes app's signals)
