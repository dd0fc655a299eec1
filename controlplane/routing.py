"""WebSocket routes; each app contributes its consumers here."""

from django.urls import path

from dashboard import consumers

websocket_urlpatterns: list = [
    path("ws/dashboard/overview/", consumers.OverviewConsumer.as_asgi()),
    path("ws/dashboard/jobs/<int:job_id>/", consumers.JobConsumer.as_asgi()),
    path("ws/dashboard/nodes/", consumers.NodesConsumer.as_asgi()),
    path("ws/dashboard/nodes/<int:node_id>/", consumers.NodeConsumer.as_asgi()),
]
