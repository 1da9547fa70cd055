"""The one error hierarchy of the shared core (artifact format, signing, schemas, preprocessing).

Every expected failure is an :class:`EdgepackError` subclass with structured fields, so that
callers can branch on the type and the CLIs can print ``str(error)`` as one clear line.
The host (``sdk.errors``) and the device (``device_agent.errors``) extend this tree; neither
side raises bare ``ValueError`` for a condition a user can cause.
"""

from __future__ import annotations


class EdgepackError(Exception):
    """Base of every expected Edgepack failure. ``str()`` is one line meant for a human."""

    exit_code = 1

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


def cause_chain(err: BaseException) -> list[str]:
    """``caused by Type: message`` for each cause behind ``err``, nearest first: what the CLIs
    print under ``-v`` (the explicit ``__cause__`` of ``raise ... from``, else the implicit
    context unless suppressed; a cycle ends the chain)."""
    lines, seen = [], {id(err)}
    cause = err.__cause__ or (None if err.__suppress_context__ else err.__context__)
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        lines.append(f"caused by {type(cause).__name__}: {cause}")
        cause = cause.__cause__ or (None if cause.__suppress_context__ else cause.__context__)
    return lines


class UsageError(EdgepackError):
    """Bad input from the user: a config or recipe that does not validate, a wrong flag value."""

    exit_code = 2


class SchemaError(UsageError):
    """A document (recipe, agent.yaml, command payload) does not match its schema.

    ``path`` is the dotted location of the offending key, e.g. ``quantize.calibration.npz``.
    """

    def __init__(self, path: str, problem: str, *, document: str = "") -> None:
        where = f"{document}: " if document else ""
        super().__init__(f"{where}{path or '<root>'}: {problem}")
        self.path = path
        self.problem = problem
        self.document = document


class DocumentRuleError(SchemaError):
    """A document its schema accepts breaks a rule between its parts that no schema can say (two
    pipelines of one name, a rule naming a zone no pipeline draws): a server answers it 422."""


# --------------------------------------------------------------------------- artifacts


class ArtifactError(EdgepackError):
    """An artifact was refused. ``artifact`` names the file when known."""

    def __init__(self, message: str, *, artifact: str = "") -> None:
        super().__init__(message)
        self.artifact = artifact


class SignatureError(ArtifactError):
    """The manifest signature is missing, malformed, by an untrusted key, or does not verify."""


class MissingSignatureError(SignatureError):
    """The archive has no manifest.sig."""


class UntrustedKeyError(SignatureError):
    """Signed by a key whose id is not in the trust store."""

    def __init__(self, key_ids: list[str], *, artifact: str = "") -> None:
        ids = ", ".join(key_ids) or "none"
        super().__init__(f"signed by untrusted key id(s) {ids}", artifact=artifact)
        self.key_ids = key_ids


class BadSignatureError(SignatureError):
    """A trusted key's signature does not match the manifest bytes (manifest changed)."""


class SignatureLayoutError(SignatureError):
    """manifest.sig verifies but is not laid out byte for byte as Edgepack writes it (extra keys,
    other whitespace, padding): its bytes are not signed, so only the one layout is accepted."""


class ManifestError(ArtifactError):
    """manifest.json is missing, not JSON, or does not match the manifest schema."""


class IntegrityError(ArtifactError):
    """A member's bytes do not match the size or sha256 the signed manifest declares."""

    def __init__(self, member: str, problem: str, *, artifact: str = "") -> None:
        super().__init__(f"{member}: {problem}", artifact=artifact)
        self.member = member
        self.problem = problem


class UnsafeMemberError(ArtifactError):
    """A tar member that could escape or confuse extraction: traversal, link, device, duplicate,
    or a name the manifest does not list."""

    def __init__(self, member: str, problem: str, *, artifact: str = "") -> None:
        super().__init__(f"unsafe member {member!r}: {problem}", artifact=artifact)
        self.member = member
        self.problem = problem


class UnsignedBytesError(UnsafeMemberError):
    """Bytes the signature does not cover (a tar header field, block padding, an extended header)
    that are not exactly what Edgepack's writer puts there. Refused, so that no unsigned byte
    rides along in a verified artifact. ``field`` names the header field or ``padding``."""

    def __init__(self, member: str, field: str, problem: str, *, artifact: str = "") -> None:
        super().__init__(member, problem, artifact=artifact)
        self.field = field


