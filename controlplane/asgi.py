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

#: URL names whose requests may use the whole admission bound: a heartbeat that does not get through
#: turns a live node unreachable, and the agent's events carry exits and Xids, the verdicts that
#: start a recovery. Probes are never refused.
PRIORITY_URLS = ("agent-heartbeat", "agent-register", "agent-events")
EXEMPT_URLS = ("healthz", "readyz")
#: URL names whose refused callers are recorded (core.refusals): any request of an agent proves its
#: node alive; of the training hooks, only a step report proves progress (a hung rank's reporter
#: still polls control).
WITNESS_URLS = ("agent-heartbeat", "agent-telemetry", "agent-events", "agent-ack", "job-reports")


def admission(app) -> Admission:
    knobs = settings.NIGHTWATCH
    return Admission(app, limit=knobs["MAX_IN_FLIGHT"], reserve=knobs["PRIORITY_RESERVE"],
                     retry_after_s=knobs["RETRY_AFTER_S"], priority=PRIORITY_URLS, exempt=EXEMPT_URLS,
                     witnesses=WITNESS_URLS)


application = ProtocolTypeRouter(
    {
        "http": admission(django_asgi_app),
        "websocket": AllowedHostsOriginValidator(AuthMiddlewareStack(URLRouter(websocket_urlpatterns))),
    }
)
