"""Pure parts of remote updates: command parsing, the job state machine, restart decisions,
the chunk codec, the journal and the replay ledger (health verdicts: tests/test_health.py)."""

from __future__ import annotations

import json

import pytest

from device_agent.updates import jobs as J
from device_agent.updates.jobs import InvalidTransition, Job, advance, on_restart
from edgepack_core.protocol.codec import chunk_count, decode_chunk, encode_chunk, parse_request, request_payload
from edgepack_core.protocol.commands import Command, Rejection, parse_command

NOW = 1_000_000.0


def _cmd(**fields) -> bytes:
    base = {"schema": "edgepack.cmd/1", "id": "c-1", "type": "ping", "expires_at": NOW + 60}
    return json.dumps({**base, **fields}).encode()


def _deploy(**fields) -> bytes:
    body = {"type": "deploy", "artifact": {"url": "http://h/a.edgepkg"}, "version": "1.2.0", "size": 10,
            "sha256": "a" * 64}
    return _cmd(**{**body, **fields})


def test_valid_commands_parse():
    assert isinstance(parse_command(_cmd(), NOW), Command)
    parsed = parse_command(_deploy(), NOW)
    assert isinstance(parsed, Command) and parsed.body["version"] == "1.2.0"
    assert isinstance(parse_command(_cmd(type="set-telemetry-interval", seconds=5), NOW), Command)


@pytest.mark.parametrize(
    ("payload", "needle"),
    [
        (b"\xff", "not JSON"),
        (b"[]", "not a JSON object"),
        (_cmd(type="reboot"), "unknown command type"),
        (_cmd(expires_at=NOW - 1), "expired"),
        (_deploy(version="latest"), "version"),
        (_deploy(sha256="xyz"), "sha256"),
        (_cmd(type="deploy", artifact={"url": "http://h/a", "xfer": {"id": "t", "chunk_size": 4096, "chunks": 1}},
              version="1.0.0", size=1, sha256="a" * 64), "exactly one of url or xfer"),
        (_deploy(artifact={"url": "file:///etc/passwd"}), "artifact"),
        (_cmd(extra_key=1), "unknown key"),
        (_cmd(id="../../etc"), "id"),
        (b"{" + b" " * 70_000 + b"}", "over the limit"),
    ],
)
def test_bad_commands_are_rejected_with_a_reason(payload, needle):
    parsed = parse_command(payload, NOW)
    assert isinstance(parsed, Rejection) and needle in parsed.reason


def test_job_follows_the_pipeline_and_refuses_skips():
    job = Job("j", "deploy")
    for state in (J.DOWNLOADING, J.VERIFYING, J.STAGING, J.TESTING):
        job = advance(job, state, state, NOW)
        assert not job.final
    job = advance(job, J.ACTIVE, "swapped", NOW, final=False)
    assert not job.final
    done = advance(job, J.ACTIVE, "healthy", NOW, final=True)
    assert done.final and [s for s, _ in done.history] == [J.DOWNLOADING, J.VERIFYING, J.STAGING, J.TESTING,
                                                           J.ACTIVE, J.ACTIVE]
    with pytest.raises(InvalidTransition):
        advance(Job("k", "deploy"), J.ACTIVE, "skip the tests", NOW)
    with pytest.raises(InvalidTransition):
        advance(advance(Job("k", "deploy"), J.REJECTED, "no", NOW), J.DOWNLOADING, "again", NOW)
    assert Job.from_json(done.to_json()) == done


@pytest.mark.parametrize(
    ("state", "final", "job_type", "committed", "action"),
    [
        (J.QUEUED, False, "deploy", False, J.RESUME),
        (J.DOWNLOADING, False, "deploy", False, J.RESUME),
        (J.STAGING, False, "deploy", False, J.RESUME),
        (J.TESTING, False, "deploy", False, J.RESUME),
        (J.TESTING, False, "deploy", True, J.ROLL_BACK),
        (J.ACTIVE, False, "deploy", True, J.ROLL_BACK),
        (J.ACTIVE, True, "deploy", True, J.NOTHING),
        (J.FAILED, True, "deploy", False, J.NOTHING),
        (J.QUEUED, False, "rollback", False, J.FAIL),
    ],
)
def test_restart_decision_for_each_state(state, final, job_type, committed, action):
    job = Job("j", job_type, state=state, final=final)
    assert on_restart(job, active_is_job_version=committed) == action


