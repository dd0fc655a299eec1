"""WebSocket consumers of the dashboard: thin — authenticate, join groups, forward, never write.

Each page opens one socket: ``/ws/dashboard/overview/``, ``/ws/dashboard/jobs/<id>/``,
``/ws/dashboard/nodes/<id>/`` or ``/ws/dashboard/nodes/`` (with the page's node filter as its
query string). On every (re)connect the consumer sends a snapshot of the whole page, so a browser
that lost its connection for a while shows what changed meanwhile; after that it forwards the
relay's pushes (``dashboard.relay``), re-rendering the changed sections for its own person
(action buttons depend on the role) and filter.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import parse_qs

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer
from django.db import connection
from redis.exceptions import RedisError

from core import degraded, roles
from dashboard import events, fleet, queries
from dashboard import sections as page_sections
from dashboard.relay import RELAY
from jobs.models import Job
from nodes.models import Node

log = logging.getLogger(__name__)

#: Close codes: not signed in; signed in without the view capability; no such job.
UNAUTHENTICATED, FORBIDDEN, NOT_FOUND = 4401, 4403, 4404
#: The channel layer (Redis) is down: the browser's usual reconnect, with its snapshot, brings it
#: back live once Redis returns.
TRY_AGAIN_LATER = 1013
#: Rendered sections per (message, page, job, capabilities): one render per push, not one per browser.
_RENDERED: OrderedDict = OrderedDict()
_RENDERED_MAX = 256
_IN_FLIGHT: dict = {}
#: Pages are rendered on threads of their own. Channels runs every ``database_sync_to_async`` call
#: of a process on one shared thread, each consumer's message dispatch included: a big job's page
#: rendered there (0.5-1 s on a loaded machine) held every socket's pushes back for that long.
_RENDER_THREADS = ThreadPoolExecutor(max_workers=2, thread_name_prefix="dashboard-render")


async def _render_thread(fn, *args):
    """``fn(*args)`` on a render thread, its database connection given back (to the pool) after."""
    return await asyncio.get_running_loop().run_in_executor(_RENDER_THREADS, _closing_connection, fn, *args)


def _closing_connection(fn, *args):
    try:
        return fn(*args)
    finally:
        connection.close()


class DashboardConsumer(AsyncJsonWebsocketConsumer):
    page: str = ""
    _rendering: asyncio.Task | None = None  # the render under way, if any
    _waiting: dict | None = None  # what changed while it ran: the next render's work

    async def __call__(self, scope, receive, send):
        """Channels reads the consumer's channel from the layer for the socket's whole life: when the
        layer's Redis goes away (before the handshake or after), close with 1013 instead of failing."""
        try:
            await super().__call__(scope, receive, send)
        except (RedisError, OSError) as error:
            degraded.note("channel_layer", error)
            with contextlib.suppress(Exception):
                await send({"type": "websocket.close", "code": TRY_AGAIN_LATER})

    async def connect(self):
        user = self.scope.get("user")
        if user is None or not user.is_authenticated:
            await self.close(code=UNAUTHENTICATED)
            return
        self.caps = await database_sync_to_async(page_sections.capabilities_of)(user)
        if roles.VIEW not in self.caps:
            await self.close(code=FORBIDDEN)
            return
        self.job_id = self.node_id = None
        # The nodes page's filter and page number ride in the socket's query string.
        self.filter = fleet.NodeFilter.parse(parse_qs(self.scope.get("query_string", b"").decode(errors="replace")))
        if self.page == "job":
            self.job_id = int(self.scope["url_route"]["kwargs"]["job_id"])
            if not await database_sync_to_async(Job.objects.filter(pk=self.job_id).exists)():
                await self.close(code=NOT_FOUND)
                return
        if self.page == "node":
            self.node_id = int(self.scope["url_route"]["kwargs"]["node_id"])
            if not await database_sync_to_async(Node.objects.filter(pk=self.node_id).exists)():
                await self.close(code=NOT_FOUND)
                return
        self.groups_joined = [events.job_group(self.job_id)] if self.job_id else [events.CLUSTER_GROUP]
        try:
            for group in self.groups_joined:
                await self.channel_layer.group_add(group, self.channel_name)
        except Exception as error:  # the channel layer's Redis is down: no live page until it is back
            degraded.note("channel_layer", error)
            self.groups_joined = []
            await self.close(code=TRY_AGAIN_LATER)
            return
        await self.accept()
        await RELAY.attach()
        self.attached = True
        await self.send_json(await _render_thread(self._snapshot))

    async def disconnect(self, code):
        for group in getattr(self, "groups_joined", []):
            try:
                await self.channel_layer.group_discard(group, self.channel_name)
            except Exception as error:  # Redis down: its group memberships expire on their own
                degraded.note("channel_layer", error)
                break
        if getattr(self, "attached", False):
            RELAY.detach()
        if self._rendering is not None:
            self._rendering.cancel()

    async def receive_json(self, content, **kwargs):
        """The browser may ask for a fresh snapshot (e.g. after its tab slept)."""
        if content.get("type") == "snapshot":
            await self.send_json(await _render_thread(self._snapshot))

    async def dashboard_push(self, message):
        """Chart points go out at once; changed sections are rendered off this path (``_render_soon``):
        channels hands a consumer its messages one at a time, and a render of a big job's page takes
        a while on a loaded machine, so the next push's points would otherwise wait behind it."""
        points = message["points"] if self.page == "job" and message.get("job") == self.job_id else []
        if points:
            await self.send_json(events.update_frame(points=points, html={}, chart=None,
                                                     relayed_at=message["relayed_at"]))
        if (any(n in page_sections.PAGES[self.page] or n == "chart" for n in message["sections"])
                or (self.page == "nodes" and message.get("nodes"))):
            self._render_soon(message)

    def _render_soon(self, message: dict) -> None:
        """Render ``message``'s sections now, or, while a render is under way, fold them into the
        next one: at most one render per consumer at a time, and none of a change is dropped."""
        if self._rendering is not None and not self._rendering.done():
            self._waiting = message if self._waiting is None else _folded(self._waiting, message)
            return
        self._rendering = asyncio.get_running_loop().create_task(self._render_and_send(message))

    async def _render_and_send(self, message: dict) -> None:
        while message is not None:
            try:
                html, chart, cells = await self._rendered(message)
                if html or chart or cells:
                    await self.send_json(events.update_frame(points=[], html=html, chart=chart, cells=cells,
                                                             relayed_at=message["relayed_at"]))
            except Exception:  # the next push renders again; a snapshot on reconnect repairs the page
                log.exception("dashboard render for %s failed", self.page)
            message, self._waiting = self._waiting, None

    async def _rendered(self, message: dict) -> tuple[dict, dict | None, dict]:
        """The message's sections as this person sees them: rendered once per process (the first
        consumer renders, the others of the same page, job, role and node filter await that render;
        when the consumer that renders goes away first, the next one renders itself)."""
        key = (message["id"], self.page, self.job_id, self.node_id, self.caps, self.filter)
        while True:
            if key in _RENDERED:
                return _RENDERED[key]
            in_flight = _IN_FLIGHT.get(key)
            if in_flight is None:
                break
            try:
                return await asyncio.shield(in_flight)
            except asyncio.CancelledError:
                if not in_flight.cancelled():
                    raise  # this consumer was cancelled, not the render it awaited
        future = _IN_FLIGHT[key] = asyncio.get_running_loop().create_future()
        try:
            result = await _render_thread(self._render, message)
        except asyncio.CancelledError:
            future.cancel()  # the consumers awaiting it render it themselves
            raise
        except Exception as exc:
            future.set_exception(exc)
            future.exception()  # retrieved: the awaiting consumers re-raise it, no "never retrieved" noise
            raise
        finally:
            _IN_FLIGHT.pop(key, None)
        future.set_result(result)
        _RENDERED[key] = result
        while len(_RENDERED) > _RENDERED_MAX:
            _RENDERED.popitem(last=False)
        return result

    # --- rendering (sync, ORM) ----------------------------------------------------------------------
    def _job(self) -> Job | None:
        return Job.objects.filter(pk=self.job_id).first() if self.job_id else None

    def _subject(self, job: Job | None) -> page_sections.Subject:
        node = Node.objects.filter(pk=self.node_id).first() if self.node_id else None
        return page_sections.Subject(job=job, node=node, filter=self.filter)

    def _snapshot(self) -> dict:
        job = self._job()
        html = page_sections.render(self.page, None, self.caps, self._subject(job))
        return events.snapshot_frame(self.page, html, queries.chart(job) if job else None)

    def _render(self, message: dict) -> tuple[dict, dict | None, dict]:
        names = [n for n in message["sections"] if n in page_sections.PAGES[self.page]]
        job = self._job()
        html = page_sections.render(self.page, names, self.caps, self._subject(job)) if names else {}
        chart = queries.chart(job) if job is not None and "chart" in message["sections"] else None
        cells = fleet.heatmap_cells(self.filter, message["nodes"]) if self.page == "nodes" and message.get(
            "nodes") else {}
        return html, chart, cells


def _folded(first: dict, then: dict) -> dict:
    """Two pushes' render work as one: the union of their sections and nodes (points were sent)."""
    return {**then, "id": f"{first['id']}+{then['id']}",
            "sections": sorted(set(first["sections"]) | set(then["sections"])),
            "nodes": sorted(set(first.get("nodes") or ()) | set(then.get("nodes") or ()))}


class OverviewConsumer(DashboardConsumer):
    page = "overview"


class JobConsumer(DashboardConsumer):
    page = "job"


class NodesConsumer(DashboardConsumer):
    page = "nodes"


class NodeConsumer(DashboardConsumer):
    page = "node"
