from django.urls import path

from jobs.api import checkpoints, logs, views

urlpatterns = [
    path("jobs", views.JobListCreate.as_view(), name="job-list"),
    path("jobs/<int:pk>", views.JobDetail.as_view(), name="job-detail"),
    path("jobs/<int:pk>/status", views.JobStatus.as_view(), name="job-status"),
    path("jobs/<int:pk>/events", views.JobEvents.as_view(), name="job-events"),
    path("jobs/<int:pk>/cancel", views.JobCancel.as_view(), name="job-cancel"),
    path("jobs/<int:pk>/pause", views.JobPause.as_view(), name="job-pause"),
    path("jobs/<int:pk>/checkpoint", views.JobCheckpoint.as_view(), name="job-checkpoint"),
    path("jobs/<int:pk>/approve", views.JobApprove.as_view(), name="job-approve"),
    path("jobs/<int:pk>/rollback", views.JobRollback.as_view(), name="job-rollback"),
    path("jobs/<int:pk>/resize", views.JobResize.as_view(), name="job-resize"),
    path("jobs/<int:pk>/incidents", views.JobIncidents.as_view(), name="job-incidents"),
    path("jobs/<int:pk>/logs", logs.JobLogs.as_view(), name="job-logs"),
    # The node agents ship training output here (jobs.logs): a jobs endpoint under the node's URL.
    path("nodes/<int:node_id>/logs", logs.AgentLogs.as_view(), name="agent-logs"),
    path("jobs/<int:pk>/goodput", views.JobGoodput.as_view(), name="job-goodput"),
    path("jobs/<int:pk>/generations", views.JobGenerations.as_view(), name="job-generations"),
    path("jobs/<int:pk>/reports", views.JobReports.as_view(), name="job-reports"),
    path("jobs/<int:pk>/control", views.JobControl.as_view(), name="job-control"),
    # GET lists a job's checkpoints; POST is the hooks' commit report.
    path("jobs/<int:pk>/checkpoints", checkpoints.JobCheckpoints.as_view(), name="job-checkpoints"),
    path("jobs/<int:pk>/checkpoints/tree", checkpoints.JobCheckpointTree.as_view(), name="job-checkpoint-tree"),
    path("jobs/<int:pk>/checkpoints/retention", checkpoints.JobCheckpointRetention.as_view(),
         name="job-checkpoint-retention"),
    path("jobs/<int:pk>/checkpoints/interval", checkpoints.JobCheckpointInterval.as_view(),
         name="job-checkpoint-interval"),
    path("incidents", views.IncidentList.as_view(), name="incident-list"),
    path("incidents/<int:pk>", views.IncidentDetail.as_view(), name="incident-detail"),
]
