"""Pure parts of remote updates: command parsing, the job state machine, restart decisions,
health verdicts, and the chunk codec."""

from __future__ import annotations

import json

import pytest

from device_agent.updates import jobs as J
from device_agent.updates.commands import Command, Rejection, parse_command
from device_agent.updates.jobs import InvalidTransition, Job, advance, on_restart
from device_agent.updates.service import judge_health
from device_agent.updates.xfer import chunk_count, decode_chunk, encode_chunk, parse_request, request_payload

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


def _stats(ok=0, server=0, non_finite=0, latency_sum=0.0):
    return {"requests": {"ok": ok, "client_error": 0, "server_error": server}, "non_finite": non_finite,
            "latency_sum": latency_sum}


def test_health_verdicts():
    base = _stats(ok=100, latency_sum=0.1)
    healthy = judge_health(base, _stats(ok=200, latency_sum=0.2), 0.001, max_error_rate=0.05, max_latency_factor=3)
    assert healthy.healthy
    errors = judge_health(base, _stats(ok=150, server=10, latency_sum=0.15), 0.001, max_error_rate=0.05,
                          max_latency_factor=3)
    assert not errors.healthy and "10 errors" in errors.reason
    nan = judge_health(base, _stats(ok=120, non_finite=20, latency_sum=0.12), 0.001, max_error_rate=0.05,
                       max_latency_factor=3)
    assert not nan.healthy and "20 non-finite" in nan.reason
    slow = judge_health(base, _stats(ok=150, latency_sum=0.1 + 50 * 0.005), 0.001, max_error_rate=0.05,
                        max_latency_factor=3)
    assert not slow.healthy and "latency" in slow.reason
    idle = judge_health(base, base, 0.001, max_error_rate=0.05, max_latency_factor=3)
    assert idle.healthy


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
