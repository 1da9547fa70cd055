"""``edgepack fleet serve``: the persistent fleet server (needs the ``server`` extra)."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import click

from sdk.broker import BrokerOptions
from sdk.cli.broker_options import broker_options
from sdk.cli.enroll import enroll_options
from sdk.cli.fleet import fleet
from sdk.cli.fleet_db import database_url, db_password_option
from sdk.cli.terminal import EscapingFormatter
from sdk.errors import ServerConfigError

_FILE = click.Path(exists=True, dir_okay=False, path_type=Path)
_SIZE = re.compile(r"([0-9]+)([KMG]?)B?", re.IGNORECASE)


def parse_size(text: str) -> int:
    """``512M``, ``1G``, ``1048576`` into bytes."""
    match = _SIZE.fullmatch(text.strip())
    if match is None:
        raise click.BadParameter(f"{text!r} is not a size like 512M or 1G")
    return int(match[1]) * {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3}[match[2].upper()]


def _duration(text: str) -> float:
    from sdk.fleet_server.retention import parse_duration

    try:
        return parse_duration(text)
    except ServerConfigError as err:
        raise click.BadParameter(str(err)) from err


def _rate(text: str, flag: str) -> Any:
    from sdk.fleet_server.budgets import parse_rate

    try:
        return parse_rate(text, flag)
    except ValueError as err:
        raise click.BadParameter(str(err)) from err


def _tls(cert: Path | None, key: Path | None, client_ca: Path | None) -> Any:
    """``--tls-*`` into the server's TLS settings, or None for plain HTTP."""
    from sdk.fleet_server.tls_context import ServerTls

    if cert is None and key is None:
        if client_ca is not None:
            raise click.UsageError("--tls-client-ca goes with --tls-cert and --tls-key")
        return None
    if cert is None or key is None:
        raise click.UsageError("give both --tls-cert and --tls-key")
    return ServerTls(cert=cert, key=key, client_ca=client_ca)


@fleet.command()
@broker_options(cert_flag="--broker-tls-cert", key_flag="--broker-tls-key")
@enroll_options
@click.option("--db", "db_url", default="sqlite:///fleet.db", show_default=True, envvar="EDGEPACK_FLEET_DB",
              help="Database URL: sqlite:///FILE (WAL; one server) or postgresql://USER@HOST/DB (several servers; "
                   "or EDGEPACK_FLEET_DB); its password from --db-password-file or EDGEPACK_DB_PASSWORD.")
@db_password_option
@click.option("--alerts", "alerts_file", type=_FILE,
              help="Alert rules and where alerts go (webhooks, an MQTT topic): a YAML file (docs/fleet-server.md, "
                   "\"Alerts\").")
@click.option("--listen", default="127.0.0.1:8760", show_default=True, help="HOST:PORT of the HTTP API.")
@click.option("--artifacts", "artifacts_dir", type=click.Path(file_okay=False, path_type=Path),
              default=Path("artifacts"), show_default=True, help="Folder of the artifact store.")
@click.option("--trust", multiple=True, required=True, type=_FILE,
              help="Release public key that uploads must be signed by (repeatable, for rotation).")
@click.option("--token-file", required=True, type=_FILE, envvar="EDGEPACK_FLEET_TOKEN_FILE",
              help="Bearer tokens, one NAME:TOKEN per line, mode 600 (or EDGEPACK_FLEET_TOKEN_FILE).")
@click.option("--operator-key", "operator_keys", required=True, multiple=True, type=_FILE,
              envvar="EDGEPACK_OPERATOR_KEY",
              help="Operator private key that signs the commands the server sends (edgepack keygen --operator); "
                   "repeatable for a rotation: a device's commands are signed by the first key it reports holding "
                   "(the first key for a device that reported none).")
@click.option("--public-url", help="Devices fetch artifacts from this base URL (a CDN or object store holding "
                                   "<sha256>.edgepkg) instead of this server.")
@click.option("--per-server-urls", is_flag=True,
              help="Start beside other servers on this database without --public-url: each server sends devices "
                   "its own address (every device must allow every server's origin).")
@click.option("--retention-raw", default="1h", show_default=True,
              help="How long raw telemetry samples are kept (90s, 15m, 1h, 2d).")
