"""Bearer tokens of the fleet server: read from a file, compared in constant time.

The token file holds one token per line, ``NAME:TOKEN`` (NAME is what the audit table records
as the actor, so the token itself is never stored or logged), ``NAME:TOKEN:ROLE`` (ROLE one of
:data:`~.roles.ROLES`; without it a file token is ``admin``, as every token was before roles)
or a bare ``TOKEN`` (named ``token-<first 8 hex of its sha256>``, admin). Blank lines and ``#``
comments are skipped. Tokens made with ``edgepack fleet token create`` live in the database
(:mod:`.users`), not here. Like an
ssh key, the file must not be readable by other users, and a token must be at least
:data:`MIN_TOKEN_CHARS` characters of ``[A-Za-z0-9._~+/=-]`` (``openssl rand -hex 32``).

Why compare digests with :func:`hmac.compare_digest`: comparing the token strings with ``==``
stops at the first differing byte, so response times would leak how much of a guess was
right. Both sides are hashed first (equal lengths whatever was sent) and every configured
token is compared, so the time does not depend on which token matched either.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from dataclasses import dataclass
from pathlib import Path

from edgepack_core.protocol.ids import is_valid_id
from sdk.errors import ServerConfigError
from sdk.fleet_server.roles import DEFAULT_ROLE, ROLES, Identity

MIN_TOKEN_CHARS = 16
MAX_TOKEN_CHARS = 512
MAX_TOKEN_FILE_BYTES = 64 * 1024
_TOKEN = re.compile(r"[A-Za-z0-9._~+/=-]+")


@dataclass(frozen=True)
class Token:
    name: str
    digest: bytes  # sha256 of the token
    role: str = DEFAULT_ROLE


def digest_of(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()


def is_token_text(token: str) -> bool:
    """Whether ``token`` has a token's length and characters (checked before any lookup)."""
    return MIN_TOKEN_CHARS <= len(token) <= MAX_TOKEN_CHARS and _TOKEN.fullmatch(token) is not None


def _split_line(line: str) -> tuple[str, str, str | None, bool]:
    """``(name, token, role, named)`` of one line: ``NAME:TOKEN[:ROLE]`` or ``TOKEN`` (the token
    characters hold no ``:``, so the parts cannot be confused)."""
    name, sep, rest = line.partition(":")
    if not sep:
        return "", line, None, False
    token, sep, role = rest.partition(":")
    return name, token, role if sep else None, True


def parse_tokens(text: str, source: str = "the token file") -> list[Token]:
    """Tokens from the file's text; :class:`ServerConfigError` naming the line otherwise. Pure."""
    tokens: list[Token] = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        name, token, role, named = _split_line(line)
        if not is_token_text(token):
            raise ServerConfigError(f"{source} line {number}: a token is {MIN_TOKEN_CHARS} to {MAX_TOKEN_CHARS} "
                                    "characters of letters, digits and ._~+/=- (e.g. openssl rand -hex 32)")
        if named and not is_valid_id(name):
            raise ServerConfigError(f"{source} line {number}: the name before ':' must be 1 to 64 letters, digits, "
                                    "'.', '_' or '-'")
        if role is not None and role not in ROLES:
            raise ServerConfigError(f"{source} line {number}: the role after the token must be one of "
                                    f"{', '.join(ROLES)}")
        digest = digest_of(token)
        tokens.append(Token(name or f"token-{digest.hex()[:8]}", digest, role or DEFAULT_ROLE))
    if not tokens:
        raise ServerConfigError(f"{source} holds no token")
    names = [t.name for t in tokens]
    if len(set(names)) != len(names):
        raise ServerConfigError(f"{source}: two tokens have the same name")
    return tokens


def read_token_file(path: Path, *, check_mode: bool = True) -> list[Token]:
    """The tokens of ``path``, refusing a file that others can read (mode & 077)."""
    try:
        mode = path.stat().st_mode
        with open(path, "rb") as handle:
            data = handle.read(MAX_TOKEN_FILE_BYTES + 1)
    except OSError as err:
        raise ServerConfigError(f"cannot read the token file {path}: {err.strerror or err}") from err
    if check_mode and mode & 0o077:
        raise ServerConfigError(f"the token file {path} is readable by others (mode {mode & 0o777:o}); chmod 600 it")
    if len(data) > MAX_TOKEN_FILE_BYTES:
        raise ServerConfigError(f"the token file {path} is over {MAX_TOKEN_FILE_BYTES} bytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as cause:
        raise ServerConfigError(f"the token file {path} is not UTF-8 text") from cause
    return parse_tokens(text, str(path))


def client_token(path: Path) -> str:
    """The token a client sends: the first token of the file (its ``NAME:`` and ``:ROLE`` parts dropped)."""
    try:
        with open(path, "rb") as handle:
            data = handle.read(MAX_TOKEN_FILE_BYTES + 1)
        text = data.decode("utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ServerConfigError(f"cannot read the token file {path}: {getattr(err, 'strerror', None) or err}") \
            from err
    for raw in text.splitlines():
        line = raw.strip()
        if line and not line.startswith("#"):
            name, token, _role, named = _split_line(line)
            return token if named and is_valid_id(name) else line
    raise ServerConfigError(f"the token file {path} holds no token")


def presented(header: str | None) -> str | None:
    """The token of ``Authorization: Bearer <token>``, if it looks like one; None otherwise."""
    if not header or len(header) > MAX_TOKEN_CHARS + 16:
        return None
    scheme, _, token = header.partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and is_token_text(token) else None


class TokenCheck:
    """Who a request's ``Authorization`` header belongs to among the token file's tokens, or None."""

    def __init__(self, tokens: list[Token]) -> None:
        self.tokens = list(tokens)

    def who(self, header: str | None) -> Identity | None:
        """The file token sent as ``Bearer <token>``; None for anything else. Every configured
        token is compared (constant time, no early exit)."""
        token = presented(header)
        if token is None:
            return None
        digest = digest_of(token)
        found = None
        for known in self.tokens:
            if hmac.compare_digest(digest, known.digest):
                found = Identity(known.name, known.role, "file")
        return found

    def identify(self, header: str | None) -> str | None:
        """The name of :meth:`who`."""
        identity = self.who(header)
        return None if identity is None else identity.name

    def names(self) -> set[str]:
        return {token.name for token in self.tokens}

    def admins(self) -> int:
        return sum(1 for token in self.tokens if token.role == "admin")