def test_restart_does_not_resume_a_job_that_crashed_the_agent_while_verifying():
    job = advance(advance(Job("j", "deploy", history=((J.QUEUED, NOW),)), J.DOWNLOADING, "", NOW),
                  J.VERIFYING, "", NOW)
    assert on_restart(job, active_is_job_version=False, now=NOW) == J.RESUME  # killed before the verifier ran
    started = advance(job, J.VERIFYING, "", NOW, verify_started=True)
    assert on_restart(started, active_is_job_version=False, now=NOW) == J.FAIL
    assert "not verified again" in J.restart_reason(started, NOW)


def test_restart_does_not_resume_an_expired_deploy():
    job = Job("j", "deploy", state=J.DOWNLOADING, command={"expires_at": NOW - 1})
    assert on_restart(job, active_is_job_version=False, now=NOW) == J.FAIL
    assert "expired" in J.restart_reason(job, NOW)
    fresh = Job("j", "deploy", state=J.DOWNLOADING, command={"expires_at": NOW})
    assert on_restart(fresh, active_is_job_version=False, now=NOW) == J.RESUME


def test_restart_resumes_a_deploy_at_most_max_resumes_times():
    job = Job("j", "deploy", history=((J.QUEUED, NOW),))
    for _ in range(J.MAX_RESUMES):
        job = advance(advance(job, J.DOWNLOADING, "", NOW), J.QUEUED, "resumed", NOW)
    assert J.resumes(job) == J.MAX_RESUMES
    assert on_restart(job, active_is_job_version=False, now=NOW) == J.FAIL
    fewer = Job("j", "deploy", history=((J.QUEUED, NOW), (J.DOWNLOADING, NOW), (J.QUEUED, NOW)))
    assert on_restart(fewer, active_is_job_version=False, now=NOW) == J.RESUME


def test_cancel_ends_a_job_only_before_the_switch():
    for state in J.CANCELLABLE:
        job = Job("j", "deploy", state=state)
        assert advance(job, J.CANCELLED, "cancelled", NOW).final
    with pytest.raises(InvalidTransition):
        advance(Job("j", "deploy", state=J.ACTIVE), J.CANCELLED, "too late", NOW)
    # past the switch, a cancel or a failed rollback ends the job rolled back, or failed
    assert advance(Job("j", "deploy", state=J.ACTIVE), J.ROLLED_BACK, "", NOW).final
    assert advance(Job("j", "deploy", state=J.ACTIVE), J.FAILED, "rollback failed", NOW).final


def test_restart_transitions_go_through_advance():
    for state in (J.DOWNLOADING, J.VERIFYING, J.STAGING, J.TESTING):
        assert advance(Job("j", "deploy", state=state), J.QUEUED, "resumed", NOW).state == J.QUEUED
    assert advance(Job("j", "deploy", state=J.TESTING), J.ROLLED_BACK, "restart", NOW).final
    for terminal in J.TERMINAL:
        assert not J.TRANSITIONS[terminal]


KEY = {"sender": "3f2a9c0d11e2b7a4", "kind": "deploy"}  # a signed deploy's bucket