@click.option("--retention-rollups", default="30d", show_default=True,
              help="How long per-minute rollups are kept (job events too).")
@click.option("--rollup-step", type=click.IntRange(1, 86400), default=60, show_default=True,
              help="Seconds per rollup bucket.")
@click.option("--prune-interval", default="60s", show_default=True, help="How often the retention job runs.")
@click.option("--silence", default="60s", show_default=True,
              help="A device not heard from for this long counts as offline.")
@click.option("--server-id", help="This server's id (default: HOSTNAME-PORT); its MQTT session is kept under it.")
@click.option("--share-group", default="edgepack-fleet", show_default=True,
              help="MQTT 5 shared-subscription group: servers in one group split the telemetry.")
@click.option("--max-upload", default="1G", show_default=True, help="Largest artifact upload (512M, 1G).")
@click.option("--lease-ttl", default="5s", show_default=True,
              help="The rollout lease's lifetime: another server takes over this long after the leader dies.")
@click.option("--tick", default="0.5s", show_default=True, help="How often rollouts are advanced.")
@click.option("--requery-after", default="60s", show_default=True,
              help="A delivered deploy whose job has no final answer and has been silent this long is published "
                   "again (same id and bytes; the device answers with the job as it stands), e.g. after a restore.")
@click.option("--resend-after", default="10s", show_default=True,
              help="A command the broker never acknowledged and the device never answered is sent again after this.")
@click.option("--head-timeout", default="10s", show_default=True,
              help="A connection sends a whole request head within this long of connecting or of its last answer "
                   "(else it is closed; 408 if part came); also the window of --body-min-rate.")
@click.option("--body-min-rate", default="1K", show_default=True,
              help="Bytes per second a request body must keep up (0: no floor); slower: 408, closed.")
@click.option("--max-connections", type=click.IntRange(16, 1_000_000), default=1000, show_default=True,
              help="Open HTTP connections at most (lowered to fit the open-file limit, which is raised to fit "
                   "it where the hard limit allows); over it, the connection waiting longest for a request is "
                   "dropped.")
@click.option("--init", is_flag=True,
              help="Create a new, empty fleet in a database that holds none, also when it is a 0-byte file or the "
                   "artifact store already holds artifacts (refused otherwise: a lost database is not a new fleet).")
@click.option("--artifact-recheck", default="1h", show_default=True,
              help="A stored artifact is hashed again before it is served when it changed on disk or this long "
                   "passed since; one that no longer matches its sha256 is quarantined (410).")
@click.option("--budget-job", default="10/200", show_default=True,
              help="Job events each device may send: PER_SECOND/BURST (a token bucket); the excess is dropped.")
@click.option("--budget-state", default="10/200", show_default=True,
              help="State messages each device may send: PER_SECOND/BURST.")
@click.option("--budget-telemetry", default="20/2000", show_default=True,
              help="Telemetry messages each device may send to this server: PER_SECOND/BURST.")
@click.option("--tls-cert", "https_cert", type=_FILE,
              help="Serve HTTPS with this certificate chain (PEM; with --tls-key; docs/tls.md).")
@click.option("--tls-key", "https_key", type=_FILE, help="The private key of --tls-cert (PEM, mode 600).")
@click.option("--tls-client-ca", "https_client_ca", type=_FILE,
              help="Mutual TLS: refuse every client without a certificate from this CA (PEM).")
@click.option("--audit-keep-days", type=click.IntRange(1, 36500), default=365, show_default=True,
              help="Days the audit log keeps an entry (older ones are deleted by the retention job).")
@click.option("--job-events-kept", type=click.IntRange(1, 10_000_000), default=1000, show_default=True,
              help="Job events kept per device (the newest), besides --retention-rollups.")
