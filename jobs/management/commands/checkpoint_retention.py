"""Show or apply checkpoint retention: the same one-shot the beat sweep runs.

A jobs command (it looks jobs up by id, and one may have no checkpoint yet) over the checkpoints
app's retention services.
"""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError

from checkpoints import services
from checkpoints.choices import CheckpointState
from jobs.models import Job


class Command(BaseCommand):
    help = "Show (--dry-run) or apply retention for one job, or for every job with checkpoints."

    def add_arguments(self, parser):
        parser.add_argument("--job", type=int, help="Job id; default: every job with live checkpoints.")
        parser.add_argument("--dry-run", action="store_true", help="Print the plan, change nothing.")

    def handle(self, job=None, dry_run=False, **options):
        if job is None and not dry_run:
            deleted = services.retention_sweep()
            self.stdout.write(f"retention sweep: {deleted} checkpoint(s) deleted")
            return
        jobs = Job.objects.filter(pk=job) if job is not None else Job.objects.filter(
            checkpoints__state__in=CheckpointState.LIVE).distinct()
        if job is not None and not jobs.exists():
            raise CommandError(f"no job {job}")
        for row in jobs.order_by("pk"):
            plan = services.apply_retention(row, dry_run=dry_run)
            verb = "would delete" if dry_run else "deleted"
            self.stdout.write(f"job {row.pk} ({row.name}): keep_last {plan.keep_last}, permanent every "
                              f"{plan.permanent_every_hours} h; {plan.storage.total_bytes} bytes on disk; {verb} "
                              f"{len(plan.delete)} ({plan.freed_bytes} bytes)")
            for decision in plan.decisions:
                mark = "keep  " if decision.keep else "delete"
                self.stdout.write(f"  {mark} step {decision.step} (#{decision.checkpoint}): {decision.reason}")
            for error in plan.errors:
                self.stderr.write(f"  error: {error}")