def test_replay_ledger_remembers_signed_ids_until_expiry_across_restarts(tmp_path):
    from device_agent.updates.replay import ReplayError, ReplayGuard

    guard = ReplayGuard(tmp_path / "ids.json", max_per_bucket=2)
    guard.remember("a", NOW + 10, NOW, **KEY)
    with pytest.raises(ReplayError, match="already used"):
        guard.remember("a", NOW + 10, NOW, **KEY)
    reopened = ReplayGuard(tmp_path / "ids.json", max_per_bucket=2)
    assert reopened.seen("a")
    reopened.remember("b", NOW + 5, NOW, **KEY)
    with pytest.raises(ReplayError, match="most allowed"):
        reopened.remember("c", NOW + 5, NOW, **KEY)
    reopened.remember("c", NOW + 20, NOW + 6, **KEY)  # b expired and is forgotten, a is still remembered
    assert reopened.seen("a") and not reopened.seen("b")
    reopened.remember("d", NOW + 20, NOW + 6, sender=KEY["sender"], kind="rollback")  # another bucket
    (tmp_path / "ids.json").write_text("[garbage")
    assert not ReplayGuard(tmp_path / "ids.json").seen("a")


def test_the_ledger_fill_10050_unsigned_commands_do_not_make_later_deploys_or_rollbacks_refused(tmp_path):
    """Without operator keys a stranger on the broker sent 10,050 unsigned state-changing
    commands (issue 21: every deploy and rollback was then refused for up to 7 days, across
    restarts). Unsigned ids live in memory, per type, at most 1000 each, oldest forgotten first."""
    from device_agent.updates.replay import MAX_IDS_PER_BUCKET, ReplayGuard

    path = tmp_path / "command-ids.json"
    guard = ReplayGuard(path)
    kinds = ("cancel", "set-telemetry-interval", "deploy", "rollback")
    for index in range(10_050):
        guard.remember(f"flood-{index}", NOW + 7 * 24 * 3600, NOW + index / 50, kind=kinds[index % 4])
    assert [guard.count("unsigned", kind) for kind in kinds] == [MAX_IDS_PER_BUCKET] * 4
    assert guard.seen("flood-10049") and not guard.seen("flood-0")  # the oldest went first
    later = NOW + 10_050 / 50
    guard.remember("deploy-by-the-operator", later + 600, later, kind="deploy")
    guard.remember("rollback-by-the-operator", later + 600, later, kind="rollback")
    assert not path.exists(), "nothing of the flood was written to disk"
    restarted = ReplayGuard(path)
    assert not restarted.seen("flood-10049")
    restarted.remember("deploy-after-restart", later + 600, later, kind="deploy")


@pytest.mark.parametrize(("held", "limit", "kept"), [(2, 3, ["a", "b"]), (3, 3, ["b", "c"]), (4, 3, ["c", "d"])])
def test_a_full_unsigned_bucket_forgets_its_oldest_ids(held, limit, kept):
    from device_agent.updates.replay import make_room

    ids = {name: NOW + 60 for name in "abcd"[:held]}
    assert list(make_room(ids, NOW, limit, forget_oldest=True)) == kept


def test_a_full_signed_bucket_forgets_only_expired_ids():
    from device_agent.updates.replay import make_room

    assert make_room({"a": NOW + 60, "b": NOW + 60}, NOW, 2, forget_oldest=False) is None
    assert make_room({"a": NOW - 1, "b": NOW + 60}, NOW, 2, forget_oldest=False) == {"b": NOW + 60}


def test_a_ledger_of_an_older_agent_is_still_honoured(tmp_path):
    from device_agent.updates.replay import ReplayError, ReplayGuard

    (tmp_path / "ids.json").write_text(json.dumps({"old-1": NOW + 60, "bad": "x"}))
    guard = ReplayGuard(tmp_path / "ids.json")
    with pytest.raises(ReplayError, match="already used"):
        guard.remember("old-1", NOW + 60, NOW, **KEY)
    assert not guard.seen("bad")


def test_chunk_codec_detects_corruption_and_requests_are_bounded():
    payload = encode_chunk(7, b"hello world")
    assert decode_chunk(payload) == (7, b"hello world")
    corrupt = payload[:-1] + b"X"
    assert decode_chunk(corrupt) is None
    assert decode_chunk(b"short") is None
    assert parse_request(request_payload([0, 5, 99, -1]), total=10) == [0, 5]
    assert parse_request(b"not json", total=10) == []
    assert parse_request(json.dumps({"schema": "other", "chunks": [1]}).encode(), total=10) == []
    assert chunk_count(10, 4) == 3 and chunk_count(8, 4) == 2 and chunk_count(0, 4) == 1


