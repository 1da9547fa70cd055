"""HTTP round trip and throughput of the agent's API: today's server (its own, on h11)
against the uvicorn + starlette one and the hand-written ``http.server`` one before that, and,
with ``--before REV``, against today's API as of a git revision (``before``: e.g. the Hypercorn
+ starlette one, the revision before it was replaced), side by side in one run.

Each server runs in its own child process over the same model (the tiny model, so the figure is
the server's own cost; ``--model mobilenet`` for the MobileNet-style demo) and answers
``POST /predict`` with a JSON body and with an ``.npy`` body. The earlier servers are
``device_agent/http_api.py`` as of ``--old-rev`` and ``--uvicorn-rev`` (read with ``git show``,
loaded beside today's runtime; for the old one the npy/npz decoding is put back to its
revision's ``np.load`` of the whole body; the uvicorn one needs uvicorn installed, as the host's
``server`` extra has it). The clients are asyncio streams in this process, one kept-alive
connection each:

- round trip: one client, requests one after another; the median;
- throughput: 32 clients at once; requests per second and the median and p99 latency;
- server CPU: the server process's CPU time (user + system) per request under that load, the
  figure least disturbed by other work on the machine.

Rounds alternate the servers so drift on a noisy machine hits all alike; medians over rounds.

With ``--calls`` nothing is timed: each server (uvicorn and new: the old one answers on a thread
per connection) runs its event-loop thread under cProfile, one process per body kind, and the
figure is the Python function calls that thread makes per request, a count the machine's load
does not disturb.

    python tools/bench/http_api.py [--rounds 5] [--requests 400] [--clients 32] [--model tiny|mobilenet]
                                   [--workers N] [--servers old,uvicorn,new] [--old-rev cf5af44] [--before REV]
                                   [--uvicorn-rev d4b251e] [--calls] [--hypercorn-reads]
                                   [--server-cpus 2,3 --client-cpus 0,1]
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from sdk.keys import write_keypair  # noqa: E402
from sdk.packager.pipeline import build  # noqa: E402
from sdk.recipe import load_recipe  # noqa: E402
from tools.demos import build_all  # noqa: E402

OLD_REV = "cf5af44"  # the last commit with the http.server API
UVICORN_REV = "d4b251e"  # the last commit with the uvicorn API
SERVERS = ("old", "uvicorn", "before", "new")
# The child: load the model, serve it with the old, the uvicorn or today's server, print the
# port, wait; with calls=1, its event-loop thread runs under cProfile and the child prints the
# calls that thread made when it stops. argv: root, which, artifact, public key, folder, module
# file (old, uvicorn), workers, calls, and hypercorn_reads=1 for Hypercorn's own read size.
SERVE = r"""
import importlib.util, sys, threading
from pathlib import Path
sys.path.insert(0, sys.argv[1])
if len(sys.argv) > 8 and sys.argv[8] == "1":
    import cProfile
    profile = cProfile.Profile()
    plain_run = threading.Thread.run
    def run(thread):
        if thread.name == "http-api":  # the servers' event-loop thread
            profile.runcall(plain_run, thread)
        else:
            plain_run(thread)
    threading.Thread.run = run
