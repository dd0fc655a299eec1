from django.apps import AppConfig


class JobsConfig(AppConfig):
    name = "jobs"
    verbose_name = "Training jobs"

    def ready(self):
        # Deferred to ready(): the receivers import models, which the app registry must load first.
        from jobs import receivers  # connects to the nodes app's signals
        from nodes import workload

        workload.register(receivers.WORKLOAD)
