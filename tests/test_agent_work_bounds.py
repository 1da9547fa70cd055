"""Work bounded by what a request declares, not only by its bytes (issue 21, item 4): the zip
directory of an npz, the scans of a progressive JPEG, the rows of a batch and the size of a JSON
answer are bounded before anything is parsed, decoded, run or encoded. On a real socket against
a real onnxruntime session (tests/test_http_attacks.py's server)."""

from __future__ import annotations

import io
import json
import zipfile

import numpy as np
import pytest

from device_agent import bodies
from edgepack_core import preprocess
from edgepack_core.errors import PreprocessError
from edgepack_core.jpeg_scans import MAX_SCANS, count_scans
from tests import test_http_attacks as attacks
from tests.hostile_bodies import jpeg_scan_bomb, npz_with_directory_entries
from tests.test_http_attacks import error_of, exchange, request_bytes, still_serves

# The attack tests' fixtures: a real server on a socket, a scale model and an image model.
serve, scale_artifact, image_artifact = attacks.serve, attacks.scale_artifact, attacks.image_artifact


def npz(**arrays: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


def test_npz_with_300000_central_directory_entries_is_refused_before_zipfile_reads_its_directory(
        serve, scale_artifact, monkeypatch):
    port, _ = serve(scale_artifact)
    opened = []
    real = zipfile.ZipFile
    monkeypatch.setattr(bodies.zipfile, "ZipFile", lambda *a, **k: opened.append(1) or real(*a, **k))
    bomb = npz_with_directory_entries(300_000)
    assert 12_000_000 < len(bomb) < 16 * 1024 * 1024
    status, _, body = exchange(port, request_bytes("POST", "/predict", bomb, "application/x-npz"))
    error = error_of(body)
    assert (status, error["kind"]) == (400, "bad_input") and "more than the 1 entries it declares" in error["message"]
    assert opened == []  # refused by the walk of its directory, never parsed by zipfile
    still_serves(port)


def test_npz_directory_with_exactly_its_declared_entries_is_read_and_one_more_is_refused(serve, scale_artifact):
    port, _ = serve(scale_artifact)
    status, _, body = exchange(port, request_bytes("POST", "/predict", npz_with_directory_entries(1),
                                                   "application/x-npz"))
    assert status == 200 and json.loads(body)["outputs"]["y"] == [[2.0] * 4]
    status, _, body = exchange(port, request_bytes("POST", "/predict", npz_with_directory_entries(2),
                                                   "application/x-npz"))
    assert (status, error_of(body)["kind"]) == (400, "bad_input")
    status, _, body = exchange(port, request_bytes("POST", "/predict", npz_with_directory_entries(0),
                                                   "application/x-npz"))
    assert (status, error_of(body)["kind"]) == (400, "bad_input")  # fewer than declared


def test_npz_with_a_zip64_locator_is_refused_even_when_its_end_record_looks_plain(serve, scale_artifact):
    port, _ = serve(scale_artifact)
    plain = npz(x=np.ones((1, 4), np.float32))
    at = plain.rfind(b"PK\x05\x06")
    forged = plain[:at] + bodies.ZIP64_LOCATOR + bytes(16) + plain[at:]
    status, _, body = exchange(port, request_bytes("POST", "/predict", forged, "application/x-npz"))
    assert (status, error_of(body)["kind"]) == (400, "bad_input") and "zip64" in error_of(body)["message"]


def test_progressive_jpeg_scan_bomb_is_refused_by_its_markers_before_it_is_decoded(serve, image_artifact,
                                                                                    monkeypatch):
    port, _ = serve(image_artifact)
    bomb = jpeg_scan_bomb(2048, 2000)  # 94 kB, about 5 s of CPU to decode
    decoded = []
    monkeypatch.setattr(preprocess.Preprocessor, "_load", staticmethod(lambda image: decoded.append(1)))
    status, _, body = exchange(port, request_bytes("POST", "/predict", bomb, "image/jpeg"))
    error = error_of(body)
    assert (status, error["kind"]) == (400, "bad_image") and "more than 100 scans" in error["message"]
    assert decoded == []


def test_jpeg_of_exactly_max_scans_is_decoded_and_one_scan_more_is_refused(serve, image_artifact):
    port, _ = serve(image_artifact)
    status, _, body = exchange(port, request_bytes("POST", "/predict", jpeg_scan_bomb(256, MAX_SCANS), "image/jpeg"))
    assert status == 200 and np.allclose(json.loads(body)["outputs"]["mean"], [[128 / 255] * 3], atol=0.01)
    status, _, body = exchange(port, request_bytes("POST", "/predict", jpeg_scan_bomb(256, MAX_SCANS + 1),
                                                   "image/jpeg"))
    assert (status, error_of(body)["kind"]) == (400, "bad_image")


def test_jpeg_walk_counts_scans_past_restart_markers_stuffed_bytes_and_fill(tmp_path):
    from PIL import Image

    buffer = io.BytesIO()
    Image.effect_noise((64, 64), 80).convert("RGB").save(buffer, "JPEG", progressive=True, restart_marker_blocks=1)
    data = buffer.getvalue()
    assert b"\xff\xd0" in data and b"\xff\x00" in data  # restart markers and stuffed bytes inside scans
    scans = count_scans(data)
    assert 5 <= scans <= 20
    at = data.index(b"\xff\xc4", 10)
    assert count_scans(data[:at] + b"\xff\xff\xff" + data[at + 1:]) == scans  # fill bytes before a marker
    assert count_scans(b"\x89PNG....") == 0
    with pytest.raises(PreprocessError, match="more than 2 scans"):
        count_scans(data, max_scans=2)
    with pytest.raises(PreprocessError, match="more than 3 segments"):
        count_scans(data, max_segments=3)
