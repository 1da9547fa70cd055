"""The CPU budget of a JPEG, read from its markers before any decoder sees it (pure).

libjpeg decodes a progressive JPEG scan by scan, and every scan walks every block of the
components it covers, however few bytes it takes: an AC band of zeros is a few bytes of
end-of-band runs. So a 505 kB file of thousands of tiny scans over a large frame cost 83 s of
CPU (the cost is scans x blocks, not bytes). Encoders write about 10 scans (libjpeg's
progressive default), never near ``MAX_SCANS``; this walk counts them, and the segments before
and between them (Pillow parses each header segment in Python), and refuses beyond, in one
linear pass that skips entropy-coded data at C speed.
"""

from __future__ import annotations

import re

from edgepack_core.errors import PreprocessError

SOI = b"\xff\xd8"
MAX_SCANS = 100
MAX_SEGMENTS = 1000
# Fill bytes (0xFF) a marker may follow: Pillow's header parser skips each in Python.
MAX_FILL = 1024
_SOS, _EOI = 0xDA, 0xD9
# Markers without a length: RST0-7, TEM (and SOI/EOI).
_STANDALONE = frozenset({0x01, *range(0xD0, 0xD8)})
# The end of entropy-coded data: 0xFF followed by a byte that is not a stuffed zero, a restart
# marker or more fill (0xFF); that byte is the next marker.
_NEXT_MARKER = re.compile(rb"\xff[^\x00\xd0-\xd7\xff]")
_FILL = re.compile(rb"\xff+")


def count_scans(data: bytes | memoryview, *, max_scans: int = MAX_SCANS, max_segments: int = MAX_SEGMENTS) -> int:
    """The scans of a JPEG (pure; 0 for anything else; a truncated one is left to the decoder,
    which refuses it). Raises ``PreprocessError`` past ``max_scans`` scans or ``max_segments``
    segments, as soon as the walk gets there, and for bytes between segments or more than
    ``MAX_FILL`` fill bytes before a marker (Pillow would skip them one by one in Python)."""
    data = bytes(data)
    if not data.startswith(SOI):
        return 0
    position, scans, segments = 2, 0, 0
    while position + 4 <= len(data):
        position = _marker_at(data, position)
        marker = data[position + 1]
        if marker == _EOI:
            break
        segments = _counted(segments, max_segments, "segments", "its decoding cost is not bounded by its size")
        if marker in _STANDALONE:
            position += 2
            continue
        position += 2 + int.from_bytes(data[position + 2:position + 4], "big")
        if marker == _SOS:
            scans = _counted(scans, max_scans, "scans", "encoders write about 10; each scan costs a pass over "
                             "the whole image")
            found = _NEXT_MARKER.search(data, position)
            position = len(data) if found is None else found.start()
    return scans


def _marker_at(data: bytes, position: int) -> int:
    """Where the marker at ``position`` starts, past its fill bytes (at most ``MAX_FILL``)."""
    run = _FILL.match(data, position)
    if run is None:  # no 0xFF at position
        raise PreprocessError(f"not a well-formed JPEG: bytes outside its segments at offset {position}")
    fill = run.end() - 1 - position  # the last 0xFF of a run precedes the marker
    if fill > MAX_FILL:
        raise PreprocessError(f"not a well-formed JPEG: {fill} fill bytes before a marker at offset {position}")
    return position + fill


def _counted(count: int, limit: int, what: str, why: str) -> int:
    if count + 1 > limit:
        raise PreprocessError(f"a JPEG of more than {limit} {what} is refused ({why})")
    return count + 1
