from django.urls import path

from nodes.api import views

urlpatterns = [
    path("nodes", views.NodeList.as_view(), name="node-list"),
    path("nodes/<int:pk>", views.NodeDetail.as_view(), name="node-detail"),
]
