"""``--ca`` / ``EDGEPACK_SERVER_CA`` and ``--client-cert``/``--client-key`` on every command that
talks to the fleet server.

Why a decorator that stores into the click context instead of parameters: about twenty
commands take the server flags (``_server_options`` in rollout.py, and the commands with their
own ``--server``); their functions stay as they are, and :func:`server_tls` hands the settings to
:func:`sdk.cli.rollout.client_for`, the one place a :class:`~sdk.fleet_server.client.FleetClient`
is made.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from sdk.fleet_server.client import ClientTls

_META = "edgepack.server_tls"
_FILE = click.Path(exists=True, dir_okay=False, path_type=Path)


def _keep(ctx: click.Context, param: click.Parameter, value: Path | None) -> None:
    if value is not None and param.name:
        ctx.meta.setdefault(_META, {})[param.name] = value


def tls_options(func: Any) -> Any:
    """The three TLS flags, kept in the click context (not passed to ``func``)."""
    func = click.option(
        "--client-key",
        type=_FILE,
        expose_value=False,
        callback=_keep,
        envvar="EDGEPACK_SERVER_CLIENT_KEY",
        help="Mutual TLS: the private key of --client-cert (or EDGEPACK_SERVER_CLIENT_KEY).",
    )(func)
    func = click.option(
        "--client-cert",
        type=_FILE,
        expose_value=False,
        callback=_keep,
        envvar="EDGEPACK_SERVER_CLIENT_CERT",
        help="Mutual TLS: this client's certificate (PEM; or EDGEPACK_SERVER_CLIENT_CERT).",
    )(func)
    return click.option(
        "--ca",
        type=_FILE,
        expose_value=False,
        callback=_keep,
        envvar="EDGEPACK_SERVER_CA",
        help="Verify an https:// server with this CA certificate (PEM) instead of the system's "
        "(or EDGEPACK_SERVER_CA; docs/tls.md).",
    )(func)


def server_tls() -> ClientTls | None:
    """The TLS flags of the running command, or None when none was given."""
    ctx = click.get_current_context(silent=True)
    given: dict[str, Path] = ctx.find_root().meta.get(_META, {}) if ctx is not None else {}
    if not given:
        return None
    if ("client_cert" in given) != ("client_key" in given):
        raise click.UsageError("give --client-cert and --client-key together")
    return ClientTls(ca=given.get("ca"), cert=given.get("client_cert"), key=given.get("client_key"))
