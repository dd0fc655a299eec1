from django.urls import path

from checkpoints.api import views

urlpatterns = [
    path("checkpoints", views.CheckpointList.as_view(), name="checkpoint-list"),
    path("checkpoints/<int:pk>", views.CheckpointDetail.as_view(), name="checkpoint-detail"),
    path("checkpoints/<int:pk>/lineage", views.CheckpointLineage.as_view(), name="checkpoint-lineage"),
    path("checkpoints/<int:pk>/verify", views.CheckpointVerify.as_view(), name="checkpoint-verify"),
    path("checkpoints/<int:pk>/pin", views.CheckpointPin.as_view(), name="checkpoint-pin"),
    path("checkpoints/<int:pk>/unpin", views.CheckpointUnpin.as_view(), name="checkpoint-unpin"),
    # GET lists a job's checkpoints; POST is the hooks' commit report.
    path("jobs/<int:pk>/checkpoints", views.JobCheckpoints.as_view(), name="job-checkpoints"),
    path("jobs/<int:pk>/checkpoints/tree", views.JobCheckpointTree.as_view(), name="job-checkpoint-tree"),
    path("jobs/<int:pk>/checkpoints/retention", views.JobCheckpointRetention.as_view(),
         name="job-checkpoint-retention"),
    path("jobs/<int:pk>/checkpoints/interval", views.JobCheckpointInterval.as_view(),
         name="job-checkpoint-interval"),
]