def serve(broker: BrokerOptions, db_url: str, listen: str, artifacts_dir: Path, trust: tuple[Path, ...],
          token_file: Path, operator_keys: tuple[Path, ...], public_url: str | None, retention_raw: str,
          retention_rollups: str,
          rollup_step: int, prune_interval: str, silence: str, server_id: str | None, share_group: str,
          max_upload: str, lease_ttl: str, tick: str, requery_after: str, resend_after: str, head_timeout: str,
          body_min_rate: str,
          max_connections: int, init: bool, artifact_recheck: str, budget_job: str, budget_state: str,
          budget_telemetry: str, job_events_kept: int, per_server_urls: bool, audit_keep_days: int,
          https_cert: Path | None, https_key: Path | None, https_client_ca: Path | None,
          db_password_file: Path | None, alerts_file: Path | None, enroll: Any) -> None:
    """Run the fleet server: store state, telemetry and jobs, drive rollouts, serve the REST API.

    Devices, telemetry and job events are kept in the database; rollouts run on the server and
    survive its restart; the API (docs/fleet-server.md) needs the bearer token."""
    try:
        from sdk.fleet_server.alert_config import load_alerts
        from sdk.fleet_server.budgets import IngestLimits
        from sdk.fleet_server.driver import DriverConfig
        from sdk.fleet_server.http_limits import HttpLimits
        from sdk.fleet_server.retention import RetentionPolicy
        from sdk.fleet_server.schema_upgrade import quiet_alembic
        from sdk.fleet_server.server import ServerConfig
        from sdk.fleet_server.server import serve as run_server
    except ImportError as err:
        raise ServerConfigError(f"edgepack fleet serve needs the server extra (pip install 'edgepack[server]'): "
                                f"{err}") from err
    log_lines = logging.StreamHandler()  # device text in the log lines (rollout reasons): escaped
    log_lines.setFormatter(EscapingFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=logging.INFO, handlers=[log_lines])
    logging.getLogger("edgepack.mqtt").setLevel(logging.WARNING)
    quiet_alembic(verbose=bool(click.get_current_context().find_root().meta.get("edgepack.verbose")))
    db_url = database_url(db_url, db_password_file)
    alerts = load_alerts(alerts_file) if alerts_file is not None else None
    retention = RetentionPolicy(raw_s=_duration(retention_raw), rollup_s=_duration(retention_rollups),
                                step_s=rollup_step, interval_s=_duration(prune_interval),
                                audit_s=audit_keep_days * 86400.0)
    driver = DriverConfig(tick_s=_duration(tick), lease_ttl_s=_duration(lease_ttl),
                          resend_after_s=_duration(resend_after), silence_s=_duration(silence),
                          requery_after_s=_duration(requery_after))
    limits = IngestLimits(job=_rate(budget_job, "--budget-job"), state=_rate(budget_state, "--budget-state"),
                          telemetry=_rate(budget_telemetry, "--budget-telemetry"))
    http = HttpLimits(head_timeout_s=_duration(head_timeout), body_min_rate=parse_size(body_min_rate),
                      max_connections=max_connections)
    config = ServerConfig(broker=broker, trust=trust, token_file=token_file, operator_key=operator_keys[0],
                          rotation_operator_keys=operator_keys[1:], db_url=db_url,
                          listen=listen, artifacts_dir=artifacts_dir, public_url=public_url, retention=retention,
                          server_id=server_id, share_group=share_group, silence_s=_duration(silence),
                          max_upload=parse_size(max_upload), driver=driver,
                          http=http, init=init, artifact_recheck_s=_duration(artifact_recheck),
                          ingest_limits=limits, job_events_kept=job_events_kept, per_server_urls=per_server_urls,
                          tls=_tls(https_cert, https_key, https_client_ca), alerts=alerts, enroll=enroll)
    run_server(config)


@fleet.command()
@click.option("--db", "db_url", envvar="EDGEPACK_FLEET_DB", required=True,
              help="The fleet server's database URL (as given to fleet serve; or EDGEPACK_FLEET_DB).")
@db_password_option
@click.argument("out", type=click.Path(dir_okay=False, writable=True, path_type=Path))
def backup(db_url: str, out: Path, db_password_file: Path | None) -> None:
    """Write a consistent copy of the fleet's database to OUT while servers run.

    SQLite: the online backup API (a plain copy of a WAL database can miss commits). PostgreSQL:
    pg_dump --format=custom (restore with pg_restore; docs/fleet-server.md, "Backup and restore")."""
    try:
        from sdk.fleet_server.backup import backup as run_backup
    except ImportError as err:
        raise ServerConfigError(f"edgepack fleet backup needs the server extra (pip install 'edgepack[server]'): "
                                f"{err}") from err
    click.echo(run_backup(database_url(db_url, db_password_file), out))
