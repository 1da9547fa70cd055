"""The agent's HTTP/1.1 connection logic without sockets (device_agent/http/protocol.py) and its
router (device_agent/http/web.py): each rule at its boundary. The same rules on real sockets are
in tests/test_http_attacks.py."""

from __future__ import annotations

import asyncio
import json

from device_agent.http import protocol
from device_agent.http.protocol import END, MAX_HEAD_BYTES, MAX_REQUESTS, NEED_DATA, PAUSED, Head, Refusal, Session
from device_agent.http.web import Request, Response, Route, Router


def head(target: str = "/healthz", method: str = "GET", extra: str = "", size: int | None = None) -> bytes:
    data = f"{method} {target} HTTP/1.1\r\nHost: agent\r\n{extra}\r\n".encode()
    if size is not None:  # padded with one header to exactly ``size`` bytes
        data = f"{method} {target} HTTP/1.1\r\nHost: agent\r\n{extra}X-Pad: \r\n\r\n".encode()
        data = data.replace(b"X-Pad: ", b"X-Pad: " + b"a" * (size - len(data)))
    return data


def answer(session: Session, status: int = 200, body: bytes = b"{}") -> bytes:
    session.start(status, [(b"content-length", str(len(body)).encode())])
    return session.body(body, more=False)


def serve_one(session: Session, data: bytes) -> Head:
    session.receive(data)
    event = session.next_event()
    assert isinstance(event, Head), event
    assert session.next_event() is END
    return event


def test_a_connection_keeps_alive_for_999_answers_and_says_close_on_the_1000th():
    session = Session()
    for number in range(1, MAX_REQUESTS + 1):
        serve_one(session, head())
        written = answer(session)
        closes = b"connection: close" in written.lower()
        assert closes is (number == MAX_REQUESTS), number
        assert session.recycle() is not closes


def test_a_whole_head_of_max_head_bytes_is_served_and_one_byte_more_is_400_bad_http():
    assert isinstance(serve_one(Session(), head(size=MAX_HEAD_BYTES)), Head)
    session = Session()
    session.receive(head(size=MAX_HEAD_BYTES + 1))
    assert session.next_event() == Refusal(400, "bad_http", "malformed HTTP request (request line, headers or framing)")
    assert session.next_event() is NEED_DATA  # refused: nothing more is parsed


def test_bad_framing_is_a_refusal_400_bad_http():
    session = Session()
    session.receive(b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: nine\r\n\r\n")
    event = session.next_event()
    assert isinstance(event, Refusal) and (event.status, event.kind) == (400, "bad_http")


def test_an_upgrade_header_is_dropped_and_the_answer_is_http_1_1():
    session = Session()
    request = serve_one(session, head(extra="Connection: Upgrade\r\nUpgrade: websocket\r\n"))
    assert all(name != b"upgrade" for name, _ in request.headers)
    assert answer(session).startswith(b"HTTP/1.1 200 OK\r\n")


def test_a_head_answer_carries_the_length_and_no_body():
    session = Session()
    serve_one(session, head(method="HEAD"))
    written = answer(session, body=b'{"status": "ok"}')
    assert written.endswith(b"\r\n\r\n") and b"content-length: 16" in written.lower()


def test_a_health_slot_serves_a_health_route_with_close_and_refuses_anything_else_with_503():
    session = Session(reserve=True)
    serve_one(session, head("/metrics"))
    assert b"connection: close" in answer(session).lower() and not session.recycle()
    refused = Session(reserve=True)
    refused.receive(head("/predict", method="POST", extra="Content-Length: 0\r\n"))
    event = refused.next_event()
    assert isinstance(event, Refusal) and (event.status, event.kind) == (503, "busy")


def test_a_pipelined_request_waits_until_the_answer_is_out():
    session = Session()
    session.receive(head("/a") + head("/b"))
    assert isinstance(session.next_event(), Head) and session.next_event() is END
    assert session.next_event() is PAUSED
    answer(session)
    assert session.recycle()
    event = session.next_event()
    assert isinstance(event, Head) and event.target == b"/b"


def test_http_date_is_rfc_9110_imf_fixdate():
    from email.utils import formatdate

    for second in (0, 951_782_400, 1_764_403_199):  # the epoch, 29 Feb 2000, a Saturday night
        assert protocol.http_date(second) == formatdate(second, usegmt=True)


def test_the_head_waits_for_the_body_and_leaves_with_it_in_one_write():
    session = Session()
    serve_one(session, head())
    session.start(200, [(b"content-length", b"2")])
    written = session.body(b"{}", more=False)
    assert written.startswith(b"HTTP/1.1 200 OK\r\n") and written.endswith(b"\r\n\r\n{}")
    assert b"\r\ndate: " in written.lower()
    assert protocol.error_bytes(503, "busy", "x").startswith(b"HTTP/1.1 503 Service Unavailable\r\n")


# ------------------------------------------------------------------------------------ the router


async def _ok(request: Request) -> Response:
    return Response(json.dumps(request.path_params).encode(), 200, media_type="application/json")


def call(router: Router, method: str, path: str) -> tuple[int, dict[bytes, bytes], bytes]:
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "method": method, "path": path, "query_string": b"", "headers": [], "client": None}
    asyncio.run(router(scope, receive, send))
    return sent[0]["status"], dict(sent[0]["headers"]), sent[1]["body"]


def test_router_matches_one_segment_per_parameter_and_answers_404_and_405_in_the_error_shape():
    router = Router([Route("/models/{name}", _ok, ["GET"]), Route("/predict", _ok, ["POST"])])
    assert call(router, "GET", "/models/m1") == (
        200,
        {b"content-length": b"14", b"content-type": b"application/json"},
        b'{"name": "m1"}',
    )
    assert call(router, "HEAD", "/models/m1")[0] == 200  # a GET route answers HEAD
    status, _, body = call(router, "GET", "/models/m1/extra")  # a parameter is one segment
    assert (status, json.loads(body)["error"]["kind"]) == (404, "not_found")
    status, headers, body = call(router, "GET", "/predict")
    assert (status, headers[b"allow"], json.loads(body)["error"]["kind"]) == (405, b"POST", "method_not_allowed")


def test_router_answers_500_internal_when_an_endpoint_raises():
    async def broken(request: Request) -> Response:
        raise ValueError("boom")

    status, _, body = call(Router([Route("/x", broken, ["GET"])]), "GET", "/x")
    assert (status, json.loads(body)["error"]) == (500, {"kind": "internal", "message": "ValueError: boom"})
