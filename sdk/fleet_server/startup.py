"""Start-up checks for a server joining a database other servers use. Pure.

Several fleet servers share one PostgreSQL database (docs/fleet-server.md, "Several servers"):
one leads the rollouts at a time, and the one that takes over after a failover signs the
commands from then on. Without ``--public-url`` each server tells devices to fetch artifacts from
its own address, so after a failover a device that allows only the first server's origin refuses
every command (``the artifact URL is not on an origin this device allows``) and the wave fails.
A server therefore refuses to join a database another server has led unless the artifacts have
one address for all (``--public-url``), or the operator says every device allows every server's
origin (``--per-server-urls``).

And a database without a fleet beside signs that one existed is not made a new fleet
(:func:`new_fleet_refusal`, used by :func:`~.db.open_database`).
"""

from __future__ import annotations


def joining_problem(lease_holder: str | None, me: str, *, public_url: str | None, per_server_urls: bool) -> str:
    """Why this server must not start on this database, or "" when it may. ``lease_holder`` is
    the server that holds or last held the rollout lease (None on a database no server led)."""
    if lease_holder is None or lease_holder == me or public_url is not None or per_server_urls:
        return ""
    return (f"fleet server {lease_holder!r} also uses this database: without --public-url each server sends devices "
            f"its own address and a device that allows one refuses the other's commands after a failover; give "
            f"--public-url (one address of the artifacts for every server), or --per-server-urls if every device "
            f"allows every server's origin (updates.allowed_origins), or the same --server-id if this is that server")


def new_fleet_refusal(*, has_schema: bool, empty_file: bool, stored_artifacts: int, init: bool,
                      where: str) -> str | None:
    """Why the server must not start on this database, or None. Pure.

    A database without a fleet schema beside an artifact store that holds artifacts, or a
    SQLite file of 0 bytes, is a fleet whose database was lost or damaged, not a new fleet:
    starting would serve an empty fleet without a word. ``--init`` says a new fleet is meant;
    on a database that holds one it is refused (it would mean the operator expected none)."""
    if has_schema:
        return f"--init: {where} already holds a fleet; start without --init" if init else None
    if init:
        return None
    if empty_file:
        return (f"{where} is an empty file (0 bytes), not a fleet: restore it from a backup, or start with --init "
                "to create a new, empty fleet")
    if stored_artifacts:
        return (f"{where} holds no fleet but the artifact store holds {stored_artifacts} artifact(s): restore the "
                "database from a backup, or start with --init to create a new fleet beside them")
    return None
