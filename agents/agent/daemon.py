"""The node agent: registers, heartbeats, pushes telemetry, runs commands, supervises torchrun.

One loop on the main thread samples telemetry, watches for Xids, heartbeats and flushes the
spool; commands run on the ``CommandRunner``'s worker; each generation has a watcher thread
(``Supervisor``). Nothing here waits for the control plane to keep training going: if it is
unreachable, the loop keeps sampling into the spool and the job keeps running.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from pathlib import Path
from typing import Any

from agents import __version__
from agents.agent.commands import CommandLedger, CommandRunner
from agents.agent.config import AgentConfig
from agents.agent.logship import LogShipper
from agents.agent.outbox import AuthRejected, Outbox
from agents.agent.registration import (
    NodeCredentials,
    RegistrationRefused,
    attempt_id,
    load_credentials,
    register,
    save_credentials,
)
from agents.agent.wake import CommandWait, HeartbeatCount, next_heartbeat_in
from agents.health import BandwidthProbeServer, evaluate, probe_peers, with_bandwidth
from agents.http import ControlPlaneClient, Unreachable, retry_delay
from agents.preflight import check_launch
from agents.protocol import ProtocolError, parse
from agents.protocol.agent import (
    HEARTBEAT_PATH,
    AgentStarted,
    Command,
    CommandAck,
    DrainAck,
    DrainPayload,
    ExitReport,
    GpuSample,
    HealthCheckPayload,
    HealthReport,
    Heartbeat,
    HeartbeatResponse,
    LaunchPayload,
    LaunchSpecError,
    RankGone,
    StopPayload,
    XidDetail,
    compact,
)
from agents.supervisor import DEFAULT_TORCHRUN, StaleGeneration, Supervisor, attach_xids
from agents.telemetry import TelemetryCollector, TelemetrySource, open_source

log = logging.getLogger(__name__)
#: After a generation ends on its own, heartbeat this often for this long: the relaunch command
#: rides on a heartbeat answer, and every second of waiting for it is lost training time.
DECISION_POLL_S = 0.2
DECISION_WINDOW_S = 20.0

#: The loop's granularity: how late an Xid event or a due heartbeat can be noticed.
TICK_S = 0.1


class Agent:
    def __init__(self, config: AgentConfig, *, source: TelemetrySource | None = None):
        self.config = config
        config.work_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.source = source or open_source(config.telemetry_source, {"scenario": config.scenario})
        if not self.source.available:
            log.warning("NO GPU TELEMETRY on this node: %s. The node reports this instead of values, "
                        "and GPU jobs will not launch here.", self.source.reason)
        self.collector = TelemetryCollector(self.source, window_s=config.rate_window_s)
        self.gpus = self.source.gpus()
        self.thresholds = config.thresholds
        #: Each generation's torchrun output, shipped to the control plane (nightwatch logs).
        self.logs = LogShipper()
        self.supervisor = Supervisor(config.work_dir / "supervisor", on_exit=self._on_exit,
                                     torchrun=config.torchrun or DEFAULT_TORCHRUN,
                                     log_max_bytes=config.log_max_bytes, log_backups=config.log_backups,
                                     default_grace_s=config.stop_grace_s, warm_launcher=config.warm_launcher,
                                     warm_workers=config.warm_workers, snapshot_dir=config.snapshot_dir,
                                     on_output=self.logs.add, on_rank_gone=self._on_rank_gone)
        self.outbox = Outbox(config.work_dir / "spool.sqlite3", max_records=config.spool_max_records)
        self.samples_taken = 0
        self.credentials: NodeCredentials | None = None
        self.draining = False
        self._stopping = threading.Event()
        #: Cuts the loop's tick short: an exit report should not wait for the next tick.
        self._wake = threading.Event()
        #: Set by the command wait (``agents.agent.wake``): heartbeat now, commands are queued.
        self._commands_waiting = threading.Event()
        self._heartbeats = HeartbeatCount()
        self._command_wait: CommandWait | None = None
        self._xids: collections.deque[tuple[float, int]] = collections.deque(maxlen=256)
        self._seq = 0
        #: The interval the control plane asked for (heartbeat pacing); registration's until it answers.
        self.heartbeat_interval_s: float | None = None
        #: Whether heartbeats say which interval they follow: not to a server that predates pacing.
        self._paced = True
        self._decision_expected_until = 0.0
        self._reachable = True
        self._probe: BandwidthProbeServer | None = None
        self.commands: CommandRunner | None = None  # set once registered
        self._client: ControlPlaneClient | None = None
        #: Events and acks (the outbox's urgent lane), where ``urgent_url`` names processes of their own.
        self._urgent_client: ControlPlaneClient | None = None

    def stop(self) -> None:
        """Ask the loop to end (from a signal handler or another thread)."""
        self._stopping.set()
        self._wake.set()

    def run(self) -> int:
        """Until ``stop()``; the process exit status (2: registration refused)."""
        try:
            # Generations an earlier process of this agent started run on without it: watch them
            # again (heartbeats list them, stop commands reach them, their exits are reported).
            self.supervisor.adopt()
            self._probe = BandwidthProbeServer(self.config.probe_host, self.config.probe_port).start()
            try:
                creds = self._registered()
            except RegistrationRefused as exc:
                log.error("%s", exc)
                return 2
            if creds is None:
                return 0  # stopped while the control plane was still unreachable
            self.credentials = creds
            self._client = ControlPlaneClient(self.config.control_plane_url, creds.node_token,
                                              timeout=self.config.request_timeout_s)
            if self.config.urgent_url:
                self._urgent_client = ControlPlaneClient(self.config.urgent_url, creds.node_token,
                                                         timeout=self.config.request_timeout_s)
            self.logs.start(ControlPlaneClient(self.config.control_plane_url, creds.node_token,
                                               timeout=self.config.request_timeout_s), creds.node_id)
            self.commands = CommandRunner(
                CommandLedger(self.config.work_dir / "commands.json"),
                {"launch": self._launch, "stop": self._stop_generation, "drain": self._drain,
                 "health_check": self._health_check},
                self.outbox.add_ack, refusals=(StaleGeneration, LaunchSpecError))
            if self.config.command_wait:
                self._command_wait = CommandWait(
                    self.config.control_plane_url, creds.node_token, creds.node_id,
                    on_commands=self._on_commands_waiting, heartbeats=self._heartbeats, stopping=self._stopping,
                    interval_s=lambda: self.heartbeat_interval_s or self.config.heartbeat_interval_s)
                self._command_wait.start()
            self.outbox.add_event("agent_started", AgentStarted(
                agent_version=__version__, gpu_telemetry=self.source.available,
                gpu_telemetry_reason=self.source.reason))
            self._loop(creds)
            return 0
        finally:
            self._shut_down()

    # --- the loop ------------------------------------------------------------------------------

    def _registered(self) -> NodeCredentials | None:
        path = self.config.token_path
        creds = load_credentials(path, self.config.control_plane_url)
        if creds is not None:
            return creds
        try:
            token = self.config.read_bootstrap_token()
        except OSError as exc:
            raise RegistrationRefused(f"cannot read the bootstrap token: {exc}") from exc
        if not token:
            raise RegistrationRefused(f"no node token in {path} and no bootstrap token configured")
        client = ControlPlaneClient(self.config.control_plane_url, timeout=self.config.request_timeout_s)
        attempt_file = path.with_name("registration-attempt")
        attempt = attempt_id(attempt_file)
        failures = 0
        while not self._stopping.is_set():
            try:
                answer = register(client, bootstrap_token=token, hostname=self.config.hostname,
                                  address=self.config.address or self.config.hostname, labels=self.config.labels,
                                  gpus=self.gpus, gpu_telemetry=self.source.available,
                                  gpu_telemetry_reason=self.source.reason,
                                  probe_port=self._probe.port if self._probe else None, attempt=attempt)
            except Unreachable as exc:
                failures += 1
                delay = retry_delay(failures, cap=30.0, retry_after=exc.retry_after)
                log.warning("control plane unreachable for registration (%s); retrying in %.1f s", exc, delay)
                self._stopping.wait(delay)
                continue
            creds = NodeCredentials(control_plane_url=self.config.control_plane_url, node_id=answer.node_id,
                                    node_token=answer.node_token, heartbeat_interval_s=answer.heartbeat_interval_s)
            save_credentials(path, creds)
            attempt_file.unlink(missing_ok=True)  # the token is kept: a next registration is a new one
            log.info("registered as node %s; token stored in %s", creds.node_id, path)
            return creds
        return None

    def _loop(self, creds: NodeCredentials) -> None:
        self.heartbeat_interval_s = creds.heartbeat_interval_s
        next_sample = next_heartbeat = next_flush = next_urgent = last_heartbeat = time.monotonic()
        samples_due = float("inf")  # when the oldest sample not yet sent must go
        flush_backoff = urgent_backoff = TICK_S  # of the bulk lane (telemetry) and of the urgent one
        owed, refusals = False, 0  # commands wait for a heartbeat to get through; heartbeats refused in a row
        while not self._stopping.is_set():
            now = time.monotonic()
            for xid in self.collector.poll_xids(0):
                log.error("GPU %d: Xid %d", xid.gpu, xid.code)
                self._xids.append((xid.time, xid.code))
                self.outbox.add_event("xid", XidDetail(gpu=xid.gpu, code=xid.code))
                self.supervisor.hold_replacements(f"GPU {xid.gpu}: Xid {xid.code}")
            if now >= next_sample:
                samples = self.collector.sample(creds.node_id)
                self.outbox.add_samples(samples)
                self.samples_taken += len(samples)
                self._hold_replacements_if_unhealthy(samples)
                samples_due = min(samples_due, now + self.config.telemetry_batch_s)
                next_sample = now + self.config.telemetry_interval_s
            self.outbox.report_drops()
            urgent = now < self._decision_expected_until and now - last_heartbeat >= DECISION_POLL_S
            if self._commands_waiting.is_set():
                self._commands_waiting.clear()
                urgent = owed = True
            if now >= next_heartbeat or urgent:
                through, retry_after = self._heartbeat(creds)
                owed, refusals = (False, 0) if through else (owed, refusals + 1)
                last_heartbeat = now
                next_heartbeat = now + next_heartbeat_in(self.heartbeat_interval_s, owed=owed, refusals=refusals,
                                                         retry_after=retry_after)
            bulk = now >= next_flush
            if len(self.outbox) and ((self.outbox.urgent and now >= next_urgent) or (bulk and now >= samples_due)):
                try:
                    self.outbox.flush(self._api(), creds.node_id, self._on_stale_ack, bulk=bulk,
                                      urgent_client=self._urgent_client)
                    if bulk:
                        samples_due = float("inf")
                        flush_backoff = TICK_S
                    urgent_backoff = TICK_S
                    self._set_reachable(True, "")
                except (Unreachable, AuthRejected) as exc:
                    # Back off, but never beyond a heartbeat (replay starts soon after it returns) unless
                    # an overloaded control plane asked for longer; jittered, so a refused fleet spreads.
                    # Each lane on its own: refused telemetry waits out its Retry-After, but an Xid or an
                    # exit that comes meanwhile goes at once (under heartbeat pacing the wait is up to a
                    # 30 s interval, and the exit would wait with it).
                    retry_after = _retry_after(exc)
                    if self.outbox.urgent:  # the urgent lane itself was refused: both wait
                        urgent_backoff = min(urgent_backoff * 2, self.heartbeat_interval_s)
                        next_urgent = now + retry_delay(1, base=urgent_backoff, cap=urgent_backoff,
                                                        retry_after=retry_after)
                    else:
                        urgent_backoff = TICK_S
                    flush_backoff = min(flush_backoff * 2, self.heartbeat_interval_s)
                    next_flush = max(next_urgent, now + retry_delay(1, base=flush_backoff, cap=flush_backoff,
                                                                    retry_after=retry_after))
                    self._set_reachable(False, str(exc))
            if self._wake.wait(TICK_S):
                self._wake.clear()

    def _on_commands_waiting(self) -> None:
        """The command wait's thread: commands are queued for this node; heartbeat to take them."""
        self._commands_waiting.set()
        self._wake.set()

    def _heartbeat(self, creds: NodeCredentials) -> tuple[bool, float | None]:
        """One heartbeat, its commands handed to the runner: (whether it got through, the
        ``Retry-After`` of a refusal)."""
        self._seq += 1
        message = Heartbeat(node_id=creds.node_id, seq=self._seq, time=time.time(), running=self.supervisor.running(),
                            gpu_telemetry=self.source.available, gpu_telemetry_reason=self.source.reason,
                            draining=self.draining, spooled=len(self.outbox),
                            telemetry_dropped=self.outbox.spool.dropped.get("telemetry", 0),
                            interval_s=self.heartbeat_interval_s if self._paced else None)
        try:
            status, body = self._api().request("POST", HEARTBEAT_PATH.format(node_id=creds.node_id), compact(message))
        except Unreachable as exc:
            self._set_reachable(False, str(exc))
            return False, exc.retry_after
        if status == 400 and self._paced and "interval_s" in str(body):
            # A control plane older than heartbeat pacing: keep the registration's interval, ask again at once.
            log.warning("the control plane does not pace heartbeats (%s); keeping %.1f s", body,
                        self.heartbeat_interval_s)
            self._paced = False
            self._seq -= 1
            return self._heartbeat(creds)
        if status != 200:
            log.error("heartbeat refused (%d): %s", status, body)
            return False, None
        self._set_reachable(True, "")
        try:
            answer = parse(HeartbeatResponse, body)
        except ProtocolError as exc:
            log.error("malformed heartbeat answer: %s", exc)
            return False, None
        self._heartbeats.got_through()
        if answer.heartbeat_interval_s is not None and answer.heartbeat_interval_s != self.heartbeat_interval_s:
            log.info("heartbeat interval %.1f s, as the control plane asks (was %.1f s)", answer.heartbeat_interval_s,
                     self.heartbeat_interval_s)
            self.heartbeat_interval_s = answer.heartbeat_interval_s
        assert self.commands is not None
        for command in answer.commands:
            self.commands.submit(command)
        return True, None

    def _set_reachable(self, reachable: bool, why: str) -> None:
        if reachable != self._reachable:  # log transitions, not every failed attempt
            if reachable:
                log.info("control plane reachable again; replaying %d spooled records", len(self.outbox))
            else:
                log.warning("control plane unreachable (%s); spooling to disk, jobs keep running", why)
            self._reachable = reachable

    def _api(self) -> ControlPlaneClient:
        assert self._client is not None
        return self._client

    # --- commands ------------------------------------------------------------------------------

    def _hold_replacements_if_unhealthy(self, samples: list[GpuSample]) -> None:
        """In-process restarts need a node that passes its health check: once a sample fails it (an
        uncorrectable ECC error, a GPU gone, too hot), no rank is replaced here any more
        (``Supervisor.hold_replacements``, for the agent's life) and a crash ends its generation, so
        that the control plane moves the job. A node without GPU telemetry has nothing to judge."""
        if self.supervisor.replacements_held or not self.source.available or not samples:
            return
        report = evaluate(samples, self.thresholds, expected_gpus=len(self.gpus), idle=False)
        if not report.ok:
            log.warning("node failed its health check (%s): ranks are no longer replaced in process", report.reason)
            self.supervisor.hold_replacements(f"health check failed: {report.reason}")

    def _check_health(self, *, require_gpu: bool, payload: HealthCheckPayload | None = None) -> HealthReport:
        assert self.credentials is not None
        samples = self.collector.sample(self.credentials.node_id)
        report = evaluate(samples, self.thresholds, expected_gpus=len(self.gpus),
                          idle=not self.supervisor.running(), require_gpu=require_gpu,
                          telemetry_reason=None if self.source.available else self.source.reason)
        if payload is not None and payload.peers:
            report = with_bandwidth(report, probe_peers(payload.peers, nbytes=payload.probe_bytes,
                                                        max_seconds=payload.probe_seconds, thresholds=self.thresholds))
        return report

    def _launch(self, command: Command, payload: LaunchPayload) -> tuple[str, str]:
        job, generation = command.job, command.generation
        assert job is not None and generation is not None  # parse_command_payload checked
        if self.draining:
            return "refused", "node is draining"
        self.supervisor.check_fence(job, generation)
        current = next((r for r in self.supervisor.running() if r.job == job), None)
        if current is not None and current.generation == generation:
            return "done", "already running"
        if current is not None:  # superseded: stop it first, so the health check sees its GPUs free
            self.supervisor.stop(job, current.generation, self.config.stop_grace_s)
        probe = HealthCheckPayload(peers=payload.probe_peers, probe_bytes=payload.probe_bytes,
                                   probe_seconds=payload.probe_seconds)
        report = self._check_health(require_gpu=payload.require_gpu, payload=probe)
        if not report.ok:
            self.outbox.add_event("launch_refused", report, job=job, generation=generation)
            return "refused", f"pre-launch health check failed: {report.reason}"
        # train.py reports with the generation's job token from the launch command, never with
        # the agent's own (user code must not hold the node's credential): without one, the
        # hooks get none. The entrypoint resolves against the node's code directory.
        payload = dataclasses.replace(
            payload,
            hooks_url=payload.hooks_url or self.config.control_plane_url,
            workdir=payload.workdir or str(self.config.code_dir or Path.cwd()),
        )
        # The job's own pre-flight: an entrypoint that is not there or a checkpoint directory that
        # takes no write would fail every restart the same way; refused now, with the reason.
        job_checks = check_launch(payload, Path(payload.workdir or "."))
        if not all(check.ok for check in job_checks):
            refused = HealthReport(ok=False, reason="; ".join(c.detail for c in job_checks if not c.ok)[:2000],
                                   checks=job_checks)
            self.outbox.add_event("launch_refused", refused, job=job, generation=generation)
            return "refused", f"pre-flight failed: {refused.reason}"
        launched = self.supervisor.launch(job, generation, payload)
        self.outbox.add_event("launched", launched, job=job, generation=generation)
        return "done", f"torchrun started, pid {launched.pid}"

    def _stop_generation(self, command: Command, payload: StopPayload) -> tuple[str, str]:
        assert command.job is not None and command.generation is not None
        report = self.supervisor.stop(command.job, command.generation, payload.grace_s)
        return "done", "stopped" if report is not None else "not running on this node"

    def _drain(self, command: Command, payload: DrainPayload) -> tuple[str, str]:
        self.draining = True
        self.supervisor.hold_replacements(f"draining: {payload.reason}")
        self.outbox.add_event("drain_ack", DrainAck(reason=payload.reason, running=self.supervisor.running()))
        return "done", "draining: no new launches"

    def _health_check(self, command: Command, payload: HealthCheckPayload) -> tuple[str, str]:
        report = self._check_health(require_gpu=payload.require_gpu, payload=payload)
        self.outbox.add_event("health_check", report, job=command.job, generation=command.generation)
        return "done", "healthy" if report.ok else report.reason[:2000]

    def _on_stale_ack(self, ack: CommandAck) -> None:
        """The server fenced this generation off while we acked: nothing of it may keep running."""
        if ack.job is not None and ack.generation is not None:
            log.warning("job %s generation %d is stale on the control plane; stopping it", ack.job, ack.generation)
            threading.Thread(target=self._stop_quietly, args=(ack.job, ack.generation), daemon=True).start()

    def _stop_quietly(self, job: str, generation: int) -> None:
        try:
            self.supervisor.stop(job, generation, self.config.stop_grace_s)
        except StaleGeneration:
            pass  # an even newer generation runs here; the stale one is already gone

    def _on_exit(self, job: str, generation: int, report: ExitReport) -> None:
        started = time.time() - report.runtime_s
        report = attach_xids(report, [code for at, code in list(self._xids) if at >= started])
        kind = "stopped" if report.requested_stop else "exited"
        self.logs.ended(job, generation)  # its log has been read to the end
        self.outbox.add_event(kind, report, job=job, generation=generation)
        if not report.requested_stop:
            # The control plane is deciding what this node runs next (usually a relaunch within a
            # second): ask for it quickly for a while rather than a whole heartbeat later.
            self._decision_expected_until = time.monotonic() + DECISION_WINDOW_S
        self._wake.set()

    def _on_rank_gone(self, job: str, generation: int, notice: RankGone) -> None:
        """A rank of a running generation is going down (gone, or its uncaught exception printed):
        tell the control plane now, not only in the exit report that follows once torchrun has
        closed the rest of the group (seconds later), so that it waits for that report instead of
        taking the silence for a hang. Keyed per death (the supervisor tells of one once; a rank
        replaced in process may die again in the same generation)."""
        self.outbox.add_event("rank_gone", notice, job=job, generation=generation,
                              key=f"rank_gone:{job}:{generation}:{notice.at:.3f}")
        self._wake.set()

    # --- shutdown ------------------------------------------------------------------------------

    def _shut_down(self) -> None:
        if self.commands is not None:
            self.commands.close(timeout=self.config.stop_grace_s + 15)
        if self.config.stop_jobs_on_exit:
            self.supervisor.shutdown(self.config.stop_grace_s)
        if self.credentials is not None and self._client is not None and len(self.outbox):
            try:  # one last try, so a clean stop leaves nothing behind in the spool
                self.outbox.flush(self._client, self.credentials.node_id, lambda ack: None,
                                  urgent_client=self._urgent_client)
            except (Unreachable, AuthRejected) as exc:
                log.warning("%d records stay spooled for the next start: %s", len(self.outbox), exc)
        if self.credentials is not None and self._client is not None:
            self.logs.stop(self._client, self.credentials.node_id)  # what waits goes now, if it can
        else:
            self.logs.stop()
        if self._probe is not None:
            self._probe.close()
        self.outbox.close()
        self.source.close()

    def stats(self) -> dict[str, Any]:
        return {"samples_taken": self.samples_taken, "events_created": self.outbox.events_created,
                "spooled": len(self.outbox), "dropped": self.outbox.spool.dropped}


def _retry_after(exc: Exception) -> float | None:
    """The wait a refusal asked for (``Retry-After``), if it said one."""
    return exc.retry_after if isinstance(exc, Unreachable) else None
