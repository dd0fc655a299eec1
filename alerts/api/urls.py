from django.urls import path

from alerts.api import views

urlpatterns = [
    path("alert-channels", views.ChannelListCreate.as_view(), name="alert-channel-list"),
    path("alert-channels/<int:pk>", views.ChannelDetail.as_view(), name="alert-channel-detail"),
    path("alert-channels/<int:pk>/test", views.ChannelTest.as_view(), name="alert-channel-test"),
    path("jobs/<int:pk>/alerts", views.JobAlerts.as_view(), name="job-alerts"),
    path("jobs/<int:pk>/efficiency", views.JobEfficiency.as_view(), name="job-efficiency"),
    path("jobs/<int:pk>/efficiency/target", views.JobEfficiencyTarget.as_view(), name="job-efficiency-target"),
]
