"""``edgepack-agent predict`` from exec to answer: only the modules the answer needs, the artifact
verified once and completely (every hash, once), one session whose smoke test is the warm-up,
and the same refusals as before. Its speed against a bare onnxruntime script is measured in
``tools/bench/cold_start.py`` (BENCHMARKS.md), not here."""

from __future__ import annotations

import gzip
import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from device_agent import cli
from tests.artifacts import build_artifact
from tests.conftest import cli as cli_path
from tests.conftest import run_cli

# Nothing of the daemon: MQTT, telemetry, the outbox, HTTP, the store, updates, agent.yaml; no
# payload schemas; nothing of the host.
NOT_NEEDED = ("paho", "sqlite3", "yaml", "http.server", "socketserver", "device_agent.telemetry",
              "device_agent.http.app", "device_agent.http.server", "starlette", "hypercorn",
              "device_agent.daemon", "device_agent.store", "device_agent.updates",
              "device_agent.config", "edgepack_core.mqtt_transport", "edgepack_core.protocol.payloads",
              "edgepack_core.protocol.commands", "sdk", "onnx", "click")


@pytest.fixture(scope="module")
def artifact(tmp_path_factory, keypair):
    folder = tmp_path_factory.mktemp("cold")
    return build_artifact(folder, keypair[0])


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    path = tmp_path_factory.mktemp("input") / "x.npy"
    np.save(path, np.arange(4, dtype=np.float32).reshape(1, 4))
    return path


