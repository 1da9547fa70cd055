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

from device_agent.http import bodies
from edgepack_core import preprocess
from edgepack_core.errors import PreprocessError
from edgepack_core.jpeg_scans import MAX_FILL, MAX_SCANS, count_scans
from tests import test_http_attacks as attacks
from tests.hostile_bodies import jpeg_scan_bomb, npz_with_directory_entries, npz_zip_bomb
from tests.test_http_attacks import error_of, exchange, npy, request_bytes, still_serves

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


def predict(port: int, body: bytes, content_type: str, accept: str = "application/json",
            query: str = "") -> tuple[int, dict[str, str], bytes]:
    return exchange(port, request_bytes("POST", f"/predict{query}", body, content_type, extra=f"Accept: {accept}\r\n"))


def test_65_kb_npz_asking_for_a_64_mib_batch_is_413_before_it_is_inflated(serve, scale_artifact):
    port, _ = serve(scale_artifact)  # defaults: 64 MiB decoded, 4 MiB for an input with symbolic dims
    bomb = npz_zip_bomb((4 * 1024 * 1024, 4))  # [batch, 4] float32: 64 MiB of rows
    assert len(bomb) < 70_000
    status, _, body = predict(port, bomb, "application/x-npz", accept="application/x-npz")
    error = error_of(body)
    assert (status, error["kind"]) == (413, "too_large") and "api.max_batch_bytes" in error["message"]
    still_serves(port)


def test_batch_bound_holds_at_its_limit_and_refuses_one_row_more_in_npz_npy_json_and_v2(serve, scale_artifact):
    port, _ = serve(scale_artifact, max_batch_bytes=100 * 16)  # 100 rows of [batch, 4] float32
    for rows, expected in ((100, 200), (101, 413)):
        x = np.ones((rows, 4), np.float32)
        cases = [(npz(x=x), "application/x-npz"), (npy(x), "application/x-npy"),
                 (json.dumps({"inputs": {"x": x.tolist()}}).encode(), "application/json")]
        for data, media in cases:
            status, _, body = predict(port, data, media, accept="application/x-npz")
            assert status == expected, (rows, media, body[:200])
        v2 = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [rows, 4],
                                     "data": x.reshape(-1).tolist()}],
                         "outputs": [{"name": "y", "parameters": {"binary_data": True}}]}).encode()
        status, _, body = exchange(port, request_bytes("POST", "/v2/models/scale/infer", v2))
        assert status == expected, (rows, body[:200])


def test_one_row_larger_than_max_batch_bytes_still_fits(serve, scale_artifact):
    port, _ = serve(scale_artifact, max_batch_bytes=8)  # under one row of 16 bytes
    status, _, _ = predict(port, npy(np.ones((1, 4), np.float32)), "application/x-npy")
    assert status == 200
    status, _, body = predict(port, npy(np.ones((2, 4), np.float32)), "application/x-npy")
    assert (status, error_of(body)["kind"]) == (413, "too_large")


def test_raw_outputs_in_json_over_max_json_output_bytes_are_413_pointing_to_npz(serve, scale_artifact):
    port, _ = serve(scale_artifact, max_json_output_bytes=100 * 16)  # y is [batch, 4] float32
    status, _, body = predict(port, npy(np.ones((100, 4), np.float32)), "application/x-npy", query="?outputs=raw")
    assert status == 200 and len(json.loads(body)["outputs"]["y"]) == 100
    x = npy(np.ones((101, 4), np.float32))
    status, _, body = predict(port, x, "application/x-npy", query="?outputs=raw")
    error = error_of(body)
    assert (status, error["kind"]) == (413, "too_large") and "application/x-npz" in error["message"]
    status, _, body = predict(port, x, "application/x-npy", accept="application/x-npz")
    assert status == 200 and np.load(io.BytesIO(body))["y"].shape == (101, 4)


def test_v2_outputs_in_json_over_max_json_output_bytes_are_413_pointing_to_binary_data(serve, scale_artifact):
    port, _ = serve(scale_artifact, max_json_output_bytes=100 * 16)

    def infer(rows: int, binary: bool) -> tuple[int, bytes]:
        document = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [rows, 4], "data": [1.0] * rows * 4}],
                    "parameters": {"binary_data_output": binary}}
        status, _, body = exchange(port, request_bytes("POST", "/v2/models/scale/infer", json.dumps(document).encode()))
        return status, body

    assert infer(100, False)[0] == 200
    status, body = infer(101, False)
    assert status == 413 and "binary_data_output" in json.loads(body)["error"]
    assert infer(101, True)[0] == 200


def test_jpeg_walk_refuses_junk_between_segments_and_fill_beyond_its_bound():
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (16, 16)).save(buffer, "JPEG")
    data = buffer.getvalue()
    at = data.index(b"\xff\xdb")  # the first quantization table
    with pytest.raises(PreprocessError, match="bytes outside its segments"):
        count_scans(data[:at] + b"junk" * 4_000_000 + data[at:])  # 16 MB that Pillow would skip byte by byte
    assert count_scans(data[:at] + b"\xff" * MAX_FILL + data[at:]) == 1  # a marker's own 0xFF after them
    with pytest.raises(PreprocessError, match="1025 fill bytes"):
        count_scans(data[:at] + b"\xff" * (MAX_FILL + 1) + data[at:])
