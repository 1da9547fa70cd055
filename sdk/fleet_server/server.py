"""``edgepack fleet serve``: the wiring of the fleet server, and :func:`serve`.

Start-up checks everything it can before it listens, so a mistake is one line at start and
not a failure hours later: the listen address can be bound, the token file, trust keys and
operator key load (and are not readable by others), the database answers and its schema is
migrated, the broker accepts the login. Then it runs the MQTT ingest, the rollout driver
(which only acts while this server holds the lease), the retention job (only on the lease
holder, so two servers never fold the same samples) and the HTTP server, until SIGTERM or
SIGINT, when it stops them in reverse order and gives the lease back.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import threading
import time
import urllib.parse
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edgepack_core.errors import EdgepackError
from edgepack_core.protocol.ids import is_valid_id
from edgepack_core.signing import RELEASE, SigningKey, TrustStore
from sdk.broker import BrokerOptions, parse_broker
from sdk.errors import ServerConfigError
from sdk.fleet_server import queries
from sdk.fleet_server.alert_config import AlertsConfig
from sdk.fleet_server.alert_runner import AlertRunner, start_alerts
from sdk.fleet_server.api import ApiContext, build_app
from sdk.fleet_server.artifacts import DEFAULT_MAX_UPLOAD, DEFAULT_RECHECK_S, ArtifactStore
from sdk.fleet_server.auth import TokenCheck, read_token_file
from sdk.fleet_server.budgets import IngestLimits
from sdk.fleet_server.db import Database, open_database
from sdk.fleet_server.driver import Driver, DriverConfig, Lease
from sdk.fleet_server.enrollment import Broker, EnrollConfig, Enrollment
from sdk.fleet_server.http_limits import ACCEPT_BACKLOG, HttpLimits
from sdk.fleet_server.ingest import Ingest
from sdk.fleet_server.log_ingest import LogIngest
from sdk.fleet_server.retention import JOB_ROWS_PER_DEVICE, Pruner, RetentionPolicy
from sdk.fleet_server.startup import joining_problem
from sdk.fleet_server.tls_context import ServerTls, server_context
from sdk.keys import load_operator_key

if TYPE_CHECKING:  # uvicorn (under http_guard) is imported by serve() only
    from sdk.fleet_server.http_guard import Guard

log = logging.getLogger("edgepack.fleet_server")

DEFAULT_LISTEN = "127.0.0.1:8760"
DEFAULT_DB = "sqlite:///fleet.db"
_WILDCARDS = {"", "0.0.0.0", "::", "[::]"}


def parse_listen(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` too) into its parts; :class:`ServerConfigError` otherwise."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ServerConfigError(f"--listen must be HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)


def check_public_url(url: str) -> str:
    """An http(s) base URL without query or fragment, its trailing slash removed."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
        raise ServerConfigError(f"--public-url must be an http(s) URL like https://cdn.example/models, got {url!r}")
    return url.rstrip("/")


def default_server_id(listen: str) -> str:
    """``<host name>-<port>``, made to fit the id pattern: stable across restarts (the MQTT
    session of a server is kept under it), different for two servers on one machine."""
    host = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname()) or "host"
    candidate = f"{host[:50]}-{parse_listen(listen)[1]}".lstrip(".-_") or "fleet"
    return candidate if is_valid_id(candidate) else f"fleet-{parse_listen(listen)[1]}"