def test_predict_imports_only_what_the_answer_needs(artifact, keypair, example):
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "device_agent.cli", "predict", "--artifact",
                           str(artifact), "--trust", str(keypair[1]), "--input", str(example), "--json"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout)["outputs"]["y"] == [[0.0, 2.0, 4.0, 6.0]]
    imported = {line.split("|")[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    assert "onnxruntime" in imported and "edgepack_core.artifact" in imported  # the parse works
    loaded = sorted(name for name in imported if any(name == bad or name.startswith(bad + ".") for bad in NOT_NEEDED))
    assert loaded == []


def test_predict_hashes_each_member_once_on_one_session(artifact, keypair, example, monkeypatch, capsys):
    import edgepack_core.artifact as artifact_module

    hashed: list[int] = []
    real_copy = artifact_module._copy_hashed

    def counting_copy(pieces, sink):
        hashed.append(1)
        return real_copy(pieces, sink)

    def never(*_args, **_kwargs):
        raise AssertionError("a second verification")

    sessions = []
    real_session = ort.InferenceSession

    def counting_session(*args, **kwargs):
        sessions.append(real_session(*args, **kwargs))
        return sessions[-1]

    monkeypatch.setattr(artifact_module, "_copy_hashed", counting_copy)
    monkeypatch.setattr(artifact_module, "read_extracted", never)
    monkeypatch.setattr(artifact_module, "verify_artifact", never)
    monkeypatch.setattr(ort, "InferenceSession", counting_session)
    assert cli.main(["predict", "--artifact", str(artifact), "--trust", str(keypair[1]), "--input", str(example),
                     "--json"]) == 0
    answer = json.loads(capsys.readouterr().out)
    manifest_files = len(json.loads(_members(artifact)["manifest.json"])["files"])
    assert len(hashed) == manifest_files  # every member hashed, each once
    assert len(sessions) == 1  # the smoke test ran on the session that answered
    assert answer["provider"] == "CPUExecutionProvider" and answer["outputs"]["y"] == [[0.0, 2.0, 4.0, 6.0]]


def _members(artifact: Path) -> dict[str, bytes]:
    with tarfile.open(artifact) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}


def predict_with_tmpdir(scratch: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TMPDIR": str(scratch), "PYTHONWARNINGS": "ignore"}
    return subprocess.run([cli_path("edgepack-agent"), "predict", *args], capture_output=True, text=True, env=env,
                          timeout=120, check=False, stdin=subprocess.DEVNULL)


def test_predict_still_refuses_a_tampered_artifact(artifact, keypair, example, tmp_path):
    raw = bytearray(gzip.decompress(artifact.read_bytes()))
    with tarfile.open(fileobj=io.BytesIO(bytes(raw))) as tar:
        member = tar.getmember("model/model.onnx")
    raw[member.offset_data + member.size - 1] ^= 0x01  # one bit of the model, after signing
    evil = tmp_path / "evil.edgepkg"
    evil.write_bytes(gzip.compress(bytes(raw)))
    done = run_cli("edgepack-agent", "predict", "--artifact", str(evil), "--trust", str(keypair[1]), "--input",
                   str(example), "--json")
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.strip().splitlines() == [done.stderr.strip()]  # one line, no traceback
    assert "model/model.onnx" in done.stderr and "sha256 differs" in done.stderr


def test_a_missing_input_is_the_error_reported_and_nothing_is_left_behind(artifact, keypair, tmp_path):
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    absent = tmp_path / "absent.npy"
    done = predict_with_tmpdir(scratch, "--artifact", str(tmp_path / "absent.edgepkg"), "--trust", str(keypair[1]),
                               "--input", str(absent))
    assert done.returncode == 2  # both are wrong: the input is named, as before verification moved to a thread
    assert done.stderr.strip() == f"edgepack-agent: error: {absent}: no such input file"
    done = predict_with_tmpdir(scratch, "--artifact", str(artifact), "--trust", str(keypair[1]), "--input", str(absent))
    assert done.returncode == 2 and done.stderr.strip() == f"edgepack-agent: error: {absent}: no such input file"
    assert list(scratch.iterdir()) == []  # the verifying thread finished before its directory was removed


def test_public_keys_read_without_the_serialization_package_are_the_same_keys(tmp_path):
    """``load_public_key`` reads edgepack's own key files (one Ed25519 SubjectPublicKeyInfo in
    PEM, after their ``edgepack-key:`` line or, for older files, without it) itself; anything else
    goes through cryptography's reader exactly as before."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    from edgepack_core.errors import KeyFileError
    from edgepack_core.signing import _plain_ed25519_pem, load_public_key
    from sdk.keys import write_keypair

    write_keypair(tmp_path / "k.key", tmp_path / "k.pub")
    pem = (tmp_path / "k.pub").read_bytes()
    assert pem.startswith(b"edgepack-key: release\n-----BEGIN PUBLIC KEY-----\n")  # keygen labels its keys
    reference = serialization.load_pem_public_key(pem).public_bytes_raw()
    assert _plain_ed25519_pem(pem) is not None
    assert load_public_key(tmp_path / "k.pub").public_bytes_raw() == reference
    bare = pem[pem.index(b"-----BEGIN"):]  # a key file written before keys had kinds
    assert _plain_ed25519_pem(bare).public_bytes_raw() == reference
    commented = tmp_path / "commented.pub"
    commented.write_bytes(b"release key, 2026\n" + pem)  # not the plain form: cryptography's reader decides
    assert _plain_ed25519_pem(commented.read_bytes()) is None
    assert load_public_key(commented).public_bytes_raw() == reference
    other = ec.generate_private_key(ec.SECP256R1()).public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    (tmp_path / "ec.pub").write_bytes(other)
    assert _plain_ed25519_pem(other) is None
    with pytest.raises(KeyFileError, match="not an Ed25519 public key"):
        load_public_key(tmp_path / "ec.pub")
    body = b"".join(bare.strip().splitlines()[1:-1])
    import base64

    der = bytearray(base64.b64decode(body, validate=True))
    der[9] ^= 0x01  # another algorithm's OID, same length
    forged = b"-----BEGIN PUBLIC KEY-----\n" + base64.b64encode(bytes(der)) + b"\n-----END PUBLIC KEY-----\n"
    for name, data in (("forged.pub", forged), ("labelled-forged.pub", b"edgepack-key: release\n" + forged)):
        (tmp_path / name).write_bytes(data)
        assert _plain_ed25519_pem(data) is None
        with pytest.raises(KeyFileError):
            load_public_key(tmp_path / name)


def test_predict_pauses_the_collector_and_restores_it_in_process(artifact, keypair, example, monkeypatch, capsys):
    """The collector is off while predict imports and runs (asked from inside the session
    factory), and on again when main returns, after a success and after a refusal alike."""
    import gc

    seen = []
    real_session = ort.InferenceSession

    def recording_session(*args, **kwargs):
        seen.append(gc.isenabled())
        return real_session(*args, **kwargs)

    monkeypatch.setattr(ort, "InferenceSession", recording_session)
    assert gc.isenabled()
    assert cli.main(["predict", "--artifact", str(artifact), "--trust", str(keypair[1]), "--input", str(example),
                     "--json"]) == 0
    assert seen == [False] and gc.isenabled()
    assert cli.main(["predict", "--artifact", str(artifact), "--trust", str(keypair[1]), "--input",
                     str(example.with_name("absent.npy"))]) == 2
    assert gc.isenabled()
    capsys.readouterr()


def test_predict_as_the_program_answers_in_full_and_skips_the_teardown(artifact, keypair, example):
    """Run as the program (main without argv), predict ends with os._exit once its output is
    flushed: the whole answer and the exit code arrive through pipes, and an atexit handler
    (which a normal interpreter exit would run) does not. A refusal exits the same way, with
    its one line and its code."""
    program = ("import atexit, sys\n"
               "atexit.register(lambda: print('teardown ran', file=sys.stderr))\n"
               "from device_agent.cli import main\n"
               "sys.exit(main())\n")

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", program, "predict", "--artifact", str(artifact), "--trust",
                               str(keypair[1]), *args], capture_output=True, text=True, timeout=120, check=False)

    done = run("--input", str(example), "--json")
    assert done.returncode == 0 and done.stderr == ""
    assert json.loads(done.stdout)["outputs"]["y"] == [[0.0, 2.0, 4.0, 6.0]]
    done = run("--input", str(example.with_name("absent.npy")))
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == f"edgepack-agent: error: {example.with_name('absent.npy')}: no such input file\n"
    other = subprocess.run([sys.executable, "-c", program, "verify", "--artifact", str(artifact), "--trust",
                            str(keypair[1])], capture_output=True, text=True, timeout=120, check=False)
    assert other.returncode == 0 and "teardown ran" in other.stderr  # only predict skips it


def test_predict_as_the_program_verifies_in_a_forked_child_and_in_process_on_a_thread(artifact, keypair, example):
    """As the program, predict forks once for the verification (os.fork's audit event fires in
    the parent, before onnxruntime is imported); called in-process it never forks (a test or an
    embedder may hold threads a fork must not copy). Both answer the same."""
    program = ("import sys\n"
               "def hook(event, args):\n"
               "    if event == 'os.fork':\n"
               "        sys.stderr.write('fork, onnxruntime imported: %s\\n' % ('onnxruntime' in sys.modules))\n"
               "sys.addaudithook(hook)\n"
               "from device_agent.cli import main\n"
               "argv = sys.argv[1:]\n"
               "sys.exit(main(argv) if argv[0] == 'in-process' and argv.pop(0) else main())\n")
    common = ["predict", "--artifact", str(artifact), "--trust", str(keypair[1]), "--input", str(example), "--json"]
    as_program = subprocess.run([sys.executable, "-c", program, *common], capture_output=True, text=True,
                                timeout=120, check=False)
    assert as_program.returncode == 0, as_program.stderr
    assert as_program.stderr == "fork, onnxruntime imported: False\n"
    in_process = subprocess.run([sys.executable, "-c", program, "in-process", *common], capture_output=True,
                                text=True, timeout=120, check=False)
    assert in_process.returncode == 0, in_process.stderr
    assert in_process.stderr == ""
    assert json.loads(as_program.stdout)["outputs"] == json.loads(in_process.stdout)["outputs"] == {
        "y": [[0.0, 2.0, 4.0, 6.0]]}