import device_agent.runtime as runtime
from device_agent.http import bodies, oip
from device_agent.http.negotiation import AUDIO_MEDIA_TYPES
from device_agent.http.results import prediction_json
from device_agent.prediction import PredictResult
from device_agent.request_stats import LATENCY_BUCKETS
# the earlier revisions import the HTTP modules by their names before device_agent/http/, take
# the media types and buckets from the runtime and have the runtime's result write its JSON
sys.modules["device_agent.bodies"], sys.modules["device_agent.oip"] = bodies, oip
runtime.AUDIO_MEDIA_TYPES, runtime.LATENCY_BUCKETS = AUDIO_MEDIA_TYPES, LATENCY_BUCKETS
runtime.PredictResult = PredictResult
PredictResult.to_json = lambda result, *, outputs=None: prediction_json(result, outputs=outputs)
from device_agent.runtime import InferenceService, load_model
from edgepack_core.artifact import extract_artifact
from edgepack_core.signing import TrustStore, load_public_key
which, artifact, pub, folder = sys.argv[2:6]
verified = extract_artifact(Path(artifact), Path(folder), TrustStore([load_public_key(Path(pub))]))
service = InferenceService(load_model(verified.root, verified.manifest))
if which == "old":
    # the old module imported json_to_feed(model, inputs) from the runtime; it lives in bodies now
    runtime.json_to_feed = lambda model, inputs: bodies.json_to_feed(model.input_specs, inputs)
    # and the runtime decoded npy/npz bodies whole (runtime._decode_numpy of the old revision)
    def old_decode(data, specs, limits=None, *, image_input=None):
        import io, numpy as np
        try:
            loaded = np.load(io.BytesIO(data), allow_pickle=False)
        except (OSError, ValueError, EOFError) as err:
            raise runtime.BadRequest("bad_input", f"not a readable .npy/.npz body: {err}") from None
        if isinstance(loaded, np.ndarray):
            return loaded
        with loaded:
            return {name: loaded[name] for name in loaded.files}
    runtime.decode_numpy = old_decode
    spec = importlib.util.spec_from_file_location("old_http_api", sys.argv[6])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    server = module.ApiServer(("127.0.0.1", 0), service, max_body_bytes=16 << 20).start()
else:
    from device_agent.config import ApiSettings
    if which == "uvicorn":
        spec = importlib.util.spec_from_file_location("uvicorn_http_api", sys.argv[6])
        module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # its dataclasses look it up
        spec.loader.exec_module(module)
        ApiServer = module.ApiServer
    else:
        from device_agent.http.server import ApiServer
        if len(sys.argv) > 9 and sys.argv[9] == "1":  # Hypercorn's own: 64 KiB reads, 10 chunks queued
            import device_agent.http.server as http_server
            http_server.READ_BYTES, http_server.APP_QUEUE_CHUNKS = 64 * 1024, 10
    workers = int(sys.argv[7]) if len(sys.argv) > 7 and sys.argv[7] != "0" else None
    settings = ApiSettings(workers=workers) if workers else None
    server = ApiServer(("127.0.0.1", 0), service, max_body_bytes=16 << 20, settings=settings).start()
print(server.port, flush=True)
sys.stdin.read()
server.stop()
if len(sys.argv) > 8 and sys.argv[8] == "1":
    import pstats
    print(pstats.Stats(profile).total_calls, flush=True)
"""


def package(folder: Path, model: str, key: Path) -> Path:
    demo = {"tiny": "demo/tiny/model.onnx", "mobilenet": "demo/mobilenet/model.onnx"}[model]
    recipe = folder / f"{model}.yaml"
    recipe.write_text(f"name: {model}\nversion: 1.0.0\nmodel: {{path: {demo}}}\npostprocess: {{kind: raw}}\n"
                      "targets: [x86]\nvalidate: {data: synthetic}\n")
    return build(load_recipe(recipe), key_paths=[str(key)], output=folder / f"{model}.edgepkg").output


def requests_for(name: str, shape: list[int]) -> dict[str, bytes]:
    """Whole HTTP requests for one input ``name`` of ``shape``: JSON and .npy bodies."""
    x = np.random.default_rng(0).random(shape, dtype=np.float32)
    buffer = io.BytesIO()
    np.save(buffer, x)
    bodies = {"json": ("application/json", json.dumps({"inputs": {name: x.tolist()}}).encode()),
              "npy": ("application/x-npy", buffer.getvalue())}
    return {kind: (f"POST /predict HTTP/1.1\r\nHost: bench\r\nContent-Type: {media}\r\n"
                   f"Content-Length: {len(body)}\r\n\r\n").encode() + body for kind, (media, body) in bodies.items()}


async def exchange(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes) -> float:
    started = time.perf_counter()
    writer.write(request)
    head = await reader.readuntil(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(f"not a 200: {head[:200]!r}")
    length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length"))
    await reader.readexactly(length)
    return time.perf_counter() - started


async def run_clients(port: int, request: bytes, clients: int, total: int) -> tuple[float, list[float]]:
    """``total`` requests from ``clients`` kept-alive connections: (seconds, latencies)."""
    connections = [await asyncio.open_connection("127.0.0.1", port) for _ in range(clients)]
    for reader, writer in connections:  # warm each connection
        await exchange(reader, writer, request)
    latencies: list[float] = []
    left = [total]

    async def client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while left[0] > 0:
            left[0] -= 1
            latencies.append(await exchange(reader, writer, request))

    started = time.perf_counter()
    await asyncio.gather(*(client(r, w) for r, w in connections))
    elapsed = time.perf_counter() - started
    for _, writer in connections:
        writer.close()
    return elapsed, latencies


def earlier_modules(folder: Path, old_rev: str, uvicorn_rev: str) -> dict[str, Path]:
    """``device_agent/http_api.py`` of the earlier servers' revisions (today's app is
    ``device_agent/http/app.py``), as files for the child."""
    modules = {}
    for which, rev in (("old", old_rev), ("uvicorn", uvicorn_rev)):
        modules[which] = folder / f"{which}_http_api.py"
        source = ["git", "-C", str(ROOT), "show", f"{rev}:device_agent/http_api.py"]
        modules[which].write_bytes(subprocess.run(source, capture_output=True, check=True).stdout)
    modules["new"] = ROOT / "device_agent" / "http" / "app.py"
    return modules


SERVER_CPUS: set[int] | None = None  # --server-cpus: the cores the server processes run on


BEFORE_ROOT: Path | None = None  # --before: device_agent and edgepack_core as of that revision


def code_at(rev: str, folder: Path) -> Path:
    """The device packages as of ``rev`` (git archive), served as ``before`` beside today's."""
    folder.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "device_agent", "edgepack_core"],
                             capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
    return folder


