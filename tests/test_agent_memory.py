"""Giving back start-up pages (device_agent/memory.py): which mappings are chosen (pure), that a
session answers the same once its library's pages are out, that a kernel without the advice is
reported and nothing is done, and that the daemon does it after start and after an activation
unless ``memory.release_startup_pages`` is off. How much RSS it gives back is measured by
tools/bench/agent_rss.py (BENCHMARKS.md), never asserted here: on a shared machine the kernel
leaves alone the pages other processes map too."""

from __future__ import annotations

import ctypes
import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from device_agent import memory
from device_agent.config import check_config
from device_agent.daemon import Daemon
from device_agent.memory import MemorySettings, Region, Released, memory_reading, parse_maps, releasable, rss_kib
from tests.artifacts import build_artifact, scale_model
from tests.broker import free_port

ROOT = Path(__file__).resolve().parent.parent
MAPS = """\
55d0c0a00000-55d0c0a01000 r--p 00000000 08:01 131 /usr/bin/python3.11
7f0000000000-7f0000100000 r-xp 00010000 08:01 200 /venv/ort/capi/onnxruntime_pybind11_state.cpython-311.so
7f0000100000-7f0000110000 r--p 00110000 08:01 200 /venv/ort/capi/onnxruntime_pybind11_state.cpython-311.so
7f0000110000-7f0000112000 rw-p 00120000 08:01 200 /venv/ort/capi/onnxruntime_pybind11_state.cpython-311.so
7f0000200000-7f0000300000 r-xp 00028000 08:01 300 /usr/lib/x86_64-linux-gnu/libc.so.6
7f0000300000-7f0000301000 r--p 00000000 08:01 301 /store/models/digits/model/model.onnx
7f0000400000-7f0000500000 rw-p 00000000 00:00 0
7f0000500000-7f0000501000 r-xp 00000000 08:01 302 /tmp/libgone.so (deleted)
7f0000600000-7f0000601000 r--s 00000000 08:01 303 /venv/lib/_rust.abi3.so
55d0c1000000-55d0c1100000 rw-p 00000000 00:00 0                          [heap]
7ffd00000000-7ffd00021000 rw-p 00000000 00:00 0                          [stack]
7ffd00100000-7ffd00102000 r-xp 00000000 00:00 0                          [vdso]
not a mapping line
"""
ONNXRUNTIME = "/venv/ort/capi/onnxruntime_pybind11_state.cpython-311.so"
# A fresh interpreter: one session's answer, the pages given back, the same input again.
AFTER_RELEASE = """
import json, sys
import numpy as np, onnxruntime as ort
from device_agent.memory import parse_maps, release_startup_pages, releasable, MAPS
session = ort.InferenceSession(sys.argv[1], providers=["CPUExecutionProvider"])
x = np.arange(12, dtype=np.float32).reshape(3, 4)
before = session.run(None, {"x": x})[0]
regions = {(r.start, r.end, r.perms, r.path) for r in releasable(parse_maps(MAPS.read_text()))}
released = release_startup_pages()
after = session.run(None, {"x": x})[0]
kept = regions <= {(r.start, r.end, r.perms, r.path) for r in releasable(parse_maps(MAPS.read_text()))}
print(json.dumps({"same": before.tobytes() == after.tobytes(), "expected": after.tolist(), "regions": released.regions,
                  "unsupported": released.unsupported, "kept": kept, "rss": released.rss_after_kib}))
"""


def test_only_shared_objects_code_and_read_only_data_are_chosen():
    chosen = releasable(parse_maps(MAPS))
    assert [(region.perms, region.path.rsplit("/", 1)[-1]) for region in chosen] == [
        ("r-xp", ONNXRUNTIME.rsplit("/", 1)[-1]),
        ("r--p", ONNXRUNTIME.rsplit("/", 1)[-1]),
        ("r-xp", "libc.so.6"),
        ("r--s", "_rust.abi3.so"),
    ]


