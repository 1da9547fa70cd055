"""Peak memory and CPU of an agent process under the HTTP attacks of issue 21, before (a
revision, ``--before``) and after (this tree), side by side, medians of ``--runs``.

Each attack gets a fresh ``edgepack-agent run`` process (no MQTT) of the tree under test,
serving the MobileNet-style demo (an image model with a dynamic batch dim) or, for the JSON
answer, a y = 2x model of ``[batch, 4]`` (raw outputs). Warmed up with real requests, its idle
figure is its RSS then; the kernel's peak-RSS mark (``VmHWM``) is reset (``clear_refs``), the
attack runs, and the peak is read with the agent's CPU seconds over the attack (utime + stime)
and the answers' statuses. Probes after an attack (``/predict``, ``/healthz``) say whether the
agent still serves the others while the attack holds.

Attacks: a 65 kB npz asking for a 64 MiB batch (111 images), alone and four at once; raw
outputs of a 4 MiB batch answered as JSON, four at once; the JPEG scan bomb (2048x2048 gray,
2,000 scans, 94 kB), two at once (both decode slots); an npz whose central directory holds
300,000 entries while declaring 1; four connections declaring 16 MiB bodies and sending
nothing, then three /predict; 64 half-open heads, then /healthz, /metrics and /predict. Two
rows are no attacks but what the bounds still let a client ask for: a batch of 6 images at
``api.max_batch_bytes`` (4 MiB), four at once, and a JPEG of 100 scans (the most taken) of
4096x4096 pixels (the default pixel cap with 2 GiB of memory or more), two at once.

    python tools/bench/agent_http_exhaustion.py [--runs 3] [--before ed0ed8d] [--only NAME,...]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from sdk.keys import write_keypair  # noqa: E402
from tests.artifacts import build_artifact  # noqa: E402
from tests.hostile_bodies import jpeg_scan_bomb, npz_with_directory_entries, npz_zip_bomb  # noqa: E402
from tools.bench.hostile_http_memory import package, png_640x480, post, status_of  # noqa: E402
from tools.bench.http_api import cpu_seconds  # noqa: E402
from tools.demos import build_all  # noqa: E402

BEFORE_REV = "ed0ed8d"  # main before issue 21's agent work
MIB = 1 << 20
IMAGE = 3 * 224 * 224 * 4
RUN = "import sys; sys.path.insert(0, sys.argv.pop(1)); from device_agent.cli import main; sys.exit(main())"


def request(port: int, body: bytes, content_type: str, path: str = "/predict", method: str = "POST",
            accept: str = "application/json", timeout: float = 300) -> int:
    """One request on its own connection; its status (0: no answer)."""
    head = (f"{method} {path} HTTP/1.1\r\nHost: bench\r\nContent-Type: {content_type}\r\nAccept: {accept}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    return post(port, body, content_type, head=head, timeout=timeout)


def at_once(port: int, times: int, body: bytes, content_type: str, **options: str) -> list[int]:
    with concurrent.futures.ThreadPoolExecutor(times) as pool:
        return list(pool.map(lambda _: request(port, body, content_type, **options), range(times)))


class Agent:
    """``edgepack-agent run`` of ``tree`` serving ``artifact`` on a free port, API only."""

    def __init__(self, tree: Path, artifact: Path, pub: Path, folder: Path) -> None:
        folder.mkdir(parents=True)
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        config = folder / "agent.yaml"
        config.write_text(f"device_id: bench\nstore: {folder / 'store'}\ntrust: [{pub}]\nartifact: {artifact}\n"
                          f"api: {{listen: '127.0.0.1:{self.port}'}}\nlog_level: error\n")
        env = {**os.environ, "PYTHONPATH": str(tree)}
        self.proc = subprocess.Popen([sys.executable, "-c", RUN, str(tree), "run", "--config", str(config)],
                                     env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while request(self.port, b"", "", path="/healthz", method="GET", timeout=2) != 200:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the agent of {tree} did not come up")
            time.sleep(0.1)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def hold(port: int, count: int, head: bytes) -> list[socket.socket]:
    held = []
    for _ in range(count):
        with contextlib.suppress(OSError):
            sock = socket.create_connection(("127.0.0.1", port), timeout=10)
            sock.sendall(head)
            held.append(sock)
    return held


def unsent_bodies(port: int, probe: bytes) -> list[int]:
    """Four connections declaring 16 MiB bodies, sending none; then three /predict while they hold."""
    held = hold(port, 4, f"POST /predict HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
                         f"Content-Length: {16 * MIB}\r\n\r\n".encode())
    time.sleep(0.5)
    try:
        return [request(port, probe, "application/json") for _ in range(3)]
    finally:
        for sock in held:
            sock.close()


def half_open_heads(port: int, probe: bytes) -> list[int]:
    """64 connections whose head never ends; then /healthz and /metrics at once, /predict after 1.1 s."""
    held = hold(port, 64, b"GET /predict HTTP/1.1\r\nHost: bench\r\n")
    time.sleep(0.2)
    try:
        statuses = [request(port, b"", "", path=path, method="GET") for path in ("/healthz", "/metrics")]
        time.sleep(1.1)  # a general slot's half-open head may be evicted after 1 s (device_agent/http/admission.py)
        return [*statuses, request(port, probe, "application/json")]
    finally:
        for sock in held:
            sock.close()


def attacks(png: bytes) -> dict[str, tuple[str, Callable[[int], list[int]]]]:
    """name -> (model, attack); built once (the bodies are the same for both trees)."""
    batch = npz_zip_bomb((64 * MIB // IMAGE, 3, 224, 224), name="input")  # 111 images: 65 kB
    rows = npz_zip_bomb((4 * MIB // 16, 4))  # 262,144 rows of [batch, 4]: 4 MiB, raw outputs as JSON
    at_limit = npz_zip_bomb((4 * MIB // IMAGE, 3, 224, 224), name="input")  # 6 images: api.max_batch_bytes
    bomb = jpeg_scan_bomb(2048, 2000)
    scans_at_cap = jpeg_scan_bomb(4096, 100)  # the most scans taken, on the most pixels (memory >= 2 GiB)
    directory = npz_with_directory_entries(300_000, name="input")
    probe = json.dumps({"inputs": {"x": [[1, 2, 3, 4]]}}).encode()
    return {
        "batch_npz_65kB": ("mobilenet", lambda port: [request(port, batch, "application/x-npz")]),
        "batch_npz_65kB_x4": ("mobilenet", lambda port: at_once(port, 4, batch, "application/x-npz")),
        "json_answer_4MiB_x4": ("scale", lambda port: at_once(port, 4, rows, "application/x-npz")),
        "jpeg_scan_bomb_x2": ("mobilenet", lambda port: at_once(port, 2, bomb, "image/jpeg")),
        # not attacks: what the bounds still let a client ask for
        "batch_npz_at_limit_x4": ("mobilenet", lambda port: at_once(port, 4, at_limit, "application/x-npz")),
        "jpeg_100_scans_4096_x2": ("mobilenet", lambda port: at_once(port, 2, scans_at_cap, "image/jpeg")),
        "npz_300000_entries": ("mobilenet", lambda port: [request(port, directory, "application/x-npz")]),
        "unsent_16MiB_bodies_x4": ("scale", lambda port: unsent_bodies(port, probe)),
        "half_open_heads_64": ("scale", lambda port: half_open_heads(port, probe)),
    }


def one(tree: Path, artifact: Path, pub: Path, folder: Path, warm: tuple[bytes, str],
        attack: Callable[[int], list[int]]) -> dict[str, object]:
    agent = Agent(tree, artifact, pub, folder)
    try:
        assert [request(agent.port, *warm) for _ in range(3)] == [200] * 3
        time.sleep(0.5)
        Path(f"/proc/{agent.proc.pid}/clear_refs").write_text("5")  # the peak-RSS mark := the RSS now
        idle, cpu, started = status_of(agent.proc.pid), cpu_seconds(agent.proc.pid), time.monotonic()
        statuses = attack(agent.port)
        wall = time.monotonic() - started
        after = status_of(agent.proc.pid)
        return {"idle_mib": idle["VmRSS"] / 1024, "peak_mib": after["VmHWM"] / 1024,
                "ratio": after["VmHWM"] / idle["VmRSS"], "cpu_s": cpu_seconds(agent.proc.pid) - cpu,
                "wall_s": wall, "statuses": statuses}
    finally:
        agent.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--before", default=BEFORE_REV, help="the revision measured as before")
    parser.add_argument("--only", help="comma-separated attack names")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        before = folder / "before"
        before.mkdir()
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", args.before], capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", str(before)], input=archive.stdout, check=True)
        key, pub = folder / "k.key", folder / "k.pub"
        write_keypair(key, pub)
        build_all(folder / "demo", only=["mobilenet"])
        models = {"mobilenet": (package(folder, key), (png_640x480(), "image/png")),
                  "scale": (build_artifact(folder / "scale", key),
                            (json.dumps({"inputs": {"x": [[1, 2, 3, 4]]}}).encode(), "application/json"))}
        table = attacks(models["mobilenet"][1][0])
        chosen = args.only.split(",") if args.only else list(table)
        results: dict[str, dict[str, dict[str, object]]] = {}
        for name in chosen:
            model, attack = table[name]
            artifact, warm = models[model]
            for label, tree in (("before", before), ("after", ROOT)):
                runs = [one(tree, artifact, pub, folder / f"{label}-{name}-{run}", warm, attack)
                        for run in range(args.runs)]
                results.setdefault(name, {})[label] = {
                    "statuses": runs[0]["statuses"],
                    **{key: round(statistics.median(r[key] for r in runs), 3)
                       for key in ("idle_mib", "peak_mib", "ratio", "cpu_s", "wall_s")}}
                print(name, label, json.dumps(results[name][label]), file=sys.stderr, flush=True)
        print("| attack | before: answers, peak / idle, CPU | after: answers, peak / idle, CPU |")
        print("| --- | --- | --- |")
        for name, sides in results.items():
            cells = [f"{s['statuses']}: {s['peak_mib']:.1f} / {s['idle_mib']:.1f} MiB (**{s['ratio']:.2f}x**), "
                     f"{s['cpu_s']:.2f} s CPU" for s in (sides["before"], sides["after"])]
            print(f"| {name} | {cells[0]} | {cells[1]} |")
        worst = max(sides["after"]["ratio"] for sides in results.values())
        print(json.dumps({"before": args.before, "runs": args.runs, "attacks": results,
                          "after_worst_ratio": worst, "after_under_2x_idle": worst <= 2}, indent=2))


if __name__ == "__main__":
    main()
