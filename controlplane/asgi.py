"""ASGI entry point: HTTP through admission control and Django, WebSockets through Channels."""

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
django_asgi_app = get_asgi_application()

from controlplane.checks import refuse_unsafe_production  # noqa: E402

refuse_unsafe_production()

from channels.auth import AuthMiddlewareStack  # noqa: E402  (needs the app registry)
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from channels.security.websocket import AllowedHostsOriginValidator  # noqa: E402
from django.conf import settings  # noqa: E402

from controlplane.routing import websocket_urlpatterns  # noqa: E402
from core.admission import Admission  # noqa: E402
from nodes.services.commands import command_ttl  # noqa: E402

#: URL names whose requests may use the whole admission bound: the agent's events carry exits and
#: Xids, the verdicts that start a recovery, and its command acks the launches and confirmed stops
#: that carry one out (the agent sends both in the same first lane, ``agents.agent.outbox``). As bulk,
#: 175 of 314 acks were refused at 1,024 nodes, and 5 of 23 jobs had not started training 5 min later.
URGENT_URLS = ("agent-events", "agent-ack")
#: URL names that leave only the urgent slots free: a heartbeat that does not get through (and is
#: not known to have been refused) turns a live node unreachable. Probes are never refused.
PRIORITY_URLS = ("agent-heartbeat", "agent-register")
#: URL names whose writes (not their reads) are admitted like heartbeats: a checkpoint commit moves the
#: verified restart point, comes once per checkpoint per job, and the hooks' reporter sends nothing
#: behind it until it is taken. As bulk, at 1,024 nodes one was refused 19 times in a row over 3 min
#: (Retry-After growing to 10 s), its job's step reports queued behind it, and a hang in that job
#: was found 158 s after the fault, the refusals sparing it (bench.fleet, 2026-12-06).
PRIORITY_WRITE_URLS = ("job-checkpoints",)
#: URL names whose writes (never their reads) are an operator's actions: admitted like heartbeats.
#: The API's and the dashboard's forms share the names.
OPERATOR_URLS = ("job-list", "job-cancel", "job-pause", "job-checkpoint", "job-approve", "job-rollback", "job-resize",
                 "node-drain", "node-undrain", "node-clear-lemon", "node-health-check", "node-bootstrap-token",
                 "token-rotate", "login", "logout")
EXEMPT_URLS = ("healthz", "readyz")
#: URL names whose refused callers are recorded (core.refusals): any request of an agent proves its
#: node alive; of the training hooks, only a step report or a checkpoint commit proves progress (a
#: hung rank's reporter still polls control). Commits count because the reporter delivers its spool
#: in order: while a commit at its head is refused, the step reports behind it are never sent, and
#: bench.fleet (2026-12-02, 1,024 nodes) saw 21 of 23 jobs declared hung at a checkpoint step that way.
#: URL names whose answer carries the caller's commands: an agent with open commands is urgent there.
CARRIER_URLS = ("agent-heartbeat",)
#: URL names of long polls: admitted as bulk, their slot given back once they wait (core.admission.RELEASE).
LONG_POLL_URLS = ("agent-command-wait",)
#: URL names whose requests say whether they can move a job's progress (the hooks' step reports,
#: ``agents.protocol.hooks.PROGRESS_HEADER``): rank 0's go ahead of bulk, another rank's witness nothing.
PROGRESS_URLS = ("job-reports",)
WITNESS_URLS = ("agent-heartbeat", "agent-telemetry", "agent-events", "agent-ack", "job-reports", "job-checkpoints")


def admission(app) -> Admission:
    knobs = settings.NIGHTWATCH
    return Admission(app, limit=knobs["MAX_IN_FLIGHT"], reserve=knobs["PRIORITY_RESERVE"],
                     urgent_reserve=knobs["URGENT_RESERVE"], retry_after_s=knobs["RETRY_AFTER_S"],
                     retry_after_max_s=knobs["RETRY_AFTER_MAX_S"],
                     urgent=URGENT_URLS, priority=PRIORITY_URLS, priority_writes=PRIORITY_WRITE_URLS,
                     operator=OPERATOR_URLS, exempt=EXEMPT_URLS,
                     witnesses=WITNESS_URLS, carriers=CARRIER_URLS, long_polls=LONG_POLL_URLS,
                     progress=PROGRESS_URLS,
                     awaited_within_s=command_ttl().total_seconds(), width=knobs["ADMISSION_WIDTH"],
                     share=knobs["ADMISSION_SHARE"])


application = ProtocolTypeRouter(
    {
        "http": admission(django_asgi_app),
        "websocket": AllowedHostsOriginValidator(AuthMiddlewareStack(URLRouter(websocket_urlpatterns))),
    }
)
