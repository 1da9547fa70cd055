"""tools/bench/fleet_converge.py on a small fleet: a staged target change in 3 waves with every
fault of the simulator ends with every healthy device on target and each faulted one on target
or on its last good version, none unknown (real mosquitto, real `edgepack fleet serve`)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tools.bench.fleet_converge import NEW, OLD, Outcome, judge, run_once
from tools.fleet_sim import FAULT_KINDS, ROOT, assign_faults


def test_faults_are_a_share_of_the_fleet_each_kind_in_turn():
    faults = assign_faults(100, 0.05, seed=3)
    assert len(faults) == 5 and sorted(faults.values()) == sorted([*FAULT_KINDS, FAULT_KINDS[0]])
    assert assign_faults(100, 0.05, seed=3) == faults  # the seed decides which
    assert assign_faults(100, 0.0) == {} and len(assign_faults(10, 1.0)) == 10
    with pytest.raises(ValueError):
        assign_faults(10, 1.01)


def test_a_device_the_server_sees_on_another_version_than_it_runs_is_unknown():
    truth = {"a": NEW, "b": OLD, "c": NEW, "d": OLD}
    counts = judge({"a": "converged", "b": "wait", "c": "converged", "d": "wait"},
                   {"a": NEW, "b": OLD, "c": OLD, "d": OLD}, {"a": True, "b": True, "c": True, "d": False},
                   truth, faulted={"b", "d"})
    assert counts == {"healthy_on_target": 1, "faulted_on_target": 0, "faulted_on_last_good": 1, "unknown": 2}


def test_the_rule_needs_999_per_mille_of_healthy_devices_and_every_faulted_one_settled():
    base = dict(devices=1050, faulted=50, faulted_on_target=20, faulted_on_last_good=30, unknown=0, converge_s=1.0,
                rollout_state="succeeded", ingest_rate_per_s=1.0, ingest_last_lag_s=0.0, ingest_max_lag_s=0.0)
    assert Outcome(healthy_on_target=999, **base).holds  # 99.9 % of 1,000
    assert not Outcome(healthy_on_target=998, **base).holds
    assert not Outcome(healthy_on_target=1000, **{**base, "faulted_on_last_good": 29}).holds
    assert not Outcome(healthy_on_target=1000, **{**base, "unknown": 1}).holds
    assert not Outcome(healthy_on_target=1000, **{**base, "rollout_state": "failed"}).holds  # the target never changed


def test_a_three_wave_target_change_converges_a_small_fleet_with_every_fault(tmp_path: Path):
    args = argparse.Namespace(devices=24, faults=4 / 24, seed=1, rate=0.5, outage=1.0, health_window=0.3,
                              success_share=0.5, wave_timeout=60.0, timeout=120.0)
    outcome = run_once(args, tmp_path)
    assert outcome.faulted == 4 and outcome.rollout_state == "succeeded"
    assert (outcome.healthy_on_target, outcome.unknown) == (20, 0)
    # power cut and link loss recover (on target); disk full and the bad version stay on 1.0.0
    assert (outcome.faulted_on_target, outcome.faulted_on_last_good) == (2, 2)
    assert outcome.holds


def test_the_simulator_logs_in_with_the_host_commands_broker_options_over_tls(tmp_path: Path):
    """`--username`, `--password-file` and `--tls-ca` as for every host command: three devices
    publish through a broker that refuses anonymous and plain clients on its TLS port."""
    from tests.broker import default_config, free_port, start_mosquitto
    from tests.test_mqtt_transport import _write_ca_and_server_cert

    ca, cert, key = _write_ca_and_server_cert(tmp_path)
    subprocess.run(["mosquitto_passwd", "-c", "-b", str(tmp_path / "passwd"), "sim", "pw-sim"], check=True,
                   capture_output=True, stdin=subprocess.DEVNULL)
    password = tmp_path / "sim.password"
    password.write_text("pw-sim\n")
    port, tls_port = free_port(), free_port()
    broker = start_mosquitto(config=default_config(port, anonymous=False) + f"\npassword_file {tmp_path / 'passwd'}\n"
                             f"listener {tls_port} 127.0.0.1\ncertfile {cert}\nkeyfile {key}\ncafile {ca}\n",
                             port=port, workdir=tmp_path / "mosquitto")
    try:
        result = subprocess.run([sys.executable, str(ROOT / "tools" / "fleet_sim.py"), "--devices", "3", "--duration",
                                 "1", "--broker", f"127.0.0.1:{tls_port}", "--tls-ca", str(ca), "--username", "sim",
                                 "--password-file", str(password), "--json"],
                                capture_output=True, text=True, timeout=90)
    finally:
        broker.kill()
    assert result.returncode == 0, result.stdout + result.stderr
    doc = json.loads(result.stdout)
    assert (doc["sent"], doc["lost"], doc["fleet_status_devices"]) == (3, 0, 3)


@pytest.mark.parametrize(("args", "code", "says"), [
    (["--waves", "5,25,100", "--success-share", "0"], 2, "0<x<=1"),
    (["--waves", "5,25,100", "--success-share", "1.01"], 2, "0<x<=1"),
    (["--success-share", "0.8"], 2, "give --waves too"),
])
def test_target_set_refuses_a_success_share_outside_0_to_1_or_without_waves(tmp_path, args, code, says):
    token = tmp_path / "token"
    token.write_text("x" * 32)
    result = subprocess.run([str(Path(sys.executable).parent / "edgepack"), "target", "set", "--group", "g",
                             "0" * 64, "--server", "http://127.0.0.1:9", "--token-file", str(token), *args],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == code and says in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
