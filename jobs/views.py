"""Server-rendered dashboard pages."""

from django.contrib.auth.decorators import login_required, permission_required
from django.shortcuts import render

from jobs.models import Incident, Job
from nodes.models import Node


@login_required
@permission_required("jobs.view_job", raise_exception=True)
def overview(request):
    context = {
        "jobs": Job.objects.all()[:100],
        "nodes": Node.objects.prefetch_related("gpus")[:500],
        "incidents": Incident.objects.select_related("job")[:20],
    }
    return render(request, "jobs/overview.html", context)
