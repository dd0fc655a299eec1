from django.apps import AppConfig


class AlertsConfig(AppConfig):
    name = "alerts"
    verbose_name = "Alerts"

    def ready(self):
        # At ready(), not at the top: signals imports the models, which need the app registry loaded.
        from alerts import checks, signals  # noqa: F401  (system checks; listens to jobs' events and incidents)
