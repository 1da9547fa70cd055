"""Where alerts go: webhooks (HTTP POST of JSON) and an MQTT topic, each behind its own queue.

Why a thread and a bounded queue per sink: a receiver that is down, slow or answers 500 must
never hold up the server (the driver only enqueues, which never blocks) nor the other sinks.
Each sink sends its alerts in order (a resolve never overtakes its fire), retrying one with
exponential backoff (:func:`backoff_delay`, capped) up to ``max_attempts``; an alert that finds
the queue full, or runs out of attempts, is given up. Every alert sent or given up is reported
to ``on_outcome`` (the runner audits it).

A webhook body may be signed: ``X-Edgepack-Signature: sha256=<hex HMAC-SHA256 of the body with
the shared secret>``, so a receiver can tell the server's alerts from anyone's POST. Redirects
are not followed (the body and its signature would go to another address).
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import logging
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from edgepack_core.mqtt_transport import MqttTransport
from sdk.errors import AlertDeliveryError
from sdk.fleet_server.alert_config import Delivery

log = logging.getLogger("edgepack.fleet_server.alerts")

SIGNATURE_HEADER = "X-Edgepack-Signature"
MAX_ANSWER_BYTES = 64 * 1024


def backoff_delay(failures: int, base_s: float, cap_s: float) -> float:
    """The wait after ``failures`` failed tries in a row (1: the first): ``base_s`` doubled each
    time, never above ``cap_s``. Pure."""
    if failures < 1:
        return 0.0
    return min(cap_s, base_s * 2.0 ** min(failures - 1, 64))


def signature(secret: bytes, body: bytes) -> str:
    """The value of :data:`SIGNATURE_HEADER` for ``body``. Pure."""
    return "sha256=" + hmac.new(secret, body, hashlib.sha256).hexdigest()


@dataclass(frozen=True)
class Outgoing:
    """One alert on its way: the body and what the audit names it by."""

    key: str
    event: str
    body: bytes


class Outlet(Protocol):
    name: str

    def send(self, body: bytes) -> None:
        """Deliver once, or raise :class:`AlertDeliveryError`."""


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *_args: object, **_kwargs: object) -> None:
        return None


class WebhookOutlet:
    """POST to a URL; a 2xx answer is delivered."""

    def __init__(self, url: str, *, secret: bytes | None, timeout_s: float, name: str | None = None) -> None:
        self.url = url
        self.secret = secret
        self.timeout_s = timeout_s
        self.name = name or f"webhook:{urllib.parse.urlsplit(url).netloc}"
        self._opener = urllib.request.build_opener(_NoRedirect())

    def send(self, body: bytes) -> None:
        headers = {"Content-Type": "application/json", "User-Agent": "edgepack-fleet-alerts/1"}
        if self.secret is not None:
            headers[SIGNATURE_HEADER] = signature(self.secret, body)
        request = urllib.request.Request(self.url, data=body, method="POST", headers=headers)
        try:
            with self._opener.open(request, timeout=self.timeout_s) as answer:
                answer.read(MAX_ANSWER_BYTES)
                status = answer.status
        except urllib.error.HTTPError as err:
            err.close()
            raise AlertDeliveryError(f"{self.name} answered HTTP {err.code}") from err
        except (OSError, ValueError) as err:  # refused, reset, timed out, DNS
            raise AlertDeliveryError(f"{self.name}: {getattr(err, 'reason', None) or err}") from err
        if not 200 <= status < 300:
            raise AlertDeliveryError(f"{self.name} answered HTTP {status}")


class MqttOutlet:
    """Publish at QoS 1 on the server's own broker connection; the broker's PUBACK is delivered."""

    def __init__(self, transport: MqttTransport, topic: str, *, timeout_s: float) -> None:
        self.transport = transport
        self.topic = topic
        self.timeout_s = timeout_s
        self.name = f"mqtt:{topic}"

    def send(self, body: bytes) -> None:
        acked = threading.Event()
        accepted: list[bool] = []

        def done(ok: bool) -> None:
            accepted.append(ok)
            acked.set()

        if not self.transport.publish(self.topic, body, qos=1, on_done=done):
            raise AlertDeliveryError(f"{self.name}: the broker connection refused the publish")
        if not acked.wait(self.timeout_s):
            raise AlertDeliveryError(f"{self.name}: no PUBACK within {self.timeout_s:g} s")
        if not accepted[0]:
            raise AlertDeliveryError(f"{self.name}: the broker refused it (not authorised to write the topic?)")


OutcomeHandler = Callable[[str, Outgoing, bool, int, str], None]
"""``(sink name, alert, sent, attempts, reason)``: called once per alert, sent or given up."""


class Sink:
    """One outlet with its bounded queue and its sending thread."""

    def __init__(self, outlet: Outlet, delivery: Delivery, on_outcome: OutcomeHandler) -> None:
        self.outlet = outlet
        self.name = outlet.name
        self.delivery = delivery
        self.on_outcome = on_outcome
        self._queue: collections.deque[Outgoing] = collections.deque()
        self._ready = threading.Condition()
        self._stop = threading.Event()
        self.waits: list[float] = []  # every backoff wait taken, in order (what the tests read)
        self.sent = 0
        self.given_up = 0
        self._thread = threading.Thread(target=self._run, name=f"alerts-{self.name}", daemon=True)
        self._thread.start()

    @property
    def depth(self) -> int:
        return len(self._queue)

    def enqueue(self, item: Outgoing) -> bool:
        """Queue ``item`` without blocking; False (and given up) when the queue is full."""
        with self._ready:
            if len(self._queue) < self.delivery.queue:
                self._queue.append(item)
                self._ready.notify()
                return True
        self._report(item, False, 0, f"the queue of {self.delivery.queue} alert(s) is full")
        return False

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop sending; what is still queued is given up (and so audited), not lost without a word."""
        self._stop.set()
        with self._ready:
            self._ready.notify_all()
        self._thread.join(timeout_s)
        while True:
            with self._ready:
                if not self._queue:
                    return
                item = self._queue.popleft()
            self._report(item, False, 0, "the server stopped before it was sent")

    def _next(self) -> Outgoing | None:
        with self._ready:
            while not self._queue and not self._stop.is_set():
                self._ready.wait()
            return self._queue.popleft() if self._queue and not self._stop.is_set() else None

    def _run(self) -> None:
        while (item := self._next()) is not None:
            self._deliver(item)

    def _deliver(self, item: Outgoing) -> None:
        reason = ""
        for attempt in range(1, self.delivery.max_attempts + 1):
            try:
                self.outlet.send(item.body)
            except AlertDeliveryError as err:
                reason = str(err)
                log.warning("alert %s (%s) to %s: try %d failed: %s", item.key, item.event, self.name, attempt, reason)
            else:
                self._report(item, True, attempt, "")
                return
            if attempt == self.delivery.max_attempts:
                break
            wait = backoff_delay(attempt, self.delivery.backoff_s, self.delivery.max_backoff_s)
            self.waits.append(wait)
            if self._stop.wait(wait):
                reason = f"the server stopped while retrying ({reason})"
                break
        self._report(item, False, attempt, reason)

    def _report(self, item: Outgoing, sent: bool, attempts: int, reason: str) -> None:
        if sent:
            self.sent += 1
        else:
            self.given_up += 1
            log.error(
                "alert %s (%s) to %s given up after %d try(s): %s", item.key, item.event, self.name, attempts, reason
            )
        try:
            self.on_outcome(self.name, item, sent, attempts, reason)
        except Exception:  # the audit's write failed: logged; the sink goes on with the next alert
            log.exception("could not record the outcome of alert %s to %s", item.key, self.name)
