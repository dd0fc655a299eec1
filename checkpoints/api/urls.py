from django.urls import path

from checkpoints.api import views

# A job's checkpoints (/jobs/{id}/checkpoints...) are routed by jobs.api.urls.

urlpatterns = [
    path("checkpoints", views.CheckpointList.as_view(), name="checkpoint-list"),
    path("checkpoints/<int:pk>", views.CheckpointDetail.as_view(), name="checkpoint-detail"),
    path("checkpoints/<int:pk>/lineage", views.CheckpointLineage.as_view(), name="checkpoint-lineage"),
    path("checkpoints/<int:pk>/verify", views.CheckpointVerify.as_view(), name="checkpoint-verify"),
    path("checkpoints/<int:pk>/pin", views.CheckpointPin.as_view(), name="checkpoint-pin"),
    path("checkpoints/<int:pk>/unpin", views.CheckpointUnpin.as_view(), name="checkpoint-unpin"),
]