@dataclass(frozen=True)
class ServerConfig:
    """Everything ``edgepack fleet serve`` takes (docs/fleet-server.md lists each flag)."""

    broker: BrokerOptions
    trust: tuple[Path, ...]
    token_file: Path
    operator_key: Path
    rotation_operator_keys: tuple[Path, ...] = ()  # more --operator-key: devices not holding the first yet
    db_url: str = DEFAULT_DB
    listen: str = DEFAULT_LISTEN
    artifacts_dir: Path = Path("artifacts")
    public_url: str | None = None
    retention: RetentionPolicy = field(default_factory=RetentionPolicy)
    server_id: str | None = None
    share_group: str = "edgepack-fleet"
    silence_s: float = 60.0
    max_upload: int = DEFAULT_MAX_UPLOAD
    driver: DriverConfig = field(default_factory=DriverConfig)
    http: HttpLimits = field(default_factory=HttpLimits)
    init: bool = False  # a database without a fleet may be made one even beside stored artifacts
    artifact_recheck_s: float = DEFAULT_RECHECK_S
    ingest_limits: IngestLimits = field(default_factory=IngestLimits)
    job_events_kept: int = JOB_ROWS_PER_DEVICE  # per device, the newest
    per_server_urls: bool = False  # several servers without --public-url: devices allow every server's origin
    enroll: EnrollConfig = field(default_factory=EnrollConfig)
    tls: ServerTls | None = None  # HTTPS on --listen (tls_context.py, tls_listener.py)
    alerts: AlertsConfig | None = None  # --alerts FILE: rules and sinks (sdk/fleet_server/alert_runner.py)

    def resolved_id(self) -> str:
        server_id = self.server_id or default_server_id(self.listen)
        if not is_valid_id(server_id):
            raise ServerConfigError(f"--server-id {server_id!r} must be 1 to 64 letters, digits, '.', '_' or '-'")
        return server_id


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class FleetServer:
    """The parts, started and stopped together."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.server_id = config.resolved_id()
        self.host, self.port = parse_listen(config.listen)
        self.public_url = check_public_url(config.public_url) if config.public_url else None
        if self.public_url is None and self.host in _WILDCARDS:
            raise ServerConfigError(f"--listen {config.listen} is not an address devices can fetch from: give "
                                    "--public-url (e.g. http://fleet.example:8760/artifacts)")
        if not config.trust:
            raise ServerConfigError("give at least one --trust release public key (uploads are verified with it)")
        self.tokens = TokenCheck(read_token_file(config.token_file))
        self.trust = TrustStore.from_paths(config.trust, kind=RELEASE)
        self.operator_key: SigningKey = load_operator_key(config.operator_key)
        self.operator_keys: tuple[SigningKey, ...] = (self.operator_key, *(
            load_operator_key(path) for path in config.rotation_operator_keys))
        if len({key.key_id for key in self.operator_keys}) != len(self.operator_keys):
            raise ServerConfigError("--operator-key names the same key twice")
        self.tls_context = server_context(config.tls) if config.tls is not None else None
        self.scheme = "https" if self.tls_context is not None else "http"
        if not 0 < config.max_upload <= 16 * 1024**3:
            raise ServerConfigError(f"--max-upload {config.max_upload} must be 1 byte to 16 GiB")
        self.started_at = time.time()
        self.database: Database | None = None
        self.ingest: Ingest | None = None
        self.logs: LogIngest | None = None
        self.driver: Driver | None = None
        self.pruner: Pruner | None = None
        self.enrollment: Enrollment | None = None
        self._files_stop = threading.Event()
        self.alerts: AlertRunner | None = None
        self._threads: list[threading.Thread] = []
        self._api: ApiContext | None = None
        self.http_guard: Guard | None = None  # the connection guard, once serve() made it
        self.store = ArtifactStore(config.artifacts_dir, self.trust, max_bytes=config.max_upload,
                                   recheck_s=config.artifact_recheck_s)

    def artifact_url(self, sha256: str) -> str:
        if self.public_url is not None:
            return f"{self.public_url}/{sha256}.edgepkg"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}/artifacts/{sha256}.edgepkg"

    # ---------------------------------------------------------------- lifecycle

    def start(self) -> None:
        """Open the database (migrating it), connect to the broker, start the loops."""
        self.database = open_database(self.config.db_url, stored_artifacts=self.store.count(),
                                      init=self.config.init)
        holder = Lease(self.database, self.server_id, self.config.driver.lease_ttl_s).current()
        problem = joining_problem(None if holder is None else holder["holder"], self.server_id,
                                  public_url=self.public_url, per_server_urls=self.config.per_server_urls)
        if problem:
            self.database.close()
            raise ServerConfigError(problem)
        self.pruner = Pruner(self.database, self.config.retention, job_rows_per_device=self.config.job_events_kept)
        self.ingest = Ingest(self.database, self.config.broker, server_id=self.server_id,
                             limits=self.config.ingest_limits,
                             share_group=self.config.share_group)
        self.logs = LogIngest(self.database, self.config.broker, server_id=self.server_id,
                              share_group=self.config.share_group)  # device logs (fetch-logs answers)
        try:
            self.ingest.start()
            self.logs.start()
        except EdgepackError:
            self.logs.stop()
            self.ingest.stop()
            raise
        assert self.ingest.control is not None
        self.driver = Driver(self.database, self.ingest.control, self.ingest.topics, self.operator_key,
                             self.artifact_url, self.server_id, self.config.driver, on_lead=self._on_lead,
                             artifact_available=lambda sha: self.public_url is not None or self.store.has(sha),
                             rotation_keys=self.operator_keys[1:])
        self._next_prune = time.time() + self.config.retention.interval_s
        self._start_enrollment()
        if self.config.alerts is not None:
            self.alerts = start_alerts(self.database, self.config.alerts, self.ingest.control, server_id=self.server_id)
        thread = threading.Thread(target=self.driver.run, name="fleet-driver", daemon=True)
        thread.start()
        self._threads.append(thread)
        log.info("fleet server %s: database %s, broker %s, artifacts %s", self.server_id, self.database.dialect,
                 self.config.broker.address, self.config.artifacts_dir)

    def _start_enrollment(self) -> None:
        """Device enrollment (sdk/fleet_server/enrollment.py) and its broker files: written now (a
        broker with ``crlfile`` needs the CRL to start) and kept current by their own thread."""
        assert self.database is not None
        enroll = self.config.enroll
        broker = enroll.broker
        if broker is None:
            host, port = parse_broker(self.config.broker.address)
            broker = Broker(host, port, self.config.broker.tls is not None)
        extra = ""
        if enroll.broker_ca is not None:
            try:
                extra = enroll.broker_ca.read_text()
            except (OSError, UnicodeDecodeError) as err:
                raise ServerConfigError(f"cannot read --broker-ca {enroll.broker_ca}: {err}") from err
        files = replace(enroll.files, root=self.config.broker.topic_root)
        self.enrollment = Enrollment(self.database, enroll.ca_dir, broker, enroll.validity_days, extra, files)
        self._next_renewal = 0.0
        if files.acl or files.crl or files.passwords:
            self.enrollment.refresh_files()
            thread = threading.Thread(target=self._keep_broker_files, name="fleet-broker-files", daemon=True)
            thread.start()
            self._threads.append(thread)

    def _keep_broker_files(self) -> None:
        """Rewrite the broker files when the database says otherwise (another server enrolled a
        device, an operator changed its groups)."""
        assert self.enrollment is not None
        while not self._files_stop.wait(self.config.enroll.files_interval_s):
            try:
                self.enrollment.refresh_files()
            except Exception:  # retried at the next interval; the files keep their last content
                log.exception("writing the broker files failed")

    def _clear_retained_state(self, device: str) -> None:
        """Publish the empty retained state that removes a decommissioned device from the broker
        (``fleet status --broker`` and every other reader then forget it); the shipped ACL lets
        the operator account the server logs in as write ``dev/+/state`` for exactly this."""
        assert self.ingest is not None and self.ingest.control is not None
        self.ingest.control.publish(self.ingest.topics.state(device), b"", qos=1, retain=True)

    def _on_lead(self, now: float) -> None:
        """Called by the driver on each round it leads: the retention job runs there, on one server."""
        if now >= self._next_renewal and self.enrollment is not None and self.driver is not None:
            self._next_renewal = now + self.config.enroll.renew_interval_s
            try:
                self.enrollment.send_renewals(self.driver, now)
            except Exception:  # retried at the next interval
                log.exception("sending certificate renewals failed")
        if now >= self._next_prune and self.pruner is not None:
            self._next_prune = now + self.config.retention.interval_s
            try:
                self.pruner.run_once(now)
            except Exception:  # retried at the next interval; never stops the rollouts
                log.exception("telemetry pruning failed")
        if self.alerts is not None:
            try:
                self.alerts.maybe_run(now)
            except Exception:  # judged again at the next interval; never stops the rollouts
                log.exception("judging the alert rules failed")

    def stop(self) -> None:
        self._files_stop.set()
        if self.driver is not None:
            self.driver.stop()
        for thread in self._threads:
            thread.join(15)
        if self.alerts is not None:
            self.alerts.stop()
        if self.ingest is not None:
            self.ingest.stop()
        if self.logs is not None:
            self.logs.stop()
        if self.database is not None:
            self.database.close()  # on SQLite: the WAL checkpointed into the file

    # ---------------------------------------------------------------- views

    def status(self) -> dict[str, Any]:
        assert self.ingest is not None and self.driver is not None
        lease = self.driver.lease.current()
        return {
            "server_id": self.server_id,
            "started_at": self.started_at,
            "database": self.database.dialect if self.database else None,
            "broker": self.config.broker.address,
            "leader": self.driver.leader,
            "lease": lease,
            "ingest": {**self.ingest.counters.to_json(), "queue_depth": self.ingest.queue_depth,
                       "queue_bytes": self.ingest.queue_bytes, "dropped_by_device": self.ingest.drops.top(50),
                       "rate_per_s": round(self.ingest.rate(time.time()), 3),
                       "control_connected": bool(self.ingest.control and self.ingest.control.connected),
                       "telemetry_connected": bool(self.ingest.telemetry and self.ingest.telemetry.connected)},
            "logs": {name: dict(counter) for name, counter in self.logs.counters.items()} if self.logs else {},
            "driver": {"ticks": self.driver.ticks, "sent": self.driver.sent, "resent": self.driver.resent,
                       "refused_by_broker": self.driver.refused_by_broker,
                       "rollout_errors": self.driver.rollout_errors,
                       "requeried": self.driver.requeried,
                       "targets": {"sent": self.driver.target_sent, "converged": self.driver.converged,
                                   "errors": self.driver.reconcile_errors}},
            "retention": {"raw_s": self.config.retention.raw_s, "rollup_s": self.config.retention.rollup_s,
                          "step_s": self.config.retention.step_s, "audit_s": self.config.retention.audit_s,
                          "runs": self.pruner.runs if self.pruner else 0,
                          "folded": self.pruner.folded if self.pruner else 0},
            "artifact_base_url": self.artifact_url("0" * 64).rsplit("/", 1)[0],
            "http": self.http_guard.to_json() if self.http_guard is not None else None,
            "alerts": self.alerts.to_json() if self.alerts is not None else None,
        }

    def metrics(self) -> str:
        """Prometheus text exposition (format 0.0.4)."""
        assert self.database is not None and self.ingest is not None and self.driver is not None
        now = time.time()
        lines: list[str] = []

        def metric(name: str, kind: str, help_text: str, samples: list[tuple[dict[str, str], float]]) -> None:
            lines.append(f"# HELP {name} {help_text}")
            lines.append(f"# TYPE {name} {kind}")
            for labels, value in samples:
                label_text = ",".join(f'{key}="{_escape(str(val))}"' for key, val in labels.items())
                lines.append(f"{name}{{{label_text}}} {value:g}" if label_text else f"{name} {value:g}")

        online = queries.devices_online_by(self.database, now=now, silence_s=self.config.silence_s)
        metric("edgepack_fleet_devices_online", "gauge", "Devices online, by model version and provider.",
               [({"version": v, "provider": p}, n) for v, p, n in online] or [({}, 0)])
        states = queries.rollout_state_counts(self.database)
        metric("edgepack_fleet_rollouts", "gauge", "Rollouts by state.",
               [({"state": s}, states.get(s, 0)) for s in ("pending", "running", "paused", "succeeded", "failed",
                                                           "aborted")])
        counters = self.ingest.counters
        metric("edgepack_fleet_ingest_received_total", "counter", "MQTT messages received by this server, by kind.",
               [({"kind": k}, counters.received[k]) for k in ("state", "telemetry", "job", "cmd")])
        metric("edgepack_fleet_ingest_stored_total", "counter", "Messages stored by this server, by kind.",
               [({"kind": k}, counters.stored[k]) for k in ("state", "telemetry", "job", "command_external")])
        metric("edgepack_fleet_ingest_dropped_total", "counter", "Messages dropped, by reason.",
               [({"reason": r}, n) for r, n in sorted(counters.dropped.items())] or [({"reason": "none"}, 0)])
        metric("edgepack_fleet_ingest_dropped_by_device_total", "counter", "Messages dropped, by device and "
               "reason (the 50 devices with the most drops).",
               [({"device": d, "reason": r}, n) for d, reasons in self.ingest.drops.top(50).items()
                for r, n in sorted(reasons.items())] or [({"device": "none", "reason": "none"}, 0)])
        metric("edgepack_fleet_ingest_dead_letters_total", "counter", "Messages that could not be stored, kept "
               "in the dead-letter table (GET /api/dead-letters), by kind.",
               [({"kind": k}, counters.dead_letters[k]) for k in ("state", "telemetry", "job")])
        metric("edgepack_fleet_ingest_clamped_total", "counter", "Summed counters clamped at parse, by field.",
               [({"field": f}, counters.clamped[f]) for f in ("errors_total", "errors_interval")])
        metric("edgepack_fleet_ingest_rate", "gauge", "Telemetry messages stored per second (last 10 s).",
               [({}, round(self.ingest.rate(now), 3))])
        metric("edgepack_fleet_ingest_lag_seconds", "gauge", "Receipt to commit, the last batch.",
               [({}, round(counters.last_lag_s, 4))])
        metric("edgepack_fleet_ingest_lag_max_seconds", "gauge", "Receipt to commit, the largest since start.",
               [({}, round(counters.max_lag_s, 4))])
        metric("edgepack_fleet_ingest_queue_depth", "gauge", "Messages received, not yet stored.",
               [({}, self.ingest.queue_depth)])
        metric("edgepack_fleet_ingest_queue_bytes", "gauge", "What the queued messages cost (payload and "
               "overhead); bounded.", [({}, self.ingest.queue_bytes)])
        metric("edgepack_fleet_leader", "gauge", "1 while this server holds the rollout lease.",
               [({"server": self.server_id}, 1 if self.driver.leader else 0)])
        metric("edgepack_fleet_commands_sent_total", "counter", "Commands the broker acknowledged.",
               [({}, self.driver.sent)])
        metric("edgepack_fleet_commands_resent_total", "counter", "Commands published again after a crash.",
               [({}, self.driver.resent)])
        guard = self.http_guard
        if guard is not None:
            metric("edgepack_fleet_http_connections", "gauge", "Open HTTP connections.", [({}, len(guard.open))])
            metric("edgepack_fleet_http_connections_dropped_total", "counter", "HTTP connections closed by the "
                   "server's limits, by reason (head_timeout, body_too_slow, evicted, over_cap; "
                   "plain_http_on_tls: a plain request told to use https://).",
                   [({"reason": r}, guard.dropped[r]) for r in ("head_timeout", "body_too_slow", "evicted",
                                                                 "over_cap", "plain_http_on_tls")])
        api = self._api
        metric("edgepack_fleet_api_requests_total", "counter", "Authenticated API requests.",
               [({}, api.requests if api else 0)])
        metric("edgepack_fleet_api_auth_failures_total", "counter", "API requests refused for a missing or "
               "wrong token.", [({}, api.auth_failures if api else 0)])
        if self.alerts is not None:
            metric("edgepack_fleet_alerts_total", "counter", "Alerts each sink sent or gave up, by sink and outcome.",
                   [({"sink": sink.name, "outcome": outcome}, count) for sink in self.alerts.sinks
                    for outcome, count in (("sent", sink.sent), ("given_up", sink.given_up))] or [({}, 0)])
        return "\n".join(lines) + "\n"

    def api_context(self) -> ApiContext:
        assert self.database is not None
        self._api = ApiContext(database=self.database, tokens=self.tokens, store=self.store,
                          retention=self.config.retention, artifact_url=self.artifact_url,
                          silence_s=self.config.silence_s, status=self.status, metrics=self.metrics,
                          wake_driver=self.driver.wake if self.driver else (lambda: None),
                          clear_retained_state=self._clear_retained_state,
                          command_ttl_s=self.config.driver.command_ttl_s, commands=self.driver,
                          enrollment=self.enrollment)
        return self._api


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound now so a busy port is one line at start. Made with
    ``IPPROTO_TCP`` named: asyncio turns Nagle off (TCP_NODELAY) only on accepted sockets whose
    protocol says TCP, and with Nagle on, an answer's body waits for the ACK of its head, which
    the client delays by 40 ms (every keep-alive request, every HTTPS request)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host or "0.0.0.0", port))
    except OSError as err:
        sock.close()
        raise ServerConfigError(f"cannot listen on {host}:{port}: {err.strerror or err}") from err
    sock.listen(ACCEPT_BACKLOG)
    sock.set_inheritable(True)
    return sock


def _exit_on_sigterm(_signum: int, _frame: Any) -> None:
    raise SystemExit(0)


def _protocol(server: FleetServer, guard: Guard) -> type[Any]:
    """The guarded h11 protocol, behind the TLS sniffer when the server speaks HTTPS."""
    from sdk.fleet_server.http_guard import protocol_class

    if server.tls_context is None:
        return protocol_class(guard)
    from sdk.fleet_server.tls_listener import tls_protocol_class

    host = f"[{server.host}]" if ":" in server.host else server.host
    return tls_protocol_class(guard, server.tls_context, f"{host}:{server.port}")


def serve(config: ServerConfig) -> None:
    """Run the fleet server until SIGTERM or SIGINT, then stop its parts (the database last).

    uvicorn raises the signal that stopped it again once it is done; with SIGTERM's default
    action that killed the process before the stop below ran (the driver, the ingest, the
    SQLite checkpoint). With this handler the SIGTERM (also one during start-up) is a
    ``SystemExit``: the ``finally`` runs, the exit status is 0; SIGINT is ``KeyboardInterrupt``."""
    import uvicorn

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _exit_on_sigterm)

    from sdk.fleet_server.http_guard import Guard, raise_fd_limit

    server = FleetServer(config)
    server.http_guard = guard = Guard(config.http, raise_fd_limit(config.http))
    sock = bind(server.host, server.port)
    try:
        server.start()
        context = server.api_context()
        app = build_app(context)
        uv = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                                           timeout_graceful_shutdown=5, server_header=False,
                                           http=_protocol(server, guard), backlog=ACCEPT_BACKLOG))
        log.info("listening on %s://%s:%d (pid %d)", server.scheme, server.host, server.port, os.getpid())
        uv.run(sockets=[sock])
    finally:
        server.stop()
        sock.close()
