"""The HTTP API under attack, on a real socket: every attack in issue 13 gets a 4xx (or a 503
when it is about capacity) in the documented shape ``{"error": {"kind", "message"}}``, with
``Connection: close`` when the server closes, and the server keeps serving. Each test is named
after its attack; raw sockets where a client library would refuse to send the attack."""

from __future__ import annotations

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

from device_agent import http_api
from device_agent.bodies import MAX_JSON_DEPTH, ImageGate
from device_agent.config import ApiSettings
from device_agent.http_api import ApiServer
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


def test_connections_over_max_connections_get_503_and_close(serve, scale_artifact):
    port, _ = serve(scale_artifact, max_connections=2)
    held = [connect(port), connect(port)]
    try:
        for sock in held:  # both are served (and kept alive)
            sock.sendall(request_bytes("GET", "/healthz"))
            assert read_response(sock)[0] == 200
        with connect(port) as third:
            third.sendall(request_bytes("GET", "/healthz"))
            status, headers, body = read_response(third)
            assert (status, error_of(body)["kind"]) == (503, "busy") and headers["connection"] == "close"
            assert closed_by_server(third)
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
    the client closes: even after a body large enough for uvicorn to pause reading."""
    monkeypatch.setattr(http_api, "LINGER_S", 60.0)  # only the client's FIN can free them in time
    port, _ = serve(scale_artifact, max_connections=3)
    body = deep_json(100_000)  # 200 kB: over uvicorn's 64 kB read pause
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
