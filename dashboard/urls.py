from django.contrib.auth import views as auth_views
from django.urls import path

from dashboard import views

app_name = "dashboard"

urlpatterns = [
    path("", views.overview, name="overview"),
    path("login/", auth_views.LoginView.as_view(template_name="dashboard/login.html"), name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("jobs/<int:pk>/", views.job_detail, name="job-detail"),
    path("jobs/<int:pk>/approve", views.approve_resume, name="job-approve"),
    path("jobs/<int:pk>/pause", views.pause, name="job-pause"),
    path("jobs/<int:pk>/checkpoint", views.checkpoint_now, name="job-checkpoint"),
    path("jobs/<int:pk>/rollback", views.rollback, name="job-rollback"),
    path("jobs/<int:pk>/resize", views.resize, name="job-resize"),
    path("jobs/<int:pk>/nodes/<int:node>/", views.job_node, name="job-node"),
    path("jobs/<int:pk>/timeline/", views.job_timeline, name="job-timeline"),
    path("nodes/", views.nodes, name="nodes"),
    path("nodes/<int:pk>/", views.node_detail, name="node-detail"),
    path("nodes/<int:pk>/drain", views.drain, name="node-drain"),
    path("nodes/<int:pk>/undrain", views.undrain, name="node-undrain"),
    path("nodes/<int:pk>/clear-lemon", views.clear_lemon, name="node-clear-lemon"),
]
