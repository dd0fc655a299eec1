from django.apps import AppConfig


class AlertsConfig(AppConfig):
    name = "alerts"
    verbose_name = "Alerts and efficiency"

    def ready(self):
        from alerts import checks, signals  # noqa: F401  (system checks; listens to jobs' events and incidents)