@pytest.mark.parametrize(
    "line",
    [
        "7f0000110000-7f0000112000 rw-p 00120000 08:01 200 /venv/lib/x.so",  # written by start-up: state
        "7f0000400000-7f0000500000 rw-p 00000000 00:00 0",  # anonymous
        "7f0000300000-7f0000301000 r--p 00000000 08:01 301 /store/model.onnx",  # not a shared object
        "7f0000500000-7f0000501000 r-xp 00000000 08:01 302 /tmp/libgone.so (deleted)",
        "7ffd00100000-7ffd00102000 r-xp 00000000 00:00 0                          [vdso]",
        "55d0c0a00000-55d0c0a01000 r--p 00000000 08:01 131 /usr/bin/python3.11",  # the executable
        "7f0000000000-7f0000000000 r-xp 00000000 08:01 200 /venv/lib/x.so",  # empty
    ],
)
def test_what_is_not_a_read_only_region_of_a_shared_object_is_never_chosen(line):
    assert releasable(parse_maps(line)) == ()


def test_a_maps_line_parses_into_its_range_permissions_and_path():
    region = parse_maps(MAPS.splitlines()[1])[0]
    assert region == Region(0x7F0000000000, 0x7F0000100000, "r-xp", ONNXRUNTIME) and region.size == 0x100000
    assert parse_maps("zz-yy r--p 0 0 0 /x.so\nnot a mapping line\n") == ()


def test_the_resident_size_is_read_from_the_status_text():
    assert rss_kib("Name:\tpython\nVmHWM:\t 9000 kB\nVmRSS:\t   88312 kB\n") == 88312
    assert rss_kib("Name:\tkthreadd\n") == 0


STATUS = "Name:\tpython\nVmRSS:\t   46900 kB\nRssAnon:\t   35100 kB\nRssFile:\t   11700 kB\nRssShmem:\t 100 kB\n"


@pytest.mark.parametrize(
    "released, fields",
    [
        (None, {"release": "off"}),
        (Released(210, 75000, 46900), {"release": "on", "released_bytes": 28100 * 1024}),
        (
            Released(0, 73000, 73000, unsupported="the kernel has no MADV_PAGEOUT (Linux 5.4 and later)"),
            {"release": "unsupported: the kernel has no MADV_PAGEOUT (Linux 5.4 and later)"},
        ),
        (Released(3, 46000, 46100), {"release": "on", "released_bytes": 0}),  # grew meanwhile: nothing given back
    ],
)
def test_the_memory_reading_says_what_is_resident_and_what_the_release_gave_back(released, fields):
    assert memory_reading(STATUS, released).to_json() == {
        "rss_bytes": 46900 * 1024,
        "anonymous_bytes": 35100 * 1024,
        "file_bytes": 11700 * 1024,
        **fields,
    }


def test_a_session_answers_the_same_after_its_library_pages_are_given_back(tmp_path):
    model = scale_model(tmp_path / "scale.onnx", factor=3.0)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-c", AFTER_RELEASE, str(model)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    answer = json.loads(done.stdout.splitlines()[-1])
    assert answer["unsupported"] == "" and answer["regions"] > 0 and answer["rss"] > 0
    assert answer["same"] and answer["kept"]  # the advice unmaps nothing and changes no answer
    assert answer["expected"][1] == [12.0, 15.0, 18.0, 21.0]


def _fake_madvise(answers: dict[int, list[int]]):
    """madvise as libc's behaves: 0, or -1 with errno set (ctypes' copy, as use_errno=True keeps
    it); ``answers``: per advice, the errno of each call in turn (0: done; the last one repeats)."""
    calls: list[tuple[int, int, int]] = []

    def advise(start: int, length: int, advice: int) -> int:
        calls.append((start, length, advice))
        given = answers[advice]
        code = given[min(sum(1 for call in calls if call[2] == advice) - 1, len(given) - 1)]
        if code:
            ctypes.set_errno(code)
            return -1
        return 0

    return advise, calls


def test_a_kernel_without_pageout_still_unmaps_what_holds_no_private_copy(monkeypatch):
    """Before Linux 5.4 (EINVAL for MADV_PAGEOUT), or for a library the agent may not write."""
    advise, calls = _fake_madvise({memory.MADV_PAGEOUT: [errno.EINVAL], memory.MADV_DONTNEED: [0]})
    monkeypatch.setattr(memory, "_madvise", lambda: advise)
    released = memory.release_startup_pages()
    unmapped = {(start, length) for start, length, advice in calls if advice == memory.MADV_DONTNEED}
    assert released.unsupported == "" and released.regions == len(unmapped) > 0


