from rest_framework import generics

from controlplane import roles
from nodes.api.serializers import NodeSerializer
from nodes.models import Node


class NodeList(generics.ListAPIView):
    """Nodes with their GPUs; filter with ``?health=`` and ``?schedulability=``."""

    required = roles.VIEW
    serializer_class = NodeSerializer

    def get_queryset(self):
        nodes = Node.objects.prefetch_related("gpus")
        for name in ("health", "schedulability"):
            if value := self.request.query_params.get(name):
                nodes = nodes.filter(**{f"{name}__in": value.split(",")})
        return nodes


class NodeDetail(generics.RetrieveAPIView):
    required = roles.VIEW
    serializer_class = NodeSerializer
    queryset = Node.objects.prefetch_related("gpus")