def test_journal_keeps_the_newest_jobs_and_forgets_the_oldest(tmp_path):
    import os

    from device_agent.updates.journal import MAX_JOBS_KEPT, Journal

    journal = Journal(tmp_path)
    for index in range(MAX_JOBS_KEPT + 10):
        journal.save(Job(f"job-{index}", "deploy", state=J.FAILED, final=True))
        os.utime(tmp_path / f"job-{index}.json", (1000 + index, 1000 + index))
    journal.prune()
    assert len(list(tmp_path.glob("*.json"))) == MAX_JOBS_KEPT
    assert journal.get("job-0") is None and journal.get(f"job-{MAX_JOBS_KEPT + 9}") is not None


# ------------------------------------------------------------------ agent.yaml update settings


def _config(tmp_path, **updates):
    from device_agent.config import check_config

    document = {"device_id": "pi-07", "store": "store", "trust": ["k.pub"], "updates": updates}
    return check_config(document, tmp_path / "agent.yaml")


def test_update_settings_defaults_and_plain_window(tmp_path):
    from device_agent.config import HealthWindow

    config = _config(tmp_path)
    assert config.updates.health_window_s == HealthWindow(default=30.0, min=5.0, max=3600.0)
    assert config.operator_keys == ()
    short = _config(tmp_path, health_window_s=0.5)
    assert short.updates.health_window_s == HealthWindow(default=0.5, min=0.5, max=3600.0)


@pytest.mark.parametrize("updates, key", [
    ({"health_window_s": float("nan")}, "updates.health_window_s: nan is not a finite number"),
    ({"health_window_s": {"max": float("inf")}}, "updates.health_window_s.max"),
    ({"health_window_s": {"default": 2, "min": 5}}, "updates.health_window_s"),
    ({"health_window_s": {"default": 50, "max": 40}}, "updates.health_window_s"),
    ({"min_rate_bytes_s": float("nan")}, "updates.min_rate_bytes_s"),
    ({"download_deadline_s": 0}, "updates.download_deadline_s"),
    ({"allowed_origins": ["ftp://host"]}, "updates.allowed_origins"),
    ({"allowed_origins": ["http://host/path"]}, "updates.allowed_origins"),
    ({"allowed_names": ["../x"]}, "updates.allowed_names"),
    ({"health_window_s": {"ceiling": 5}}, "updates.health_window_s"),
])
def test_bad_update_settings_are_refused_naming_the_key(tmp_path, updates, key):
    from edgepack_core.errors import UsageError

    with pytest.raises(UsageError) as caught:
        _config(tmp_path, **updates)
    assert key in str(caught.value)


def test_operator_keys_resolve_against_the_config_folder(tmp_path):
    from device_agent.config import check_config

    config = check_config({"device_id": "d", "store": "s", "trust": ["k.pub"], "operator_keys": ["ops/op.pub"]},
                          tmp_path / "agent.yaml")
    assert config.operator_keys == ((tmp_path / "ops" / "op.pub").resolve(),)


# ------------------------------------------------------------------ download bounds (pure parts)


def test_origins_are_normalised_and_checked():
    from device_agent.updates.download import Bounds, allowed_origins, origin_allowed, origin_of

    assert origin_of("http://Host.Example/a") == "http://host.example:80"
    assert origin_of("https://h:8443/a") == "https://h:8443"
    assert origin_of("ftp://h/a") is None and origin_of("http://h:99999/a") is None
    bounds = Bounds(origins=allowed_origins(["http://h:8000", "https://objects.example"]), max_bytes=1)
    assert origin_allowed("http://h:8000/x.edgepkg", bounds)
    assert origin_allowed("https://objects.example:443/x", bounds)
    assert not origin_allowed("http://h:8001/x", bounds)
    assert not origin_allowed("https://h:8000/x", bounds)
    assert not origin_allowed("http://objects.example/x", bounds)
    broker_host = Bounds(origins=frozenset(), any_port_hosts=frozenset({"broker"}), max_bytes=1)
    assert origin_allowed("http://broker:1234/a", broker_host) and not origin_allowed("http://other:1/a", broker_host)


