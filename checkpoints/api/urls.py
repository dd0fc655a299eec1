from django.urls import path

from checkpoints.api import views

urlpatterns = [
    path("checkpoints", views.CheckpointList.as_view(), name="checkpoint-list"),
    path("checkpoints/<int:pk>", views.CheckpointDetail.as_view(), name="checkpoint-detail"),
    path("jobs/<int:pk>/checkpoints", views.JobCheckpointCommit.as_view(), name="job-checkpoint-commit"),
]
