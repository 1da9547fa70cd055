"""``edgepack fleet enroll`` and ``edgepack fleet revoke`` (over the fleet server's API), and the
enrollment flags of ``edgepack fleet serve`` (docs/enrollment.md)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from sdk.cli.fleet import fleet
from sdk.cli.rollout import _server_options, client_for
from sdk.cli.terminal import echo
from sdk.errors import ServerConfigError

_FILE = click.Path(exists=True, dir_okay=False, path_type=Path)
_OUT = click.Path(dir_okay=False, path_type=Path)

_SERVE_OPTIONS = [
    click.option(
        "--ca-dir",
        type=click.Path(file_okay=False, path_type=Path),
        default=Path("fleet-ca"),
        show_default=True,
        help="Folder of the fleet CA that signs device certificates (made on first use; the key 0600).",
    ),
    click.option(
        "--cert-validity",
        type=click.IntRange(1, 825),
        default=90,
        show_default=True,
        help="Days a device certificate is valid (rotated after two thirds of it).",
    ),
    click.option(
        "--enroll-broker",
        help="The broker devices are told to use, mqtts://HOST:PORT or mqtt://HOST:PORT "
        "(default: --broker, TLS if --tls).",
    ),
    click.option(
        "--broker-ca",
        type=_FILE,
        help="CA certificate that signed the broker's server certificate, sent "
        "to devices with the fleet CA (default: the fleet CA alone).",
    ),
    click.option(
        "--broker-acl-file",
        type=_OUT,
        help="Write the broker's ACL here (the shipped patterns + a section "
        "per device with the groups the server holds).",
    ),
    click.option(
        "--broker-acl-base",
        type=_FILE,
        help="The ACL whose lines the generated one keeps (default: "
        "--broker-acl-file as installed, e.g. deploy/mosquitto/acl).",
    ),
    click.option(
        "--broker-crl-file", type=_OUT, help="Write the CRL of revoked device certificates here (mosquitto crlfile)."
    ),
    click.option(
        "--broker-password-file",
        type=_OUT,
        help="Write a mosquitto password file here: --broker-password-base's lines + devices enrolled with --password.",
    ),
    click.option(
        "--broker-password-base",
        type=_FILE,
        help="Password file (mosquitto_passwd) of the accounts that are not devices, e.g. operator.",
    ),
    click.option(
        "--broker-reload-command", help="Run after a broker file changed, e.g. 'systemctl reload mosquitto' (no shell)."
    ),
    click.option(
        "--renew-interval",
        default="60s",
        show_default=True,
        help="How often the leading server looks for certificates to rotate.",
    ),
]


def enroll_options(func: Callable[..., Any]) -> Any:
    """Add the enrollment flags to ``fleet serve``; it receives them as ``enroll: EnrollConfig``."""

    @functools.wraps(func)
    def wrapper(
        *args: Any,
        ca_dir: Path,
        cert_validity: int,
        enroll_broker: str | None,
        broker_ca: Path | None,
        broker_acl_file: Path | None,
        broker_acl_base: Path | None,
        broker_crl_file: Path | None,
        broker_password_file: Path | None,
        broker_password_base: Path | None,
        broker_reload_command: str | None,
        renew_interval: str,
        **kwargs: Any,
    ) -> Any:
        from sdk.fleet_server.broker_files import BrokerFiles
        from sdk.fleet_server.enrollment import EnrollConfig, parse_enroll_broker

        for base, target in ((broker_password_base, broker_password_file), (broker_acl_base, broker_acl_file)):
            if base is not None and target is None:
                raise click.UsageError(
                    "--broker-password-base and --broker-acl-base go with the file they are the "
                    "base of (--broker-password-file, --broker-acl-file)"
                )
        try:
            broker = parse_enroll_broker(enroll_broker) if enroll_broker else None
        except ServerConfigError as err:
            raise click.BadParameter(str(err), param_hint="--enroll-broker") from err
        files = BrokerFiles(
            acl=broker_acl_file,
            acl_base=broker_acl_base,
            crl=broker_crl_file,
            passwords=broker_password_file,
            password_base=broker_password_base,
            reload_command=broker_reload_command,
        )
        enroll = EnrollConfig(
            ca_dir=ca_dir,
            validity_days=cert_validity,
            broker=broker,
            broker_ca=broker_ca,
            files=files,
            renew_interval_s=_duration(renew_interval, "--renew-interval"),
        )
        return func(*args, enroll=enroll, **kwargs)

    for option in reversed(_SERVE_OPTIONS):
        wrapper = option(wrapper)
    return wrapper


def _duration(text: str, flag: str = "--expires") -> float:
    from sdk.fleet_server.retention import parse_duration

    try:
        return parse_duration(text)
    except ServerConfigError as err:
        raise click.BadParameter(str(err), param_hint=flag) from err


@fleet.command()
@click.argument("device_id")
@click.option(
    "--group", "groups", multiple=True, help="A group the device belongs to (repeatable); the server holds them."
)
@click.option("--password", is_flag=True, help="A broker password (delivered once) instead of a certificate.")
@click.option("--expires", default="24h", show_default=True, help="How long the token may be used (1m to 30d).")
@click.option("--reason", default="", help="Why (kept in the audit).")
@_server_options
def enroll(
    device_id: str,
    groups: tuple[str, ...],
    password: bool,
    expires: str,
    reason: str,
    server: str,
    token_file: Path | None,
) -> None:
    """Print a one-time enrollment token for DEVICE_ID (admins).

    On the device: edgepack-agent enroll --server URL --token TOKEN --config agent.yaml makes
    its key, sends a CSR and writes its certificate (docs/enrollment.md)."""
    body: dict[str, Any] = {"groups": list(groups), "expires_in_s": _duration(expires), "reason": reason}
    if password:
        body["password"] = True
    done = client_for(server, token_file).post(f"/api/devices/{device_id}/enrollment", body)
    echo(done["token"])
    echo(
        f"one use, until {_when(done['expires_at'])}; on the device: edgepack-agent enroll --server "
        f"{server} --token {done['token']} --config agent.yaml",
        err=True,
    )


@fleet.command()
@click.argument("device_id")
@click.option("--reason", default="", help="Why (kept in the audit).")
@_server_options
def revoke(device_id: str, reason: str, server: str, token_file: Path | None) -> None:
    """Revoke DEVICE_ID's certificates (into the broker's CRL) and broker password (admins)."""
    done = client_for(server, token_file).post(f"/api/devices/{device_id}/revoke", {"reason": reason})
    serials = ", ".join(done["revoked"]) or "none"
    echo(
        f"{device_id}: certificates revoked: {serials}; broker password removed: "
        f"{'yes' if done['password_removed'] else 'no'}"
    )


def _when(ts: float) -> str:
    import time

    return time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(ts))


@fleet.command(name="ca-init")
@click.option(
    "--ca-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("fleet-ca"),
    show_default=True,
    help="Folder of the fleet CA (as given to fleet serve).",
)
@click.option(
    "--crl-file",
    type=_OUT,
    help="Also write an empty CRL here when none exists (mosquitto will not start "
    "without its crlfile; fleet serve keeps it current).",
)
def ca_init(ca_dir: Path, crl_file: Path | None) -> None:
    """Make the fleet CA (if it does not exist) before the broker first starts, and print its
    certificate's path: the broker's cafile for device certificates."""
    import time

    from sdk.fleet_server.ca import CA_CERT, FleetCA
    from sdk.fleet_server.enrollment import write_first_crl

    ca = FleetCA.open(ca_dir, now=time.time())
    if crl_file is not None:
        write_first_crl(ca, crl_file, time.time())
    click.echo(ca_dir / CA_CERT)