def test_download_progress_enforces_deadline_minimum_rate_and_cancel():
    from device_agent.updates.download import RATE_GRACE_S, Bounds, DownloadCancelled, DownloadError, _Progress

    now = [0.0]
    bounds = Bounds(origins=frozenset(), max_bytes=1, deadline_s=60.0, min_rate_bytes_s=100.0)
    progress = _Progress(bounds, lambda: False, lambda: now[0])
    now[0] = RATE_GRACE_S  # within the grace period nothing is judged
    progress.check()
    now[0] = 20.0
    progress.received = 2000  # exactly 100 bytes/s: allowed
    progress.check()
    progress.received = 1999
    with pytest.raises(DownloadError, match="slower than the minimum of 100 bytes/s"):
        progress.check()
    progress.received = 10**9
    now[0] = 60.0
    progress.check()  # at the deadline: still allowed
    now[0] = 60.001
    with pytest.raises(DownloadError, match="deadline of 60 s passed"):
        progress.check()
    with pytest.raises(DownloadCancelled):
        _Progress(bounds, lambda: True, lambda: 0.0).check()


def test_replay_ledger_keeps_an_id_through_its_expiry_second(tmp_path):
    from device_agent.updates.replay import ReplayError, ReplayGuard, live_ids

    assert live_ids({"a": NOW, "b": NOW - 0.001}, NOW) == {"a": NOW}
    guard = ReplayGuard(tmp_path / "ids.json", max_per_bucket=1)
    guard.remember("a", NOW + 5, NOW, **KEY)
    with pytest.raises(ReplayError, match="most allowed"):
        guard.remember("b", NOW + 60, NOW + 5, **KEY)  # "a" is still valid at its expiry instant
    guard.remember("b", NOW + 60, NOW + 5.001, **KEY)


# ------------------------------------------------------------------ daemon start: rollback order


@pytest.mark.parametrize("previous_loads", [True, False])
def test_active_model_that_no_longer_loads_is_replaced_only_after_the_previous_loads(tmp_path, keypair,
                                                                                    previous_loads):
    """An onnxruntime upgrade can make a verified model fail to load (simulated: it cannot
    happen here). The daemon loads the previous model *before* state.json changes; if that
    fails too, state.json is untouched and the original error stands."""
    from device_agent.config import check_config
    from device_agent.daemon import Daemon
    from device_agent.errors import SmokeTestError
    from tests.artifacts import build_artifact

    v1 = build_artifact(tmp_path / "a", keypair[0], version="1.0.0")
    v2 = build_artifact(tmp_path / "a", keypair[0], version="1.1.0", factor=3.0)
    config = check_config({"device_id": "d", "store": "store", "trust": [str(keypair[1])], "artifact": str(v1),
                           "api": {"enabled": False}}, tmp_path / "agent.yaml")
    first = Daemon(config).start()
    first.install_artifact(v2)
    first.stop()
    state = (tmp_path / "store" / "state.json").read_bytes()

    class UpgradedRuntime(Daemon):
        def load(self, installed):
            if installed.version == "1.1.0" or not previous_loads:
                raise SmokeTestError(f"{installed.name} {installed.version}", 0, "differs after a runtime upgrade")
            return super().load(installed)

    daemon = UpgradedRuntime(config)
    if previous_loads:
        daemon.start()
        assert daemon.service.model.manifest.version == "1.0.0"
        assert json.loads((tmp_path / "store" / "state.json").read_text())["active"].startswith("scale-1.0.0-")
        daemon.stop()
    else:
        with pytest.raises(SmokeTestError, match=r"scale 1\.1\.0"):
            daemon.start()
        assert (tmp_path / "store" / "state.json").read_bytes() == state