def test_a_mapping_holding_private_copies_is_never_unmapped(monkeypatch):
    """The loader's relocated read-only data (RELRO) would read back from the file unrelocated."""
    advise, calls = _fake_madvise({memory.MADV_PAGEOUT: [0], memory.MADV_DONTNEED: [0]})
    monkeypatch.setattr(memory, "_madvise", lambda: advise)
    regions = {(r.start, r.size): r for r in parse_maps(memory.SMAPS.read_text())}
    memory.release_startup_pages()
    unmapped = [regions[(start, length)] for start, length, advice in calls if advice == memory.MADV_DONTNEED]
    paged = [regions[(start, length)] for start, length, advice in calls if advice == memory.MADV_PAGEOUT]
    assert unmapped and all(region.anonymous_kib == 0 and "w" not in region.perms for region in unmapped)
    assert any((region.anonymous_kib or 0) > 0 for region in paged)  # this process has relocated libraries


def test_a_region_gone_meanwhile_does_not_stop_the_others(monkeypatch):
    advise, calls = _fake_madvise({memory.MADV_PAGEOUT: [errno.ENOMEM, 0], memory.MADV_DONTNEED: [errno.ENOMEM, 0]})
    monkeypatch.setattr(memory, "_madvise", lambda: advise)
    released = memory.release_startup_pages()
    pageouts = sum(1 for call in calls if call[2] == memory.MADV_PAGEOUT)
    assert released.unsupported == "" and released.regions == pageouts - 1 > 0


def test_smaps_gives_each_mapping_its_private_copies():
    text = (
        MAPS.splitlines()[1]
        + "\nSize:  1024 kB\nAnonymous:    12 kB\nVmFlags: rd ex\n"
        + MAPS.splitlines()[4]
        + "\nAnonymous:     0 kB\n"
    )
    first, second = parse_maps(text)
    assert (first.anonymous_kib, second.anonymous_kib) == (12, 0)
    assert memory.unmappable((first, second)) == (second,)
    cut_short = parse_maps(MAPS.splitlines()[4] + "\nSize:  1024 kB\n")  # smaps read up to its bound
    assert cut_short[0].anonymous_kib is None and memory.unmappable(cut_short) == ()


def _daemon(tmp_path: Path, public: Path, artifact: Path, memory_section: dict[str, bool] | None) -> Daemon:
    document = {
        "device_id": "mem-01",
        "store": str(tmp_path / "store"),
        "trust": [str(public)],
        "artifact": str(artifact),
        "api": {"listen": f"127.0.0.1:{free_port()}"},
    }
    if memory_section is not None:
        document["memory"] = memory_section
    return Daemon(check_config(document, tmp_path / "agent.yaml"))


def test_the_agent_gives_pages_back_after_start_and_after_an_activation(tmp_path, keypair, monkeypatch):
    artifact = build_artifact(tmp_path / "a", keypair[0])
    whens: list[str] = []
    real = memory.release_if_enabled
    monkeypatch.setattr(
        "device_agent.daemon.release_if_enabled", lambda settings, when: whens.append(when) or real(settings, when)
    )
    daemon = _daemon(tmp_path, keypair[1], artifact, None).start()
    try:
        assert whens == ["after start"]  # the install during start is not released twice
        assert daemon.released is not None and daemon.released.regions > 0
        memory_doc = daemon.health()["memory"]
        assert memory_doc["release"] == "on" and memory_doc["released_bytes"] >= 0
        assert memory_doc["rss_bytes"] >= memory_doc["anonymous_bytes"] > 0
        daemon.install_artifact(build_artifact(tmp_path / "b", keypair[0], version="1.0.1", factor=3.0))
        assert whens == ["after start", "after activating scale"]
    finally:
        daemon.stop()


def test_memory_release_startup_pages_false_keeps_every_page(tmp_path, keypair, monkeypatch):
    monkeypatch.setattr(memory, "release_startup_pages", lambda: pytest.fail("pages were given back"))
    daemon = _daemon(
        tmp_path, keypair[1], build_artifact(tmp_path / "a", keypair[0]), {"release_startup_pages": False}
    ).start()
    try:
        assert daemon.config.memory == MemorySettings(release_startup_pages=False) and daemon.released is None
        assert daemon.health()["memory"]["release"] == "off" and "released_bytes" not in daemon.health()["memory"]
    finally:
        daemon.stop()
