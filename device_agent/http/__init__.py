"""The agent's local HTTP API (docs/agent.md, "HTTP API"), one concern a module: ``app``
(routes, admission, bodies read within their bounds, work on a bounded pool), ``guards`` (the
ASGI guard: answers counted, bodies never left to be parsed as a request), ``negotiation``
(body and answer media types), ``answers`` (JSON documents and the error shape), ``results``
(the JSON shape of a prediction), ``prometheus``
(``/metrics``), ``server`` (the HTTP/1.1 connection driver, ``ApiServer``), ``protocol`` (HTTP/1.1
on one connection, on h11, without I/O), ``web`` (request, response, router: no web framework),
``admission`` (the pure connection and body-budget rules), ``bodies`` (bounded body decoding),
``oip`` (the Open Inference Protocol) and ``openapi`` (the API's description).

Nothing is imported here: the runtime uses ``bodies`` and ``negotiation``, and ``predict`` uses
``results``, without loading a web framework.
"""
