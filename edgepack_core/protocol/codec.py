"""The chunk codec of the MQTT artifact transfer (``edgepack.xfer/1``). Pure: bytes in, bytes out.

    device -> {root}/dev/{d}/xfer/{xid}/req    {"schema": "edgepack.xfer/1", "chunks": [i, ...]}
    host   -> {root}/dev/{d}/xfer/{xid}/data   b"EPX1" | index (uint32 BE) | sha256(chunk) | chunk

Each chunk carries its own sha256, so a corrupt chunk is dropped and asked for again; the
assembled file is then checked against the command's sha256 and, like any download, verified
by signature before use. A request names at most :data:`MAX_REQUEST_CHUNKS` chunks, so one
message from a device can make the host read and send only a bounded amount.
"""

from __future__ import annotations

import hashlib
import json
import struct

from edgepack_core.protocol.payloads import XFER_SCHEMA_ID

MAGIC = b"EPX1"
HEADER = struct.Struct(">4sI32s")
MAX_REQUEST_CHUNKS = 256
MAX_REQUEST_BYTES = 16 * 1024


def encode_chunk(index: int, data: bytes) -> bytes:
    """One ``data`` frame: magic, index, the chunk's own sha256, the chunk."""
    return HEADER.pack(MAGIC, index, hashlib.sha256(data).digest()) + data


def decode_chunk(payload: bytes) -> tuple[int, bytes] | None:
    """(index, data), or None for a payload that is malformed or fails its own checksum."""
    if len(payload) < HEADER.size:
        return None
    magic, index, digest = HEADER.unpack_from(payload)
    data = payload[HEADER.size:]
    if magic != MAGIC or hashlib.sha256(data).digest() != digest:
        return None
    return index, data


def request_payload(chunks: list[int]) -> bytes:
    """A device's request for ``chunks`` (the caller keeps it under :data:`MAX_REQUEST_CHUNKS`)."""
    return json.dumps({"schema": XFER_SCHEMA_ID, "chunks": chunks}).encode()


def parse_request(payload: bytes, total: int) -> list[int]:
    """Chunk indexes asked for, in order, each once, at most :data:`MAX_REQUEST_CHUNKS`, all in
    ``[0, total)``. Anything malformed gives an empty list. Pure, never raises."""
    if len(payload) > MAX_REQUEST_BYTES:
        return []
    try:
        doc = json.loads(payload)
    except (UnicodeDecodeError, ValueError, RecursionError):
        return []
    chunks = doc.get("chunks") if isinstance(doc, dict) and doc.get("schema") == XFER_SCHEMA_ID else None
    if not isinstance(chunks, list):
        return []
    wanted: list[int] = []
    for chunk in chunks[:MAX_REQUEST_CHUNKS]:
        if isinstance(chunk, int) and not isinstance(chunk, bool) and 0 <= chunk < total and chunk not in wanted:
            wanted.append(chunk)
    return wanted


def chunk_count(size: int, chunk_size: int) -> int:
    """How many chunks of ``chunk_size`` hold ``size`` bytes (at least one)."""
    return max(1, -(-size // chunk_size))


def chunk_span(index: int, size: int, chunk_size: int) -> tuple[int, int]:
    """(offset, length) of chunk ``index`` in a file of ``size`` bytes; ValueError out of range."""
    if not 0 <= index < chunk_count(size, chunk_size):
        raise ValueError(f"chunk {index} is outside a file of {size} bytes in chunks of {chunk_size}")
    offset = index * chunk_size
    return offset, min(chunk_size, size - offset)