# ------------------------------------------------------------------ the full disk (updates/disk.py)


def test_the_disk_rule_boundary():
    from device_agent.updates.disk import space_problem

    assert space_problem(16 * 1024 * 1024, 16 * 1024 * 1024) == ""
    assert space_problem(16 * 1024 * 1024 - 1, 16 * 1024 * 1024) == (
        "no space: 16777215 bytes free on the store's filesystem, under updates.min_free_bytes (16777216)")
    assert space_problem(0, 0) == ""


@pytest.mark.parametrize(("available_blocks", "problem"), [(4096, False), (4095, True)])
def test_free_space_is_what_statvfs_grants_an_unprivileged_writer(tmp_path, monkeypatch, available_blocks, problem):
    """The OS reports free space in fragments (``f_frsize``): ``f_bavail`` of them for an
    unprivileged writer, more (``f_bfree``) for root. 4096 blocks of 4 KiB are exactly 16 MiB."""
    import os

    from device_agent.updates import disk

    calls = []

    def statvfs(path):
        calls.append(path)
        # bsize, frsize, blocks, bfree, bavail, files, ffree, favail, flag, namemax
        return os.statvfs_result((4096, 4096, 1 << 20, 1 << 19, available_blocks, 1000, 500, 500, 0, 255))

    monkeypatch.setattr(disk.os, "statvfs", statvfs)
    space = disk.FreeSpace(tmp_path, 16 * 1024 * 1024)
    assert bool(space.problem()) is problem and calls == [tmp_path]
    health = space.health()
    if problem:
        assert health == {"status": "degraded", "degraded": [
            "no space: 16773120 bytes free on the store's filesystem, under updates.min_free_bytes (16777216)"]}
    else:
        assert health == {}


def test_an_unreadable_filesystem_counts_as_no_space(tmp_path):
    from device_agent.updates.disk import FreeSpace

    assert FreeSpace(tmp_path / "gone").problem().startswith("no space: cannot read the free space of ")


# ------------------------------------------------------------------ a rollback is bound to what it undoes


def test_a_rollback_runs_only_on_the_model_it_names():
    from device_agent.updates.admission import rollback_refusal

    named = {"name": "scale", "version": "1.1.0"}
    assert rollback_refusal(named, ("scale", "1.1.0")) == ""
    assert rollback_refusal(named, ("scale", "1.2.0")) == (
        "the device has moved on: this rollback is from scale 1.1.0, the device serves scale 1.2.0")
    assert rollback_refusal(named, ("other", "1.1.0")).endswith("the device serves other 1.1.0")
    assert rollback_refusal(named, None).endswith("the device serves no model")


def test_a_rollback_without_from_version_is_rejected():
    parsed = parse_command(_cmd(type="rollback"), NOW)
    assert isinstance(parsed, Rejection) and "from_version" in parsed.reason
    parsed = parse_command(_cmd(type="rollback", from_version={"name": "scale", "version": "1.1.0"}), NOW)
    assert isinstance(parsed, Command)


def test_the_unauthenticated_commands_warning_is_for_agents_that_take_commands(tmp_path):
    from device_agent.config import check_config, unauthenticated_commands_warning

    base = {"device_id": "d", "store": "s", "trust": ["k.pub"], "mqtt": {"host": "broker"}}
    warning = unauthenticated_commands_warning(check_config(base, tmp_path / "agent.yaml"))
    assert warning.startswith("no operator_keys in agent.yaml: commands are not authenticated, so ANYONE WHO CAN "
                              "PUBLISH TO THE BROKER CAN COMMAND THIS DEVICE")
    no_mqtt = {key: value for key, value in base.items() if key != "mqtt"}
    for quiet in ({**base, "operator_keys": ["op.pub"]}, no_mqtt, {**base, "updates": {"enabled": False}}):
        assert unauthenticated_commands_warning(check_config(quiet, tmp_path / "agent.yaml")) == "", quiet