def serve(which: str, artifact: Path, pub: Path, folder: Path, module: Path, workers: int | None = None,
          calls: bool = False, hypercorn_reads: bool = False) -> tuple[subprocess.Popen, int]:
    pin = (lambda: os.sched_setaffinity(0, SERVER_CPUS)) if SERVER_CPUS else None
    root = ROOT
    if which == "before":  # today's child on the packages of --before (its sdk and tools are today's)
        assert BEFORE_ROOT is not None
        root, which = BEFORE_ROOT, "new"
    proc = subprocess.Popen([sys.executable, "-c", SERVE, str(root), which, str(artifact), str(pub), str(folder),
                             str(module), str(workers or 0), "1" if calls else "0", "1" if hypercorn_reads else "0"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, preexec_fn=pin)
    return proc, int(proc.stdout.readline())


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def measure(pid: int, port: int, requests: dict[str, bytes], count: int, clients: int) -> dict[str, float]:
    figures = {}
    for kind, request in requests.items():
        _, single = asyncio.run(run_clients(port, request, 1, count))
        cpu = cpu_seconds(pid)
        elapsed, loaded = asyncio.run(run_clients(port, request, clients, count))
        figures[f"{kind}_server_cpu_ms"] = (cpu_seconds(pid) - cpu) / (count + clients) * 1000
        loaded.sort()
        figures[f"{kind}_rtt_ms"] = statistics.median(single) * 1000
        figures[f"{kind}_rps"] = count / elapsed
        figures[f"{kind}_loaded_p50_ms"] = loaded[len(loaded) // 2] * 1000
        figures[f"{kind}_loaded_p99_ms"] = loaded[int(len(loaded) * 0.99)] * 1000
    return figures


def calls_per_request(which: str, artifact: Path, pub: Path, folder: Path, module: Path,
                      requests: dict[str, bytes], count: int, clients: int,
                      hypercorn_reads: bool = False) -> dict[str, float]:
    """Python calls on the server's event-loop thread per request, one server process per body kind."""
    figures = {}
    for kind, request in requests.items():
        proc, port = serve(which, artifact, pub, folder / kind, module, calls=True, hypercorn_reads=hypercorn_reads)
        try:
            measure(proc.pid, port, {kind: request}, count, clients)
        finally:
            out, _ = proc.communicate("", timeout=60)
        sent = (count + 1) + (count + clients)  # measure: one client (one warm-up), then all of them
        figures[f"{kind}_loop_calls_per_request"] = int(out.split()[-1]) / sent
    return figures


def chosen_servers(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """The servers each round runs, in order (``before`` just ahead of ``new`` with --before)."""
    servers = args.servers.split(",")
    if args.before and "before" not in servers:
        servers.insert(len(servers) - 1 if servers[-1] == "new" else len(servers), "before")
    if not servers or set(servers) - set(SERVERS) or (args.calls and "old" in servers) or \
            ("before" in servers and not args.before):
        parser.error(f"--servers takes a comma-separated list of {', '.join(SERVERS)} (not old with --calls; "
                     "before with --before REV)")
    return servers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--model", choices=["tiny", "mobilenet"], default="tiny")
    parser.add_argument("--old-rev", default=OLD_REV)
    parser.add_argument("--uvicorn-rev", default=UVICORN_REV)
    parser.add_argument("--servers", default=",".join(SERVERS), help="which servers, in the order each round runs them")
    parser.add_argument("--workers", type=int, help="api.workers of the uvicorn and new servers (default: 4)")
    parser.add_argument("--calls", action="store_true", help="count the event loop's Python calls per request "
                        "instead of timing (uvicorn and new)")
    parser.add_argument("--server-cpus", help="comma-separated cores for the servers (a 2-core device on a larger "
                        "machine); with --client-cpus for the clients, so neither takes the other's")
    parser.add_argument("--client-cpus", help="comma-separated cores for this process, the clients")
    parser.add_argument("--before", help="also serve today's API as of this git revision (server 'before')")
    parser.add_argument("--hypercorn-reads", action="store_true", help="the new server with Hypercorn's own read "
                        "size and queue (64 KiB reads, 10 chunks) instead of its 256 KiB and 3")
    args = parser.parse_args()
    servers = chosen_servers(parser, args)
    global SERVER_CPUS, BEFORE_ROOT
    SERVER_CPUS = {int(cpu) for cpu in args.server_cpus.split(",")} if args.server_cpus else None
    if args.client_cpus:
        os.sched_setaffinity(0, {int(cpu) for cpu in args.client_cpus.split(",")})
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        key, pub = folder / "k.key", folder / "k.pub"
        write_keypair(key, pub)
        build_all(folder / "demo", only=[args.model])
        artifact = package(folder, args.model, key)
        modules = earlier_modules(folder, args.old_rev, args.uvicorn_rev)
        if args.before:
            BEFORE_ROOT = code_at(args.before, folder / "before-code")
            modules["before"] = BEFORE_ROOT / "device_agent" / "http" / "app.py"
        if args.model == "tiny":
            requests = requests_for("x", [1, 4])
        else:  # 32 JSON bodies of 3.2 MB are over the default api.max_buffered_bytes (64 MiB): 503 busy
            requests = {"npy": requests_for("input", [1, 3, 224, 224])["npy"]}
        results: dict[str, list[dict[str, float]]] = {which: [] for which in servers}
        for round_number in range(args.rounds):
            for which in servers:
                place = folder / f"{which}-{round_number}"
                if args.calls:
                    results[which].append(calls_per_request(which, artifact, pub, place, modules[which], requests,
                                                            args.requests, args.clients, args.hypercorn_reads))
                    continue
                proc, port = serve(which, artifact, pub, place, modules[which], args.workers,
                                   hypercorn_reads=args.hypercorn_reads)
                try:
                    results[which].append(measure(proc.pid, port, requests, args.requests, args.clients))
                finally:
                    proc.communicate("", timeout=30)
        keys = list(results[servers[0]][0])
        summary = {which: {k: round(statistics.median(r[k] for r in rounds), 3) for k in keys}
                   for which, rounds in results.items()}
        for base in ("old", "uvicorn", "before"):
            if "new" in summary and base in summary:
                summary[f"new/{base}"] = {k: round(summary["new"][k] / summary[base][k], 3) for k in keys}
        print(json.dumps({"model": args.model, "clients": args.clients, "requests": args.requests,
                          "rounds": args.rounds, "old_rev": args.old_rev, "uvicorn_rev": args.uvicorn_rev,
                          "before_rev": args.before,
                          "workers": args.workers, "hypercorn_reads": args.hypercorn_reads,
                          "server_cpus": args.server_cpus, "client_cpus": args.client_cpus, **summary}, indent=2))


if __name__ == "__main__":
    main()
