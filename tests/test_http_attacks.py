"""The HTTP API under attack, on a real socket: every attack in issue 13 gets a 4xx (or a 503
when it is about capacity) in the documented shape ``{"error": {"kind", "message"}}``, with
``Connection: close`` when the server closes, and the server keeps serving. Each test is named
after its attack; raw sockets where a client library would refuse to send the attack."""

from __future__ import annotations

import contextlib
import io
import json
import socket
import threading
import time
import urllib.request
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from device_agent.config import ApiSettings
from device_agent.http import guards, prometheus
from device_agent.http import server as http_server
from device_agent.http.bodies import MAX_JSON_DEPTH, ImageGate
from device_agent.http.server import ApiServer
from device_agent.runtime import InferenceService, load_model
from edgepack_core.artifact import extract_artifact
from edgepack_core.signing import TrustStore, load_public_key
from sdk.packager.pipeline import build
from sdk.recipe import load_recipe
from tests.artifacts import build_artifact
from tests.hostile_bodies import deep_json, npy_declaring, npy_header, npz_zip_bomb, png_pixel_bomb

OK_JSON = b'{"inputs": {"x": [[1, 2, 3, 4]]}}'


# ------------------------------------------------------------------------------------ servers


def image_model(path: Path) -> Path:
    """images [1, 3, 16, 16] -> mean [1, 3] per channel: an image model for the image attacks."""
    images = helper.make_tensor_value_info("images", TensorProto.FLOAT, [1, 3, 16, 16])
    mean = helper.make_tensor_value_info("mean", TensorProto.FLOAT, [1, 3])
    node = helper.make_node("ReduceMean", ["images"], ["mean"], axes=[2, 3], keepdims=0)
    model = helper.make_model(helper.make_graph([node], "img", [images], [mean]),
                              opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


@pytest.fixture(scope="module")
def scale_artifact(tmp_path_factory, keypair) -> Path:
    return build_artifact(tmp_path_factory.mktemp("scale"), keypair[0])


@pytest.fixture(scope="module")
def image_artifact(tmp_path_factory, keypair) -> Path:
    folder = tmp_path_factory.mktemp("image")
    image_model(folder / "img.onnx")
    (folder / "img.yaml").write_text("name: img\nversion: 1.0.0\nmodel: {path: img.onnx}\n"
                                     "preprocess: {kind: image, resize: {size: [16, 16]}, scale: 0.00392156862745098}\n"
                                     "postprocess: {kind: raw}\nvalidate: {data: synthetic}\n")
    return build(load_recipe(folder / "img.yaml"), key_paths=[str(keypair[0])], output=folder / "img.edgepkg").output


@pytest.fixture()
def serve(keypair, tmp_path) -> Iterator[Callable[..., tuple[int, InferenceService]]]:
    """Start an ApiServer on a free port for an artifact with some api settings; stopped after."""
    servers = []

    def start(artifact: Path, **settings) -> tuple[int, InferenceService]:
        verified = extract_artifact(artifact, tmp_path / f"m{len(servers)}", TrustStore([load_public_key(keypair[1])]))
        service = InferenceService(load_model(verified.root, verified.manifest))
        server = ApiServer(("127.0.0.1", 0), service, settings=ApiSettings(**settings)).start()
        servers.append(server)
        return server.port, service

    start.servers = servers  # type: ignore[attr-defined]
    yield start
    for server in servers:
        server.stop()


# ------------------------------------------------------------------------------------ raw HTTP


def request_bytes(method: str, path: str, body: bytes = b"", content_type: str = "application/json",
                  extra: str = "") -> bytes:
    return (f"{method} {path} HTTP/1.1\r\nHost: agent\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\n{extra}\r\n").encode() + body


_UNREAD: weakref.WeakKeyDictionary[socket.socket, bytes] = weakref.WeakKeyDictionary()


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 response from the socket: status, headers (lower-case names), body. Bytes
    past it (a pipelined next response) are kept for the next call."""
    data = _UNREAD.pop(sock, b"")
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed before a whole response head: {data!r}")
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        assert name.strip().lower() not in headers, f"header {name} twice in {head!r}"
        headers[name.strip().lower()] = value.strip()
    length = int(headers.get("content-length", "0"))
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("closed inside a response body")
        body += chunk
    _UNREAD[sock] = body[length:]
    return int(lines[0].split()[1]), headers, body[:length]


def closed_by_server(sock: socket.socket, within: float = 5.0) -> bool:
    """True when the server closed the connection (EOF) and sent nothing more."""
    sock.settimeout(within)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def exchange(port: int, data: bytes) -> tuple[int, dict[str, str], bytes]:
    with connect(port) as sock:
        sock.sendall(data)
        return read_response(sock)


def error_of(body: bytes) -> dict[str, str]:
    """The documented error shape, exactly: {"error": {"kind", "message"}}."""
    document = json.loads(body)
    assert set(document) == {"error"} and set(document["error"]) == {"kind", "message"}, document
    assert " at 0x" not in document["error"]["message"], document  # no Python object reprs
    return document["error"]


def still_serves(port: int) -> None:
    status, _, body = exchange(port, request_bytes("POST", "/predict", OK_JSON))
    assert status == 200 and json.loads(body)["outputs"]["y"] == [[2.0, 4.0, 6.0, 8.0]]


def npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def png(width: int, height: int) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (10, 200, 30)).save(buffer, format="PNG")
    return buffer.getvalue()


def metrics(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line and not line.startswith("#")}


# ------------------------------------------------------------------------------------ bodies


@pytest.fixture(scope="module")
def zip_bomb() -> bytes:
    return npz_zip_bomb()  # 1.77 MB inflating to 1.79 GB


def test_npz_zip_bomb_of_1_5_mb_is_refused_by_its_member_header_before_inflating(serve, scale_artifact, zip_bomb):
    port, _ = serve(scale_artifact)
    assert 1_500_000 < len(zip_bomb) < 2_000_000
    status, _, body = exchange(port, request_bytes("POST", "/predict", zip_bomb, "application/x-npz"))
    error = error_of(body)
    assert (status, error["kind"]) == (413, "too_large") and "1792000000" in error["message"]
    # The same member with garbage after its first inflated MiB: a server that inflated it would
    # fail on the garbage (400); the header alone refuses it.
    corrupt = npz_zip_bomb(corrupt_tail=True)
    status, _, body = exchange(port, request_bytes("POST", "/predict", corrupt, "application/x-npz"))
    assert (status, error_of(body)["kind"]) == (413, "too_large")
    still_serves(port)


def test_npz_member_exactly_at_max_decoded_bytes_inflates_and_one_row_more_is_413(serve, scale_artifact):
    port, _ = serve(scale_artifact, max_decoded_bytes=4096 * 16)
    status, _, body = exchange(port, request_bytes("POST", "/predict", npz_zip_bomb((4096, 4)), "application/x-npz"))
    assert status == 200 and np.asarray(json.loads(body)["outputs"]["y"]).shape == (4096, 4)
    status, _, body = exchange(port, request_bytes("POST", "/predict", npz_zip_bomb((4097, 4)), "application/x-npz"))
    assert (status, error_of(body)["kind"]) == (413, "too_large")


def test_npz_with_more_members_than_the_model_has_inputs_is_refused_unread(serve, scale_artifact):
    port, _ = serve(scale_artifact)
    buffer = io.BytesIO()
    np.savez(buffer, x=np.ones((1, 4), np.float32), extra=np.ones((1, 4), np.float32))
    status, _, body = exchange(port, request_bytes("POST", "/predict", buffer.getvalue(), "application/x-npz"))
    error = error_of(body)
    assert status == 400 and error["kind"] == "bad_input" and "holds 2 arrays" in error["message"]
    buffer = io.BytesIO()
    np.savez(buffer, waveform=np.ones((1, 4), np.float32))
    status, _, body = exchange(port, request_bytes("POST", "/predict", buffer.getvalue(), "application/x-npz"))
    assert (status, error_of(body)["kind"]) == (400, "unknown_input")


def test_npy_declaring_shape_2_to_the_40_is_a_4xx_not_a_memory_error(serve, scale_artifact):
    port, _ = serve(scale_artifact)
    cases = [(npy_declaring((2**40,)), 400, "shape"),  # rank 1 for an input of [batch, 4]
             (npy_declaring((2**38, 4)), 413, "too_large"),  # 4 TiB declared
             (npy_declaring((3, 4), data=bytes(8)), 400, "bad_input"),  # declares 48 bytes, carries 8
             (npy_declaring((1, 4), descr="|O"), 400, "bad_input"),  # a pickle: never loaded
             (npy_declaring((1, 4), descr="<i8", data=bytes(32)), 400, "dtype")]
    for data, status, kind in cases:
        got, _, body = exchange(port, request_bytes("POST", "/predict", data, "application/x-npy"))
        assert (got, error_of(body)["kind"]) == (status, kind), data[:80]
    status, _, body = exchange(port, request_bytes("POST", "/predict", npy(np.ones((2, 4), np.float32)),
                                                   "application/x-npy"))
    assert status == 200 and json.loads(body)["outputs"]["y"] == [[2.0] * 4] * 2


def test_npy_in_fortran_order_is_read_right(serve, scale_artifact):
    port, _ = serve(scale_artifact)
    x = np.asfortranarray(np.arange(8, dtype=np.float32).reshape(2, 4))
    status, _, body = exchange(port, request_bytes("POST", "/predict", npy(x), "application/x-npy"))
    assert status == 200 and json.loads(body)["outputs"]["y"] == (x * 2).tolist()
    assert npy_header((2, 4), fortran=True) == npy(x)[:len(npy_header((2, 4), fortran=True))]


def test_png_of_7000x7000_pixels_is_refused_by_its_header_even_four_at_once(serve, image_artifact):
    port, _ = serve(image_artifact)
    bomb = png_pixel_bomb()
    assert len(bomb) < 50_000
    answers: list[tuple[int, bytes]] = []

    def send() -> None:
        status, _, body = exchange(port, request_bytes("POST", "/predict", bomb, "image/png"))
        answers.append((status, body))

    threads = [threading.Thread(target=send) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert [(status, error_of(body)["kind"]) for status, body in answers] == [(413, "image_too_large")] * 4
    status, _, body = exchange(port, request_bytes("POST", "/predict", png(40, 30), "image/png"))
    assert status == 200 and len(json.loads(body)["outputs"]["mean"][0]) == 3


def test_image_pixel_cap_holds_at_the_limit_and_refuses_one_pixel_more(serve, image_artifact):
    port, _ = serve(image_artifact, max_image_pixels=64 * 48)
    status, _, _ = exchange(port, request_bytes("POST", "/predict", png(64, 48), "image/png"))
    assert status == 200
    status, _, body = exchange(port, request_bytes("POST", "/predict", png(64 * 48 + 1, 1), "image/png"))
    error = error_of(body)
    assert (status, error["kind"]) == (413, "image_too_large") and "3073" in error["message"]
    # a raw uint8 camera frame as .npy is held to the same cap before it is read
    status, _, body = exchange(port, request_bytes("POST", "/predict", npy(np.zeros((48, 65, 3), np.uint8)),
                                                   "application/x-npy"))
    assert (status, error_of(body)["kind"]) == (413, "image_too_large")
    status, _, _ = exchange(port, request_bytes("POST", "/predict", npy(np.zeros((48, 64, 3), np.uint8)),
                                                "application/x-npy"))
    assert status == 200


def test_image_decodes_at_once_wait_for_the_gate():
    gate = ImageGate(max_pixels=100, concurrent=1)
    inside, release, second_in = threading.Event(), threading.Event(), threading.Event()

    def first() -> None:
        with gate.slot():
            inside.set()
            release.wait(10)

    def second() -> None:
        with gate.slot():
            second_in.set()

    holder = threading.Thread(target=first)
    holder.start()
    assert inside.wait(10)
    waiter = threading.Thread(target=second)
    waiter.start()
    assert not second_in.wait(0.3)  # the one slot is taken: the second decode waits
    release.set()
    assert second_in.wait(10)
    holder.join(10)
    waiter.join(10)


def test_wrong_content_type_on_an_image_model_is_415_and_no_python_repr_leaks(serve, image_artifact):
    port, _ = serve(image_artifact)
    status, _, body = exchange(port, request_bytes("POST", "/predict", b"hello", "text/plain"))
    error = error_of(body)
    assert (status, error["kind"]) == (415, "unsupported_media") and "image/*" in error["message"]
    status, _, body = exchange(port, request_bytes("POST", "/predict", b"\x89PNG not really", "image/png"))
    error = error_of(body)
    assert (status, error["kind"]) == (400, "bad_image") and "BytesIO" not in error["message"]
    status, _, body = exchange(port, request_bytes("POST", "/predict", b"%!PS-Adobe-3.0 EPSF-3.0\n", "image/eps"))
    assert (status, error_of(body)["kind"]) == (400, "bad_image")  # a format Pillow knows, refused unread


def test_deeply_nested_json_is_a_400_never_a_recursion_error(serve, scale_artifact):
    port, _ = serve(scale_artifact)
    for depth in (50_000, MAX_JSON_DEPTH + 1):
        status, _, body = exchange(port, request_bytes("POST", "/predict", deep_json(depth)))
        error = error_of(body)
        assert (status, error["kind"]) == (400, "bad_json") and "nested" in error["message"], depth
    status, _, body = exchange(port, request_bytes("POST", "/predict", deep_json(MAX_JSON_DEPTH)))
    assert status == 400 and error_of(body)["kind"] != "bad_json"  # parsed: refused for its shape
    still_serves(port)


def test_json_body_over_max_json_bytes_is_413_and_at_the_limit_is_parsed(serve, scale_artifact):
    port, _ = serve(scale_artifact, max_json_bytes=len(OK_JSON))
    status, _, _ = exchange(port, request_bytes("POST", "/predict", OK_JSON))
    assert status == 200
    status, _, body = exchange(port, request_bytes("POST", "/predict", OK_JSON + b" "))
    assert (status, error_of(body)["kind"]) == (413, "too_large")


def test_non_finite_json_inputs_are_a_400(serve, scale_artifact):
    port, _ = serve(scale_artifact)
    for body in (b'{"inputs": {"x": [[NaN, 1, 2, 3]]}}', b'{"inputs": {"x": [["Infinity", 1, 2, 3]]}}',
                 b'{"inputs": {"x": [[1e999, 1, 2, 3]]}}'):
        status, _, answer = exchange(port, request_bytes("POST", "/predict", body))
        assert (status, error_of(answer)["kind"]) == (400, "non_finite_input"), body


# ------------------------------------------------------------------------------------ connections


def test_client_declaring_content_length_1000_and_sending_nothing_gets_408_and_close(serve, scale_artifact):
    port, _ = serve(scale_artifact, read_timeout_s=0.5)
    with connect(port) as sock:
        started = time.monotonic()
        sock.sendall(b"POST /predict HTTP/1.1\r\nHost: agent\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n")
        status, headers, body = read_response(sock)
        waited = time.monotonic() - started
        assert (status, error_of(body)["kind"]) == (408, "timeout") and headers["connection"] == "close"
        assert 0.5 <= waited < 5
        assert closed_by_server(sock)
    still_serves(port)


def test_slowloris_head_that_never_ends_gets_408_and_close(serve, scale_artifact):
    port, _ = serve(scale_artifact, read_timeout_s=0.5)
    with connect(port) as sock:
        sock.sendall(b"POST /predict HTTP/1.1\r\nHost: agent\r\nX-Slow: ")
        status, headers, body = read_response(sock)
        assert (status, error_of(body)["kind"]) == (408, "timeout") and headers["connection"] == "close"
        assert closed_by_server(sock)


def test_idle_connection_that_sends_nothing_is_closed_without_an_answer(serve, scale_artifact):
    port, _ = serve(scale_artifact, read_timeout_s=0.5)
    with connect(port) as sock:
        assert closed_by_server(sock)  # EOF, no bytes


def test_connections_over_max_connections_get_503_and_close_unless_they_are_health_checks(serve, scale_artifact):
    port, _ = serve(scale_artifact, max_connections=2, read_timeout_s=10)
    held = [connect(port), connect(port)]
    try:
        for sock in held:  # both are served, then each has a request in progress: its body is late
            sock.sendall(request_bytes("GET", "/healthz"))
            assert read_response(sock)[0] == 200
            sock.sendall(request_bytes("POST", "/predict", b"x" * 10)[:-10])
        with connect(port) as third:
            third.sendall(request_bytes("POST", "/predict", OK_JSON))
            status, headers, body = read_response(third)
            assert (status, error_of(body)["kind"]) == (503, "busy") and headers["connection"] == "close"
            assert closed_by_server(third)
        with connect(port) as health:  # the health checks' own slots
            health.sendall(request_bytes("GET", "/healthz"))
            status, headers, _ = read_response(health)
            assert (status, headers["connection"]) == (200, "close") and closed_by_server(health)
    finally:
        for sock in held:
            sock.close()
    for _ in range(50):  # the server sees the two close; then a new connection is served
        try:
            if exchange(port, request_bytes("GET", "/healthz"))[0] == 200:
                break
        except ConnectionError:
            pass
        time.sleep(0.1)
    else:
        pytest.fail("no connection served after the held ones closed")


def test_idle_kept_alive_connections_holding_every_slot_are_dropped_for_a_new_one(serve, scale_artifact):
    port, _ = serve(scale_artifact, max_connections=2)
    held = [connect(port), connect(port)]
    try:
        for sock in held:  # both served, then idle: kept alive, waiting for a next head
            sock.sendall(request_bytes("GET", "/healthz"))
            assert read_response(sock)[0] == 200
        deadline = time.monotonic() + 10
        while (status := exchange(port, request_bytes("POST", "/predict", OK_JSON))[0]) != 200:
            assert status == 503 and time.monotonic() < deadline  # until the idle ones may be evicted
            time.sleep(0.05)
        assert closed_by_server(held[0], within=1)  # the one idle longest went first
    finally:
        for sock in held:
            sock.close()


def test_requests_beyond_workers_and_queue_get_503_busy(serve, scale_artifact):
    port, _ = serve(scale_artifact, workers=1, max_queue=0, read_timeout_s=2)
    with connect(port) as holder:  # holds the one slot: its body never comes
        holder.sendall(b"POST /predict HTTP/1.1\r\nHost: agent\r\nContent-Type: application/json\r\n"
                       b"Content-Length: 10\r\n\r\n")
        deadline = time.monotonic() + 10
        while True:  # wait until the held request is admitted (the server answers busy)
            status, headers, body = exchange(port, request_bytes("POST", "/predict", OK_JSON))
            if status == 503 or time.monotonic() > deadline:
                break
        assert (status, error_of(body)["kind"]) == (503, "busy") and headers["retry-after"] == "1"
        assert read_response(holder)[0] == 408
    still_serves(port)


def test_content_length_of_5000_digits_is_a_400_in_json_not_a_dropped_connection(serve, scale_artifact):
    port, _ = serve(scale_artifact)
    with connect(port) as sock:
        sock.sendall(b"POST /predict HTTP/1.1\r\nHost: agent\r\nContent-Length: " + b"9" * 5000 + b"\r\n\r\n")
        status, headers, body = read_response(sock)
        assert (status, error_of(body)["kind"]) == (400, "bad_http") and headers["connection"] == "close"
        assert closed_by_server(sock)
    still_serves(port)


def test_post_to_an_unknown_path_never_smuggles_its_body_as_the_next_request(serve, scale_artifact):
    port, _ = serve(scale_artifact)
    smuggled = b"DELETE /streams/x HTTP/1.1\r\nHost: agent\r\nContent-Length: 0\r\n\r\n"
    with connect(port) as sock:
        sock.sendall(request_bytes("POST", "/nope", smuggled, "text/plain") + request_bytes("GET", "/healthz"))
        status, _, body = read_response(sock)
        assert (status, error_of(body)["kind"]) == (404, "not_found")
        status, _, body = read_response(sock)  # the next answer is the next request's, /healthz
        assert status == 200 and json.loads(body)["status"] == "ok"


def test_large_unread_body_is_answered_with_connection_close_and_the_connection_closes(serve, scale_artifact):
    port, _ = serve(scale_artifact, max_body_bytes=4096)
    with connect(port) as sock:  # a body over the limit, refused unread while it is still being sent
        sock.sendall(request_bytes("POST", "/predict", b"x" * 200_000, "application/octet-stream"))
        status, headers, body = read_response(sock)
        assert (status, error_of(body)["kind"]) == (413, "too_large") and headers["connection"] == "close"
        assert closed_by_server(sock)
    with connect(port) as sock:  # a 100 kB body to an unknown path: not worth draining
        sock.sendall(request_bytes("POST", "/nope", b"x" * 100_000, "text/plain"))
        status, headers, body = read_response(sock)
        assert status == 404 and headers["connection"] == "close" and closed_by_server(sock)


def test_many_closing_clients_with_large_bodies_never_exhaust_the_connections(serve, scale_artifact, monkeypatch):
    """A closing connection lingers to drop what its client still sends, but leaves as soon as
    the client closes: even after a body larger than the server reads at once (64 kB)."""
    monkeypatch.setattr(http_server, "LINGER_S", 60.0)  # only the client's FIN can free them in time
    port, _ = serve(scale_artifact, max_connections=3)
    body = deep_json(100_000)  # 200 kB: over the 64 kB the server reads at once
    for _ in range(3):
        status, headers, _ = exchange(port, request_bytes("POST", "/predict", body, extra="Connection: close\r\n"))
        assert status == 400 and headers["connection"] == "close"
    server = next(iter(serve.servers))
    deadline = time.monotonic() + 10
    while server.connections() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.connections() == []
    assert exchange(port, request_bytes("POST", "/predict", OK_JSON))[0] == 200


def test_chunked_body_over_the_limit_is_413_and_closes(serve, scale_artifact):
    port, _ = serve(scale_artifact, max_body_bytes=4096)
    with connect(port) as sock:
        sock.sendall(b"POST /predict HTTP/1.1\r\nHost: agent\r\nContent-Type: application/json\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n" + b"1000\r\n" + b" " * 4096 + b"\r\n" + b"1\r\n \r\n")
        status, headers, body = read_response(sock)
        assert (status, error_of(body)["kind"]) == (413, "too_large") and headers["connection"] == "close"


# ------------------------------------------------------------------------------------ methods, paths


@pytest.mark.parametrize("method", ["PUT", "DELETE", "OPTIONS", "PATCH", "GET"])
def test_wrong_method_on_predict_is_405_with_allow_in_json(serve, scale_artifact, method):
    port, _ = serve(scale_artifact)
    status, headers, body = exchange(port, request_bytes(method, "/predict"))
    error = error_of(body)
    assert (status, error["kind"], headers["allow"]) == (405, "method_not_allowed", "POST")


def test_unknown_path_and_method_get_404_in_json(serve, scale_artifact):
    port, _ = serve(scale_artifact)
    for method in ("PUT", "OPTIONS", "BREW"):
        status, _, body = exchange(port, request_bytes(method, "/coffee"))
        assert (status, error_of(body)["kind"]) == (404, "not_found")


def test_query_strings_are_ignored_where_meaningless_and_refused_where_they_mean_something(serve, scale_artifact):
    port, _ = serve(scale_artifact)
    for path in ("/healthz?x=1", "/metrics?x=1", "/v2/health/live?probe", "/v2/models/scale?verbose=1"):
        assert exchange(port, request_bytes("GET", path))[0] == 200, path
    status, _, body = exchange(port, request_bytes("POST", "/predict?x=1", OK_JSON))
    assert (status, error_of(body)["kind"]) == (400, "bad_query")


def test_every_rejection_is_counted_in_metrics_by_status_class(serve, scale_artifact):
    port, _ = serve(scale_artifact, max_body_bytes=4096)
    before = metrics(port)
    bad = [b"{nope", b'{"inputs": {"waveform": [[1, 2, 3, 4]]}}', b'{"inputs": {"x": [[1, 2]]}}',
           b'{"inputs": {"x": [["a", "b", "c", "d"]]}}']
    assert [exchange(port, request_bytes("POST", "/predict", b))[0] for b in bad] == [400] * 4
    assert exchange(port, request_bytes("POST", "/nope"))[0] == 404
    assert exchange(port, request_bytes("PUT", "/predict"))[0] == 405
    assert exchange(port, request_bytes("POST", "/predict", b"x" * 5000))[0] == 413
    assert exchange(port, b"GET / HTTP/1.1\r\nContent-Length: nine\r\n\r\n")[0] == 400
    assert exchange(port, request_bytes("POST", "/predict", OK_JSON))[0] == 200
    after = metrics(port)

    def rose(name: str) -> float:
        return after.get(name, 0) - before.get(name, 0)

    assert rose('edgepack_requests_total{status="client_error"}') == 5  # four 400s and the 413 on /predict
    assert rose('edgepack_requests_total{status="ok"}') == 1
    assert rose('edgepack_errors_total{kind="bad_json"}') == 1 and rose('edgepack_errors_total{kind="shape"}') == 1
    assert rose('edgepack_errors_total{kind="unknown_input"}') == 1
    assert rose('edgepack_errors_total{kind="bad_input"}') == 1  # "a" is no float32: malformed, no contract break
    assert rose('edgepack_errors_total{kind="too_large"}') == 1
    # every answer by class: the eight refusals; the 200, and the first /metrics read, as 2xx
    assert rose('edgepack_http_responses_total{class="4xx"}') == 8
    assert rose('edgepack_http_responses_total{class="2xx"}') == 2


# ------------------------------------------------------------------------------------ the server layer
# What device_agent/http/server.py and protocol.py add to h11: HTTP/1.1 only, the head deadline on
# kept-alive connections, JSON answers for oversized heads, no hang on an unread body, a prompt stop.


def test_h2c_upgrade_is_answered_in_http_1_1_without_switching(serve, scale_artifact):
    port, _ = serve(scale_artifact)
    with connect(port) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: agent\r\nConnection: Upgrade, HTTP2-Settings\r\n"
                     b"Upgrade: h2c\r\nHTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n\r\n")
        status, _, body = read_response(sock)  # no 101 first: read_response would return it
        assert status == 200 and json.loads(body)["status"] == "ok"
        sock.sendall(request_bytes("GET", "/healthz"))  # still HTTP/1.1 on the same connection
        assert read_response(sock)[0] == 200


def test_http2_prior_knowledge_preface_never_switches_the_connection_to_http2(serve, scale_artifact):
    port, _ = serve(scale_artifact)
    with connect(port) as sock:
        sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes.fromhex("000000040000000000"))  # preface + SETTINGS
        sock.settimeout(5)
        answer = sock.recv(65536)
    assert answer.startswith(b"HTTP/1.1 4"), answer[:100]  # an HTTP/1.1 refusal, never an HTTP/2 SETTINGS frame


def test_websocket_handshake_is_answered_as_a_plain_get(serve, scale_artifact):
    port, _ = serve(scale_artifact)
    with connect(port) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: agent\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
                     b"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n")
        status, headers, body = read_response(sock)
        assert status == 200 and "sec-websocket-accept" not in headers and json.loads(body)["status"] == "ok"
        sock.sendall(request_bytes("GET", "/healthz"))
        assert read_response(sock)[0] == 200


def test_answers_carry_their_reason_phrase(serve, scale_artifact):
    port, _ = serve(scale_artifact)
    with connect(port) as sock:
        sock.sendall(request_bytes("GET", "/nope"))
        sock.settimeout(5)
        assert sock.recv(65536).startswith(b"HTTP/1.1 404 Not Found\r\n")
        sock.sendall(request_bytes("POST", "/predict", extra="Expect: 100-continue\r\n").replace(
            b"Content-Length: 0", f"Content-Length: {len(OK_JSON)}".encode()))
        assert sock.recv(65536).startswith(b"HTTP/1.1 100 Continue\r\n")


@contextlib.contextmanager
def kept_alive(port: int) -> Iterator[socket.socket]:
    """A connection that has had one answer and stays open."""
    with connect(port) as sock:
        sock.sendall(request_bytes("GET", "/healthz"))
        assert read_response(sock)[0] == 200
        yield sock


def test_expect_100_continue_gets_100_at_once_then_the_refusal_of_a_declared_length_over_the_limit(
        serve, scale_artifact):
    port, _ = serve(scale_artifact, max_body_bytes=len(OK_JSON))
    head = b"POST /predict HTTP/1.1\r\nHost: agent\r\nContent-Type: application/json\r\nExpect: 100-continue\r\n"
    with connect(port) as sock:  # one byte over: 100 (as soon as the head is read), then 413
        sock.sendall(head + b"Content-Length: %d\r\n\r\n" % (len(OK_JSON) + 1))
        assert read_response(sock)[0] == 100
        status, headers, body = read_response(sock)
        assert (status, error_of(body)["kind"]) == (413, "too_large") and headers["connection"] == "close"
    with connect(port) as sock:  # at the limit: 100, then the body is read and answered
        sock.sendall(head + b"Content-Length: %d\r\n\r\n" % len(OK_JSON))
        assert read_response(sock)[0] == 100
        sock.sendall(OK_JSON)
        status, _, body = read_response(sock)
        assert status == 200 and json.loads(body)["outputs"]["y"] == [[2.0, 4.0, 6.0, 8.0]]


def test_kept_alive_connection_idle_past_keep_alive_s_is_closed_without_an_answer(serve, scale_artifact):
    port, _ = serve(scale_artifact, read_timeout_s=30, keep_alive_s=0.5)
    with kept_alive(port) as sock:
        started = time.monotonic()
        assert closed_by_server(sock, within=10)  # EOF, no bytes: long before read_timeout_s
        assert 0.4 <= time.monotonic() - started < 10


def test_kept_alive_connection_trickling_its_next_head_gets_408_at_read_timeout_s(serve, scale_artifact):
    port, _ = serve(scale_artifact, read_timeout_s=1.5, keep_alive_s=0.3)
    with kept_alive(port) as sock:
        answered = time.monotonic()
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: ")  # begun before keep_alive_s, never finished
        assert not closed_by_server(sock, within=0.6)  # past keep_alive_s: a head has begun, it may finish
        sock.settimeout(10)
        status, headers, body = read_response(sock)
        assert (status, error_of(body)["kind"]) == (408, "timeout") and headers["connection"] == "close"
        assert 1.4 <= time.monotonic() - answered < 10
        assert closed_by_server(sock)


def test_head_over_16_kib_is_a_400_whole_or_unfinished_and_one_of_16_kib_is_served(serve, scale_artifact):
    port, _ = serve(scale_artifact, read_timeout_s=30)

    def head(size: int) -> bytes:
        pad = size - len(request_bytes("GET", "/healthz", extra="X-Pad: \r\n"))
        return request_bytes("GET", "/healthz", extra=f"X-Pad: {'a' * pad}\r\n")

    assert len(head(16 * 1024)) == 16 * 1024 and exchange(port, head(16 * 1024))[0] == 200
    status, headers, body = exchange(port, head(16 * 1024 + 1))  # whole, in one read
    assert (status, error_of(body)["kind"]) == (400, "bad_http") and headers["connection"] == "close"
    with connect(port) as sock:
        started = time.monotonic()
        sock.sendall(head(17_000)[:-4])  # no end of head
        status, headers, body = read_response(sock)
        assert (status, error_of(body)["kind"]) == (400, "bad_http") and headers["connection"] == "close"
        assert time.monotonic() - started < 10  # at once, not after the 30 s read timeout
        assert closed_by_server(sock)


def test_small_body_sent_late_to_an_unknown_path_is_dropped_before_the_answer_and_the_connection_kept(
        serve, scale_artifact):
    port, _ = serve(scale_artifact)
    with connect(port) as sock:
        body = b"x" * guards.DRAIN_LIMIT  # at the limit: still read and dropped
        sock.sendall(request_bytes("POST", "/nope", b"", "text/plain").replace(b"Content-Length: 0",
                                                                               f"Content-Length: {len(body)}".encode()))
        sock.settimeout(0.3)
        with pytest.raises(TimeoutError):  # no answer while the body is on its way
            sock.recv(1)
        sock.sendall(body + request_bytes("GET", "/healthz"))
        status, headers, _ = read_response(sock)
        assert status == 404 and "connection" not in headers
        status, _, answer = read_response(sock)  # the next request's answer: nothing of the body was parsed
        assert status == 200 and json.loads(answer)["status"] == "ok"


def test_small_body_never_sent_to_an_unknown_path_gets_the_answer_with_close_at_read_timeout_s(serve, scale_artifact):
    port, _ = serve(scale_artifact, read_timeout_s=0.5)
    with connect(port) as sock:
        started = time.monotonic()
        sock.sendall(b"POST /nope HTTP/1.1\r\nHost: agent\r\nContent-Length: 10\r\n\r\n")
        status, headers, _ = read_response(sock)
        assert status == 404 and headers["connection"] == "close" and 0.5 <= time.monotonic() - started < 10
        assert closed_by_server(sock)
    # one byte over DRAIN_LIMIT is not waited for: the answer comes at once, with close
    with connect(port) as sock:
        started = time.monotonic()
        sock.sendall(f"POST /nope HTTP/1.1\r\nHost: agent\r\nContent-Length: {guards.DRAIN_LIMIT + 1}\r\n\r\n"
                     .encode())
        status, headers, _ = read_response(sock)
        assert status == 404 and headers["connection"] == "close" and time.monotonic() - started < 0.5


def test_app_answering_late_without_reading_a_large_body_never_hangs_the_connection():
    """A body the app never reads fills the request's queue (a few chunks): the server must
    neither wait for room in it to end the request nor hang the connection."""
    import asyncio

    from device_agent.http.web import Route, Router, json_error

    async def late(request):  # answers after the body filled the queue, never reading it
        await asyncio.sleep(0.5)
        return json_error(409, "late", "late")

    settings = ApiSettings(read_timeout_s=10)
    stats = prometheus.HttpStats()
    app = guards.Guard(Router([Route("/late", late, methods=["POST"])]), stats, settings.read_timeout_s)
    sock = http_server.listening_socket(("127.0.0.1", 0), 8)
    server = http_server.HttpServer(app, sock, settings, stats.count)
    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    assert server.ready.wait(10)
    try:
        with connect(sock.getsockname()[1]) as client:
            body = b"x" * 4_000_000
            client.sendall(b"POST /late HTTP/1.1\r\nHost: agent\r\nContent-Length: %d\r\n\r\n" % len(body))
            def send_body() -> None:
                with contextlib.suppress(OSError):  # the server closes before the whole body is in
                    client.sendall(body)

            sender = threading.Thread(target=send_body, daemon=True)
            sender.start()
            status, headers, _ = read_response(client)
            assert status == 409 and headers["connection"] == "close"
            assert closed_by_server(client)
        deadline = time.monotonic() + 10
        while server.connections and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not server.connections and stats.snapshot()["4xx"] == 1
    finally:
        server.stop()
        thread.join(10)
        sock.close()


@contextlib.contextmanager
def app_server(app) -> Iterator[tuple[int, prometheus.HttpStats]]:
    """``app`` (ASGI-shaped) behind the guard on the agent's HTTP server, on a free port."""
    settings = ApiSettings(read_timeout_s=30)
    stats = prometheus.HttpStats()
    sock = http_server.listening_socket(("127.0.0.1", 0), 8)
    server = http_server.HttpServer(guards.Guard(app, stats, settings.read_timeout_s), sock, settings, stats.count)
    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    assert server.ready.wait(10)
    try:
        yield sock.getsockname()[1], stats
    finally:
        server.stop()
        thread.join(10)
        sock.close()


def test_a_body_the_app_reads_slowly_waits_in_the_client_never_queued_whole_in_the_server():
    """Back pressure: while the app reads nothing, the server stops reading (a few chunks wait
    for the app), so a 64 MiB body stalls in its sender; once the app reads, all of it arrives."""
    import asyncio

    from device_agent.http.web import Response, Route, Router

    release = threading.Event()

    async def slow(request):
        chunk, more = await request.chunk()
        total = len(chunk)
        await asyncio.get_running_loop().run_in_executor(None, release.wait, 60)
        while more:
            chunk, more = await request.chunk()
            total += len(chunk)
        return Response(str(total).encode())

    body = b"x" * (64 << 20)
    with app_server(Router([Route("/slow", slow, ["POST"])])) as (port, _), connect(port) as client:
        client.sendall(b"POST /slow HTTP/1.1\r\nHost: agent\r\nContent-Length: %d\r\n\r\n" % len(body))
        client.settimeout(2)
        sent = 0
        with pytest.raises(TimeoutError):  # the server stopped reading: the sender stalls
            while sent < len(body):
                sent += client.send(body[sent:sent + (1 << 20)])
        assert sent < 32 << 20  # what the kernel and a few chunks hold, far from the whole body
        release.set()
        client.settimeout(30)
        client.sendall(body[sent:])
        status, _, answer = read_response(client)
        assert status == 200 and int(answer) == len(body)


def test_an_app_that_returns_without_an_answer_gets_a_500_in_json_and_the_connection_closes():
    async def silent(scope, receive, send):  # ASGI, and never sends
        return None

    with app_server(silent) as (port, stats), connect(port) as sock:
        sock.sendall(request_bytes("GET", "/anything"))
        status, headers, body = read_response(sock)
        assert (status, error_of(body)["kind"], headers["connection"]) == (500, "internal", "close")
        assert closed_by_server(sock) and stats.snapshot()["5xx"] == 1


def test_stopping_the_server_ends_a_lingering_connection_at_once(serve, scale_artifact, monkeypatch):
    monkeypatch.setattr(http_server, "LINGER_S", 60.0)
    port, _ = serve(scale_artifact, max_body_bytes=4096)
    server = serve.servers[0]
    with connect(port) as sock:  # refused unread; the client keeps its side open: the server lingers
        sock.sendall(request_bytes("POST", "/predict", b"x" * 5000, "application/octet-stream"))
        assert read_response(sock)[0] == 413
        deadline = time.monotonic() + 10
        while not any(c.closing for c in server.connections()) and time.monotonic() < deadline:
            time.sleep(0.02)
        started = time.monotonic()
        server.stop()
        assert time.monotonic() - started < 3 and closed_by_server(sock, within=1)
