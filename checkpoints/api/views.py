from rest_framework import generics

from checkpoints.api.serializers import CheckpointSerializer
from checkpoints.models import Checkpoint
from controlplane import roles


class CheckpointList(generics.ListAPIView):
    """Checkpoints, newest step first; filter with ``?job=`` and ``?state=``."""

    required = roles.VIEW
    serializer_class = CheckpointSerializer

    def get_queryset(self):
        checkpoints = Checkpoint.objects.select_related("generation").order_by("-step", "-pk")
        if job := self.request.query_params.get("job"):
            if not job.isdigit():
                from rest_framework.exceptions import ValidationError

                raise ValidationError({"job": ["Must be a job id (an integer)."]})
            checkpoints = checkpoints.filter(job_id=int(job))
        if state := self.request.query_params.get("state"):
            checkpoints = checkpoints.filter(state__in=state.split(","))
        return checkpoints


class CheckpointDetail(generics.RetrieveAPIView):
    required = roles.VIEW
    serializer_class = CheckpointSerializer
    queryset = Checkpoint.objects.select_related("generation")