class LimitExceededError(ArtifactError):
    """The archive, a member or the member count is over a configured limit."""

    def __init__(self, what: str, size: int, limit: int, *, artifact: str = "") -> None:
        super().__init__(f"{what} is {size} bytes or more, over the limit of {limit}", artifact=artifact)
        self.what = what
        self.size = size
        self.limit = limit


class TruncatedArchiveError(ArtifactError):
    """The archive ends early or is not a readable tar stream."""


class DowngradeError(ArtifactError):
    """The artifact's version is not newer than the installed one, and the install was not forced."""

    def __init__(self, candidate: str, installed: str, *, artifact: str = "") -> None:
        super().__init__(
            f"version {candidate} is not newer than installed version {installed} (force to override)",
            artifact=artifact,
        )
        self.candidate = candidate
        self.installed = installed


class KeyFileError(EdgepackError):
    """A key file is missing, unreadable, not Ed25519, or would be overwritten."""

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = path
        self.problem = problem


class Ed25519KeyError(EdgepackError, ValueError):
    """Bytes that are no Ed25519 public key a verifier may hold: not 32 bytes, or not a point of
    the prime-order subgroup (a small-order key would let anyone forge). A ``ValueError`` too, as
    ``cryptography``'s ``from_public_bytes`` raises for a wrong length."""


class CommandSignatureError(EdgepackError):
    """A remote command that must be signed is unsigned, mis-signed, by a key that is not an
    operator key, expired, or addressed to another device or group."""


class PostprocessError(EdgepackError):
    """Model outputs that the postprocessing spec cannot interpret (missing output, no classes)."""


class PreprocessError(EdgepackError):
    """Input that the preprocessing spec cannot turn into a tensor (corrupt image, wrong shape)."""


class WireEncodingError(EdgepackError):
    """A value has no JSON encoding under the wire convention (e.g. a complex tensor)."""


# --------------------------------------------------------------------------- onnxruntime


class RuntimeTooOld(EdgepackError):
    """No onnxruntime Edgepack knows runs what a graph holds (e.g. an opset newer than every
    release): the build cannot name a minimum onnxruntime for it."""


class RuntimeTooOldError(ArtifactError):
    """The device's onnxruntime is older than the artifact's ``min_onnxruntime``."""


# --------------------------------------------------------------------------- state machines


class InvalidTransition(EdgepackError):
    """A state machine (an update job on the device, a rollout on the host) was asked for a move
    its table does not allow. The pure machines raise it; the fleet server's HTTP layer answers
    it with 409 ``conflict``. ``state`` is the state it was in, ``move`` the refused event or
    target state."""

    def __init__(self, message: str, *, state: str, move: str) -> None:
        super().__init__(message)
        self.state = state
        self.move = move


# --------------------------------------------------------------------------- protocol and MQTT


class InvalidNameError(SchemaError):
    """An id or name that fails ``edgepack_core.protocol.ids.ID_PATTERN``. ``path`` names the
    field (``device_id``, ``group``, ``id``, ...) so it reads like any other schema error;
    ``value`` is a printable, shortened form of the rejected value (for messages only, never
    for paths)."""

    def __init__(self, field: str, value: str, problem: str) -> None:
        shown = value if len(value) <= 80 else value[:77] + "..."
        super().__init__(field, f"{shown!r} {problem}")
        self.value = shown


class CommandBuildError(SchemaError):
    """The host tried to build a command that the protocol does not allow (a bug or bad input,
    caught before it reaches a device)."""


class MqttSettingsError(SchemaError):
    """An MQTT setting out of range; ``path`` is ``mqtt.<field>`` as in agent.yaml."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"mqtt.{field}", problem)


class InvalidPublishError(UsageError):
    """A message that cannot be published: wildcard or empty topic, unencodable or oversized payload."""

    def __init__(self, topic: str, problem: str) -> None:
        super().__init__(f"cannot publish to {topic!r}: {problem}")
        self.topic = topic
        self.problem = problem


class BrokerConnectError(EdgepackError):
    """A client that must connect now (a host command) could not."""


class BrokerLoginRefused(BrokerConnectError):
    """The broker answered the CONNECT with "bad user name or password" or "not authorised"."""

    def __init__(self, address: str, reason: str) -> None:
        super().__init__(f"broker refused the login at {address} ({reason})")
        self.reason = reason


class BrokerUnreachable(BrokerConnectError):
    """No CONNACK within the time allowed: nothing listens, TLS failed, or the network is down."""


class BrokerTlsError(BrokerConnectError):
    """TLS stands between the client and the broker: a certificate the client cannot verify, or
    TLS on one side only (a plain client on a TLS port, or the reverse). Retrying cannot help."""
