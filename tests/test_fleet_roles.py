"""Users and roles on the fleet server (issue 25 item 2): the pure permission table and its
boundaries, the token file's roles, tokens held in the database (SQLite and PostgreSQL), and a
real `edgepack fleet serve` with a real mosquitto driven by the real CLI: a viewer cannot start a
rollout, a revoked token is refused at its next request, the audit names users on every write
route, the audit exports as JSON lines, and old audit entries age out at the configured limit."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest
from sqlalchemy import func, select
from starlette.routing import Route

from sdk.errors import ApiError, ServerConfigError
from sdk.fleet_server import db as tables
from sdk.fleet_server import roles, users
from sdk.fleet_server.auth import TokenCheck, client_token, parse_tokens
from sdk.fleet_server.db import Database, open_database
from sdk.fleet_server.retention import Pruner, RetentionPolicy
from tests.broker import start_mosquitto
from tests.fleet_server_process import FleetServerProcess, edgepack, make_keys
from tests.postgres import postgres_server, postgres_url  # noqa: F401  (fixtures)

OPEN_ROUTES = {"/", "/healthz", "/openapi.json", "/artifacts/{file_name}"}
ALSO_OPEN = {"/api/enroll"}  # a device redeems its one-time enrollment token there: that token is its credential


def _app(tmp_path: Path, keypair):
    from edgepack_core.signing import TrustStore
    from sdk.fleet_server.api import ApiContext, build_app
    from sdk.fleet_server.artifacts import ArtifactStore

    database = open_database(f"sqlite:///{tmp_path / 'fleet.db'}")
    try:
        context = ApiContext(database=database, tokens=TokenCheck(parse_tokens("a:0123456789abcdef")),
                             store=ArtifactStore(tmp_path / "store", TrustStore.from_paths([keypair[1]])),
                             retention=RetentionPolicy(), artifact_url=lambda sha: sha)
        return build_app(context)
    finally:
        database.dispose()


def _guarded(app) -> list[tuple[str, str, str]]:
    """(method, path, action) of every guarded route."""
    return [(method, route.path, route.endpoint.action) for route in app.routes
            if isinstance(route, Route) and hasattr(route.endpoint, "action")
            for method in sorted(route.methods or ()) if method != "HEAD"]


# ------------------------------------------------------------------ the pure table


def test_every_registered_route_action_is_in_the_permission_table(tmp_path: Path, keypair):
    app = _app(tmp_path, keypair)
    guarded = _guarded(app)
    unguarded = {route.path for route in app.routes if isinstance(route, Route) and not hasattr(route.endpoint,
                                                                                               "action")}
    assert OPEN_ROUTES <= unguarded <= OPEN_ROUTES | ALSO_OPEN
    missing = sorted({action for _, _, action in guarded if not roles.known(action)})
    assert missing == [], f"add these actions to sdk/fleet_server/roles.py PERMISSIONS: {missing}"
    assert all(action == roles.READ for method, _, action in guarded if method == "GET"
               and action not in ("token.list",))


def test_each_action_is_allowed_its_role_and_refused_the_role_below():
    for action, needed in roles.PERMISSIONS.items():
        level = roles.ROLES.index(needed)
        assert roles.allows(needed, action) and roles.allows("admin", action)
        if level:
            assert not roles.allows(roles.ROLES[level - 1], action), action
        assert not roles.allows("root", action)  # not a role: nothing


def test_the_table_gives_each_role_its_job():
    assert roles.needed_role(roles.READ) == "viewer"
    assert {roles.needed_role(a) for a in ("rollout.create", "rollout.abort", "target.set", "device.action",
                                           "device.groups")} == {"operator"}
    assert {roles.needed_role(a) for a in ("artifact.upload", "artifact.bad", "artifact.good")} == {"release"}
    assert {roles.needed_role(a) for a in ("token.create", "token.revoke", "device.enroll", "keys.add")} == {"admin"}


def test_unknown_actions_need_admin():
    for action in ("brand.new", "alerts.webhook.create", "nothing"):
        assert roles.needed_role(action) == "admin"
        assert not roles.allows("release", action) and roles.allows("admin", action)
    assert roles.known("alerts.create") and not roles.known("brand.new")


def test_the_refusal_names_the_role_needed_and_the_token():
    message = roles.refusal("rollout.create", roles.Identity("ann", "viewer", "database"))
    assert message == "rollout.create needs the operator role; token 'ann' is a viewer"
    assert roles.refusal("token.create", roles.Identity("ops", "operator", "file")).endswith("is an operator")


# ------------------------------------------------------------------ the token file


def test_token_file_lines_take_an_optional_role_and_default_to_admin():
    tokens = parse_tokens("a:0123456789abcdef\nb:0123456789abcdeg:viewer\n0123456789abcdeh\n")
    assert [(t.name, t.role) for t in tokens] == [("a", "admin"), ("b", "viewer"),
                                                   (tokens[2].name, "admin")]
    check = TokenCheck(tokens)
    assert check.who("Bearer 0123456789abcdeg") == roles.Identity("b", "viewer", "file")
    assert check.admins() == 2 and check.names() == {"a", "b", tokens[2].name}


@pytest.mark.parametrize("line", ["b:0123456789abcdef:root", "b:0123456789abcdef:", "b:0123456789abcdef:admin:x"])
def test_a_token_file_role_that_is_not_a_role_is_refused_naming_the_line(line):
    with pytest.raises(ServerConfigError, match="line 1: the role"):
        parse_tokens(line)


def test_a_client_sends_only_the_token_of_a_line_with_a_role(tmp_path: Path):
    path = tmp_path / "tokens"
    path.write_text("# me\nann:0123456789abcdef:viewer\n")
    assert client_token(path) == "0123456789abcdef"


# ------------------------------------------------------------------ tokens in the database


@pytest.fixture(params=["sqlite", "postgresql"])
def database(request, tmp_path: Path):
    url = f"sqlite:///{tmp_path / 'fleet.db'}" if request.param == "sqlite" else request.getfixturevalue(
        "postgres_url")
    opened = open_database(url)
    yield opened
    opened.dispose()


def _caller(file_admins: int = 0) -> users.Caller:
    return users.Caller("boot", "", frozenset({"boot"}), file_admins)


def test_a_token_is_stored_as_its_digest_and_identified_until_revoked(database: Database):
    doc, secret = users.create(database, "ann", "viewer", _caller(1), now=1000.0)
    assert doc["source"] == "database" and "token" not in doc and "digest" not in doc
    with database.read() as connection:
        stored = connection.execute(select(users.api_tokens)).mappings().one()
    assert secret.encode() not in bytes(stored["digest"]) and len(stored["digest"]) == 32
    assert users.identify(database, secret, now=1001.0) == roles.Identity("ann", "viewer", "database")
    assert users.identify(database, secret[:-1] + ("0" if secret[-1] != "0" else "1")) is None
    users.revoke(database, "ann", _caller(1), now=1002.0)
    assert users.identify(database, secret) is None
    again, second = users.create(database, "ann", "operator", _caller(1))  # a revoked name may be given again
    assert users.identify(database, second).role == "operator" and again["role"] == "operator"


def test_last_used_is_written_at_most_once_a_minute(database: Database):
    _doc, secret = users.create(database, "ann", "viewer", _caller(1), now=1000.0)

    def last_used() -> float:
        return next(t for t in users.listing(database) if t["name"] == "ann")["last_used_at"]

    users.identify(database, secret, now=2000.0)
    users.identify(database, secret, now=2000.0 + users.TOUCH_S - 0.5)
    assert last_used() == 2000.0
    users.identify(database, secret, now=2000.0 + users.TOUCH_S)
    assert last_used() == 2000.0 + users.TOUCH_S


def test_the_last_admin_cannot_be_revoked(database: Database):
    users.create(database, "root", "admin", _caller(0))
    users.create(database, "root2", "admin", _caller(0))
    users.revoke(database, "root2", _caller(0))
    with pytest.raises(ApiError, match="last admin") as refused:
        users.revoke(database, "root", _caller(0))
    assert refused.value.status == 409
    users.revoke(database, "root", _caller(1))  # the token file still holds an admin


def test_names_are_validated_and_unique_among_tokens_in_force(database: Database):
    users.create(database, "ann", "viewer", _caller(1))
    for name, role, status in (("ann", "viewer", 409), ("boot", "viewer", 409), ("mqtt", "admin", 409),
                               ("a b", "viewer", 400), ("x" * 65, "viewer", 400), ("bob", "root", 400)):
        with pytest.raises(ApiError) as refused:
            users.create(database, name, role, _caller(1))
        assert refused.value.status == status, (name, role)
    users.create(database, "x" * 64, "viewer", _caller(1))  # the longest name passes
    with pytest.raises(ApiError, match="token file"):
        users.revoke(database, "boot", _caller(1))
    with pytest.raises(ApiError) as missing:
        users.revoke(database, "nobody", _caller(1))
    assert missing.value.status == 404


def test_two_servers_making_one_name_at_once_get_one_token_and_a_409(database: Database, monkeypatch):
    """The race: the other server's insert lands between this one's check and insert (the check
    is skipped here to put this insert second); the index on names in force refuses it."""
    users.create(database, "ann", "viewer", _caller(1))
    monkeypatch.setattr(users, "_in_force", lambda _connection, _name: None)
    with pytest.raises(ApiError, match="exists") as refused:
        users.create(database, "ann", "admin", _caller(1))
    assert refused.value.status == 409
    assert [t["role"] for t in users.listing(database) if t["name"] == "ann"] == ["viewer"]


# ------------------------------------------------------------------ audit retention


def test_retention_drops_audit_rows_older_than_the_limit_and_keeps_the_boundary(tmp_path: Path):
    database = open_database(f"sqlite:///{tmp_path / 'fleet.db'}")
    policy = RetentionPolicy(audit_s=10 * 86400.0)
    now = 1_800_000_000.0
    boundary = now - policy.audit_s
    with database.write() as connection:
        for ts, target in ((boundary - 0.001, "old"), (boundary, "edge"), (now, "new")):
            connection.execute(tables.audit_log.insert().values(ts=ts, actor="ann", action="x.y", target=target,
                                                                outcome="ok", detail="{}", remote=""))
    pruner = Pruner(database, policy)
    pruner.run_once(now)
    with database.read() as connection:
        kept = connection.execute(select(tables.audit_log.c.target).order_by(tables.audit_log.c.id)).scalars().all()
        count = connection.execute(select(func.count()).select_from(tables.audit_log)).scalar()
    database.dispose()
    assert kept == ["edge", "new"] and count == 2 and pruner.deleted_audit == 1
    assert RetentionPolicy().audit_s == 365 * 86400.0
    with pytest.raises(ServerConfigError):
        RetentionPolicy(audit_s=0)


# ------------------------------------------------------------------ a real server, the real CLI


@pytest.fixture(scope="module")
def server(tmp_path_factory, keypair):
    broker = start_mosquitto(workdir=tmp_path_factory.mktemp("mosquitto"))
    keys = make_keys(tmp_path_factory.mktemp("keys"), release=keypair)
    process = FleetServerProcess(tmp_path_factory.mktemp("server"), broker=broker.address, keys=keys,
                                 extra=("--audit-keep-days", "30"))
    process.start()
    yield process
    process.stop()
    broker.kill()


def _cli(server: FleetServerProcess, *args: str, token_file: Path | None = None):
    return edgepack("fleet", *args, "--server", server.url, "--token-file",
                    str(token_file or server.keys.token_file))


def _token(server: FleetServerProcess, name: str, role: str) -> str:
    made = _cli(server, "token", "create", name, "--role", role)
    assert made.returncode == 0, made.stderr
    assert made.stdout.count("\n") == 1 and made.stderr == ""  # the token, alone
    return made.stdout.strip()


def _file(tmp_path: Path, token: str) -> Path:
    path = tmp_path / "token"
    path.write_text(token + "\n")
    path.chmod(0o600)
    return path


def test_a_viewer_token_cannot_start_a_rollout(server):
    viewer = _token(server, "ann", "viewer")
    status, doc = server.call("POST", "/api/rollouts", {"artifact": "0" * 64, "group": "g", "waves": [100]},
                              token=viewer)
    assert status == 403, doc
    assert doc["error"]["code"] == "forbidden" and doc["error"]["needs"] == "operator"
    assert doc["error"]["message"] == "rollout.create needs the operator role; token 'ann' is a viewer"
    refused = [e for e in server.get("/api/audit?action=rollout.create")["entries"] if e["actor"] == "ann"]
    assert refused and refused[0]["outcome"] == "refused" and "operator" in refused[0]["detail"]["reason"]
    assert server.call("GET", "/api/devices", token=viewer)[0] == 200  # a viewer reads
    who = server.call("GET", "/api/whoami", token=viewer)[1]
    assert (who["name"], who["role"], who["source"]) == ("ann", "viewer", "database")
    assert who["actions"] == ["read"]


# (role, method, path, body, action): each route lets its role through (an answer other than 403: the
# request reached the handler, which refuses the missing rollout/artifact) and refuses the role below
BOUNDARIES = [
    ("operator", "POST", "/api/rollouts/ro-missing/pause", {}),
    ("operator", "PUT", "/api/devices/nobody/groups", {"groups": ["g"]}),
    ("release", "POST", f"/api/artifacts/{'0' * 64}/bad", {"reason": "broken"}),
    ("admin", "GET", "/api/tokens", None),
    ("admin", "POST", "/api/devices/nobody/enroll", {}),
]


def test_each_role_passes_its_routes_and_the_role_below_is_refused(server):
    tokens = {role: _token(server, f"b-{role}", role) for role in roles.ROLES}
    for role, method, path, body in BOUNDARIES:
        below = roles.ROLES[roles.ROLES.index(role) - 1]
        status, doc = server.call(method, path, body, token=tokens[below])
        assert status == 403 and doc["error"]["needs"] == role, (below, path, doc)
        assert server.call(method, path, body, token=tokens[role])[0] != 403, (role, path)


def test_an_operator_cannot_make_itself_an_admin_token_or_revoke_one(server):
    operator = _token(server, "climber", "operator")
    status, doc = server.call("POST", "/api/tokens", {"name": "climber-admin", "role": "admin"}, token=operator)
    assert status == 403 and doc["error"]["needs"] == "admin"
    assert server.call("DELETE", "/api/tokens/admin", token=operator)[0] == 403
    names = {t["name"] for t in server.get("/api/tokens")["tokens"]}
    assert "climber-admin" not in names and "admin" in names
    refused = server.get("/api/audit?action=token.create")["entries"][0]
    assert (refused["actor"], refused["outcome"], refused["target"]) == ("climber", "refused", "")


def test_a_revoked_token_is_refused_at_once(server, tmp_path: Path):
    token = _token(server, "short-lived", "operator")
    assert server.call("GET", "/api/status", token=token)[0] == 200
    revoked = _cli(server, "token", "revoke", "short-lived")
    assert revoked.returncode == 0 and "short-lived (operator) revoked" in revoked.stdout, revoked.stderr
    status, doc = server.call("GET", "/api/status", token=token)
    assert status == 401 and doc["error"]["code"] == "unauthorized"
    listed = _cli(server, "token", "list", "--json")
    entry = next(t for t in json.loads(listed.stdout)["tokens"] if t["name"] == "short-lived")
    assert entry["revoked_by"] == "admin" and entry["revoked_at"] is not None and entry["last_used_at"] is not None
    again = _cli(server, "token", "revoke", "short-lived")
    assert again.returncode == 1 and again.stderr.count("\n") == 1 and "no token 'short-lived'" in again.stderr


def test_the_token_file_admin_is_not_revoked_over_the_api_and_bad_names_are_usage_errors(server):
    refused = _cli(server, "token", "revoke", "admin")
    assert refused.returncode == 1 and "token file" in refused.stderr and "Traceback" not in refused.stderr
    bad = _cli(server, "token", "create", "a/b", "--role", "viewer")
    assert bad.returncode == 2 and "NAME" in bad.stderr and "Traceback" not in bad.stderr
    no_role = _cli(server, "token", "create", "c", "--role", "root")
    assert no_role.returncode == 2


def test_an_operator_token_made_by_the_cli_works_from_its_file_and_cannot_make_tokens(server, tmp_path: Path):
    path = _file(tmp_path, _token(server, "ops", "operator"))
    listed = _cli(server, "token", "list", token_file=path)
    assert listed.returncode == 1 and "token.list needs the admin role; token 'ops' is an operator" in listed.stderr
    status = edgepack("fleet", "status", "--server", server.url, "--token-file", str(path))
    assert status.returncode == 0, status.stderr


def _fill(path: str) -> str:
    values = {"device_id": "nobody", "rollout_id": "ro-missing", "sha256": "0" * 64, "group": "g",
              "name": "nobody-here", "action": "ping"}
    for key, value in values.items():
        path = path.replace(f"{{{key}}}", value)
    return path


def test_the_audit_names_the_user_on_every_write_route(server, tmp_path: Path, keypair):
    """Every write route, called by a named admin token from the database, leaves an audit row
    naming that token (the call may be refused: a refusal is a row too)."""
    writes = [(m, p, a) for m, p, a in _guarded(_app(tmp_path, keypair)) if a != roles.READ and m != "GET"]
    assert len(writes) >= 12
    token = _token(server, "auditor", "admin")
    for method, path, _action in writes:
        server.call(method, _fill(path), {} if method != "POST" or "artifacts" not in path else None,
                    token=token, data=b"" if path == "/api/artifacts" else None)
    entries = server.get("/api/audit?limit=1000")["entries"]
    for method, path, action in writes:
        rows = [e for e in entries if e["action"] == action and e["actor"] == "auditor"]
        assert rows, f"{method} {path}: no audit row for {action} naming the user"


def test_the_audit_exports_as_json_lines_that_round_trip(server, tmp_path: Path):
    secret = _token(server, "exported", "viewer")
    page = server.get("/api/audit?limit=1000")["entries"]
    exported = _cli(server, "audit", "export")
    assert exported.returncode == 0 and exported.stderr == ""
    assert secret not in exported.stdout and secret not in server.log_text()  # the token is shown once, only
    stored = [path.read_bytes() for path in server.folder.glob("fleet.db*")]  # the database and its WAL
    assert stored and not any(secret.encode() in data for data in stored)
    lines = [json.loads(line) for line in exported.stdout.splitlines()]
    assert lines[: len(page)] == list(reversed(page))  # oldest first, the same documents
    middle = lines[len(lines) // 2]
    since = _cli(server, "audit", "export", "--since", repr(middle["ts"]))
    later = [json.loads(line) for line in since.stdout.splitlines()]
    assert later and all(e["ts"] >= middle["ts"] for e in later) and middle in later
    assert len(later) == sum(1 for e in lines if e["ts"] >= middle["ts"])
    request = urllib.request.Request(f"{server.url}/api/audit?format=jsonl&limit=5",
                                     headers={"Authorization": f"Bearer {server.keys.token}"})
    with urllib.request.urlopen(request, timeout=30) as answer:
        assert answer.headers["Content-Type"] == "application/x-ndjson"
        assert [json.loads(line) for line in answer.read().decode().splitlines()] == lines[:5]
    paged = server.get(f"/api/audit?limit=1000&since={middle['ts']!r}")["entries"]
    assert list(reversed(paged)) == later[: len(paged)]
    assert server.call("GET", "/api/audit?format=csv")[0] == 400
    bad = _cli(server, "audit", "export", "--since", "yesterday")
    assert bad.returncode == 2 and "ISO 8601" in bad.stderr


def test_the_server_reports_the_audit_retention_it_was_given(server):
    assert server.get("/api/status")["retention"]["audit_s"] == 30 * 86400.0
