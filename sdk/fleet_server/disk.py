"""What the fleet server keeps on its disk stays its own: file modes and the database password.

The SQLite database holds the fleet (devices, the audit, the signed command bytes) and the
artifact store holds every release: neither is for other users of the machine. The database
file is created 0600 (its WAL and shared-memory files take its mode from SQLite) and the
store's folder 0700; an existing one with a wider mode is tightened at start with one line
that says so. A PostgreSQL password never has to be in the ``--db`` URL (it would be visible
in ``ps`` and in shell history): it comes from ``--db-password-file`` or ``EDGEPACK_DB_PASSWORD``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
from pathlib import Path

from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

from sdk.errors import BrokerOptionError, ServerConfigError

log = logging.getLogger("edgepack.fleet_server.disk")

DB_FILE_MODE = 0o600
STORE_DIR_MODE = 0o700
PASSWORD_ENV = "EDGEPACK_DB_PASSWORD"
SQLITE_SIDE_FILES = ("-wal", "-shm")


def tightened(mode: int, wanted: int) -> int | None:
    """The permission bits ``mode`` should have so that nobody but the owner gets more than
    ``wanted`` allows, or None when it already is that private. Pure."""
    bits = stat.S_IMODE(mode)
    narrower = bits & wanted
    return None if narrower == bits else narrower


def _tighten(path: Path, wanted: int, what: str) -> None:
    """chmod ``path`` down to ``wanted`` if it is wider, with one line saying so."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return
    new = tightened(mode, wanted)
    if new is None:
        return
    try:
        path.chmod(new)
    except OSError as err:
        raise ServerConfigError(
            f"{what} {path} is mode {stat.S_IMODE(mode):o} (readable by others) and cannot "
            f"be made {new:o}: {err.strerror or err}"
        ) from err
    log.warning("%s %s was mode %o; made it %o (only this user may read it)", what, path, stat.S_IMODE(mode), new)


def private_database_file(file: Path) -> None:
    """Create the SQLite file 0600 if it does not exist (before SQLite creates it with the umask's
    mode), or tighten an existing one and its WAL and shared-memory files."""
    file.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.close(os.open(file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, DB_FILE_MODE))
        return
    _tighten(file, DB_FILE_MODE, "the database file")
    for suffix in SQLITE_SIDE_FILES:
        _tighten(file.with_name(file.name + suffix), DB_FILE_MODE, "the database file")


def private_store_dir(directory: Path) -> None:
    """Create the artifact store's folder 0700, or tighten an existing one."""
    try:
        directory.mkdir(mode=STORE_DIR_MODE, parents=True)
    except FileExistsError:
        _tighten(directory, STORE_DIR_MODE, "the artifact store")
        return
    directory.chmod(STORE_DIR_MODE)  # mkdir's mode is masked by the umask; this one is not


def read_db_password(path: Path) -> str:
    """The password in ``--db-password-file``: its first line; a file others can read is refused."""
    from sdk.broker import read_password_file

    try:
        mode = path.stat().st_mode
        password = read_password_file(path)
    except OSError as err:
        raise ServerConfigError(f"--db-password-file: cannot read {path}: {err.strerror or err}") from err
    except BrokerOptionError as err:
        raise ServerConfigError(f"--db-password-file: {err}") from err
    if mode & 0o077:
        raise ServerConfigError(
            f"--db-password-file {path} is readable by others (mode {mode & 0o777:o}); chmod 600 it"
        )
    return password


def url_with_password(url: str, password: str | None, *, flag: str = "--db") -> str:
    """``url`` with ``password`` set (the URL given without one); ``url`` itself when there is no
    password to add. A password given twice, or to SQLite, is refused. Pure."""
    if password is None:
        return url
    try:
        parsed = make_url(url)
    except ArgumentError as err:
        raise ServerConfigError(f"{flag} {url!r} is not a database URL") from err
    if parsed.get_backend_name() != "postgresql":
        raise ServerConfigError(
            f"{flag}: a database password is for PostgreSQL; {parsed.get_backend_name()} takes none"
        )
    if parsed.password is not None:
        raise ServerConfigError(
            f"{flag} already holds a password: give it once, in --db-password-file or "
            f"{PASSWORD_ENV}, and leave it out of the URL"
        )
    return parsed.set(password=password).render_as_string(hide_password=False)


def resolve_password(password_file: Path | None, environ: dict[str, str] | None = None) -> str | None:
    """The database password from ``--db-password-file`` (first) or :data:`PASSWORD_ENV`; None: neither."""
    if password_file is not None:
        return read_db_password(password_file)
    value = (os.environ if environ is None else environ).get(PASSWORD_ENV)
    return value or None


def warn_password_in_url(url: str) -> None:
    """One line when the URL itself holds a password: it works, but ``ps`` shows it."""
    with contextlib.suppress(ArgumentError):
        if make_url(url).password is not None:
            log.warning(
                "the --db URL holds a password, which ps and shell history show: put it in "
                "--db-password-file or %s instead",
                PASSWORD_ENV,
            )


def is_disk_full(err: BaseException) -> bool:
    """Whether a database error says there is no space left: SQLite's ``SQLITE_FULL`` ("database
    or disk is full"), PostgreSQL's ``disk_full`` (SQLSTATE 53100)."""
    cause = getattr(err, "orig", None) or err
    return getattr(cause, "sqlite_errorcode", None) == 13 or getattr(cause, "sqlstate", None) == "53100"
