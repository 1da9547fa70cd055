"""An RTSP camera on loopback for tests and benchmarks: GStreamer's rtsp-server (Debian's
gir1.2-gst-rtsp-server-1.0 with python3-gi), serving an H.264 file at its own frame rate.

Run with the system Python (PyGObject comes from Debian, not PyPI):

    /usr/bin/python3 tools/rtsp_server.py --port 8554 --file clip.mp4 [--path /cam]

It prints ``ready rtsp://127.0.0.1:PORT/PATH`` once it listens, and streams the file (demuxed,
not re-encoded: ``qtdemux ! h264parse ! rtph264pay``) to each client from its start, in real
time, over TCP or UDP as the client asks. Tests stop and restart it to drop the camera.
Why GStreamer rather than ``ffmpeg -rtsp_flags listen``: FFmpeg listens only to receive a stream
(its RTSP muxer is a client), so it cannot be the camera a client pulls from.
"""

from __future__ import annotations

import argparse
import signal
import sys


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--file", required=True, help="an H.264 mp4")
    parser.add_argument("--path", default="/cam")
    args = parser.parse_args()

    import gi

    gi.require_version("Gst", "1.0")
    gi.require_version("GstRtspServer", "1.0")
    from gi.repository import GLib, Gst, GstRtspServer

    Gst.init(None)
    server = GstRtspServer.RTSPServer()
    server.set_address("127.0.0.1")
    server.set_service(str(args.port))
    factory = GstRtspServer.RTSPMediaFactory()
    location = args.file.replace("\\", "\\\\").replace('"', '\\"')
    # The parameter sets travel in the SDP (sprop-parameter-sets). Repeating them in band
    # (config-interval=-1 on h264parse or rtph264pay) made FFmpeg's RTSP client decode every frame
    # of a PyAV/libx264 clip to garbage; without it the frames are the file's, bit for bit.
    factory.set_launch(f'( filesrc location="{location}" ! qtdemux ! h264parse ! rtph264pay name=pay0 pt=96 )')
    factory.set_shared(False)  # each client gets the file from its start
    server.get_mount_points().add_factory(args.path, factory)
    if server.attach(None) == 0:
        print(f"cannot listen on 127.0.0.1:{args.port}", file=sys.stderr)
        return 1
    loop = GLib.MainLoop()
    signal.signal(signal.SIGTERM, lambda *_: loop.quit())
    signal.signal(signal.SIGINT, lambda *_: loop.quit())
    GLib.timeout_add(200, lambda: True)  # lets Python's signal handlers run inside the main loop
    print(f"ready rtsp://127.0.0.1:{args.port}{args.path}", flush=True)
    loop.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
