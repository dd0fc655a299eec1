from django.urls import path

from nodes.api import views

urlpatterns = [
    path("nodes", views.NodeList.as_view(), name="node-list"),
    path("gpus", views.GPUList.as_view(), name="gpu-list"),
    path("nodes/<int:pk>", views.NodeDetail.as_view(), name="node-detail"),
    path("nodes/<int:pk>/drain", views.NodeDrain.as_view(), name="node-drain"),
    path("nodes/<int:pk>/undrain", views.NodeUndrain.as_view(), name="node-undrain"),
    path("nodes/<int:pk>/clear-lemon", views.NodeClearLemon.as_view(), name="node-clear-lemon"),
    path("nodes/<int:pk>/commands", views.NodeCommands.as_view(), name="node-commands"),
    path("nodes/<int:pk>/health-check", views.NodeHealthCheck.as_view(), name="node-health-check"),
    path("nodes/<int:pk>/bootstrap-token", views.NodeBootstrapToken.as_view(), name="node-bootstrap-token"),
    # What the node agent calls (agents.protocol.agent): its own node only.
    path("agents/register", views.AgentRegister.as_view(), name="agent-register"),
    path("nodes/<int:node_id>/heartbeat", views.AgentHeartbeat.as_view(), name="agent-heartbeat"),
    path("nodes/<int:node_id>/telemetry", views.AgentTelemetry.as_view(), name="agent-telemetry"),
    path("nodes/<int:node_id>/events", views.AgentEvents.as_view(), name="agent-events"),
    # The long poll (an async view: a waiting agent holds no thread); AgentCommandWait documents it.
    path("nodes/<int:node_id>/commands/wait", views.command_wait, name="agent-command-wait"),
    path("nodes/<int:node_id>/commands/<int:command_id>/ack", views.AgentCommandAck.as_view(), name="agent-ack"),
]
