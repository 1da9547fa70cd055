"""Idle RSS of a real ``edgepack-agent run`` serving the digits demo, and what it is made of.

Each round starts the agent's console script (this checkout first on ``PYTHONPATH``) on the
digits demo artifact with ``tools/demo.sh``'s agent.yaml (``--mqtt``: plus a real mosquitto and
the ``mqtt:`` section, updates on), waits for the event that it is ready (``/healthz`` answers),
lets it idle ``--settle`` seconds and reads ``VmRSS`` and ``Pss`` (``/proc/PID/smaps_rollup``)
``--samples`` times; then it serves ``--requests`` PNG predictions and is read again. Figures
are medians over samples and rounds; rounds alternate the agents measured (``--before REV``:
the agent as of a git revision, from ``git archive``; ``--env NAME=VALUE``: this agent with a
variable set, e.g. ``MALLOC_ARENA_MAX=2``), so drift on a noisy machine hits all alike.

Per component: the agent names the modules it has loaded at idle (a ``sitecustomize`` beside it
dumps ``sys.modules`` on SIGUSR1, after the samples), and fresh interpreters import exactly
those, component by component in a fixed order (interpreter, numpy, onnxruntime,
PyYAML, cryptography, Pillow, the HTTP server, paho-mqtt, the rest of the standard library, the
agent's own modules, then a session on the installed model with the agent's session options),
reading VmRSS after each; what the agent holds beyond the last is its state (threads, sessions' buffers,
caches). Each increment is what that component adds on top of the ones before it.

Also per mapping: the idle agent's RSS split into anonymous memory and the pages of each
shared library (clean file pages: the kernel can drop and re-read them).

    python tools/bench/agent_rss.py [--rounds 3] [--samples 5] [--settle 3] [--requests 20]
                                    [--mqtt] [--before REV] [--env NAME=VALUE ...] [--attribution-runs 3]
                                    [--session-options]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.broker import free_port, start_mosquitto  # noqa: E402
from tools.bench.agent_rss_session import session_options_side_by_side  # noqa: E402

KIB_PER_MIB = 1024
PRIVATE: list[Path] = []  # --private-libs: a folder of copied packages, first on every agent's path
PRIVATE_PACKAGES = ("onnxruntime", "numpy", "numpy.libs", "cryptography", "nacl", "PIL", "pillow.libs")
YAML = "<agent.yaml>"  # in an agent's env: lines added to its agent.yaml, not a variable
KEEP_PAGES = "memory: {release_startup_pages: false}\n"
# Dumps sys.modules to $EDGEPACK_RSS_MODULES on SIGUSR1; imports nothing the agent does not.
HOOK = """import os, signal, sys
def _dump(*_):
    with open(os.environ["EDGEPACK_RSS_MODULES"] + ".part", "w") as out:
        out.write("\\n".join(sorted(sys.modules)))
    os.replace(os.environ["EDGEPACK_RSS_MODULES"] + ".part", os.environ["EDGEPACK_RSS_MODULES"])
if os.environ.get("EDGEPACK_RSS_MODULES"):
    signal.signal(signal.SIGUSR1, _dump)
"""
# (label, which loaded modules the step imports); a module goes to the first step that takes it.
COMPONENTS: list[tuple[str, Callable[[str], bool]]] = [
    ("numpy", lambda m: m == "numpy" or m.startswith("numpy.")),
    ("onnxruntime import", lambda m: m.split(".")[0] == "onnxruntime"),
    ("PyYAML", lambda m: m.split(".")[0] in ("yaml", "_yaml")),
    ("Ed25519 (PyNaCl; cryptography before)", lambda m: m.split(".")[0] in ("cryptography", "nacl", "_cffi_backend")),
    ("Pillow", lambda m: m.split(".")[0] == "PIL"),
    (
        "the HTTP server: asyncio, h11, ssl (+ hypercorn, starlette before)",
        lambda m: (
            m.split(".")[0]
            in (
                "asyncio",
                "hypercorn",
                "starlette",
                "h11",
                "h2",
                "hpack",
                "hyperframe",
                "wsproto",
                "anyio",
                "sniffio",
                "priority",
                "ssl",
                "_ssl",
                "idna",
                "typing_extensions",
                "exceptiongroup",
            )
        ),
    ),
    ("paho-mqtt", lambda m: m.split(".")[0] == "paho"),
    ("the rest of the standard library", lambda m: m.split(".")[0] not in ("device_agent", "edgepack_core")),
    ("the agent's own modules", lambda m: True),
    ("the session (digits)", lambda m: False),  # the agent's session options, its modules loaded
    (RELEASED := "given back once it serves (device_agent/memory.py)", lambda m: False),
]
SKIP = ("__main__", "sitecustomize", "_frozen_importlib", "_frozen_importlib_external")
# The child of the attribution: imports step by step, prints VmRSS (kB) after each step.
ATTRIBUTE = r"""
import importlib, json, re, sys
def rss():
    return int(re.search(r"VmRSS:\s+(\d+)", open("/proc/self/status").read()).group(1))
steps, model = json.loads(sys.stdin.read())
print(rss(), flush=True)
for names in steps:
    if names is None:  # the session, with the agent's own options
        import onnxruntime
        from device_agent.providers import session_options
        session = onnxruntime.InferenceSession(model, session_options(0), providers=["CPUExecutionProvider"])
    elif names == ["<release>"]:  # what the agent gives back once it serves (none before device_agent/memory.py)
        try:
            from device_agent.memory import release_startup_pages
        except ImportError:
            pass
        else:
            release_startup_pages()
    else:
        for name in names:
            try:
                importlib.import_module(name)
            except Exception:  # a module that only imports as part of another (aliases, shims)
                pass
    print(rss(), flush=True)
"""


def package(folder: Path) -> tuple[Path, Path]:
    """The digits demo built from code and packaged as tools/demo.sh does: (artifact, public key),
    in a child process: this one must not map onnxruntime or numpy, or the pages the agents
    share with it are never given back (the kernel leaves a page mapped twice alone)."""
    subprocess.run([sys.executable, __file__, "--package-into", str(folder)], check=True, timeout=600)
    return folder / "digits.edgepkg", folder / "release.pub"


def package_here(folder: Path) -> None:
    from sdk.keys import write_keypair
    from sdk.packager.pipeline import build
    from sdk.recipe import load_recipe
    from tools.demos import build_all

    key, pub = folder / "release.key", folder / "release.pub"
    write_keypair(key, pub)
    build_all(folder / "demo", only=["digits"])
    recipe = folder / "digits.yaml"
    recipe.write_text((ROOT / "recipes" / "digits.yaml").read_text().replace("../demo/", "demo/"))
    build(load_recipe(recipe), key_paths=[str(key)], output=folder / "digits.edgepkg")


def agent_yaml(folder: Path, artifact: Path, pub: Path, port: int, broker: int | None, extra: str = "") -> Path:
    lines = [
        f"device_id: demo-01\nstore: {folder / 'store'}\ntrust: [{pub}]\nprofile: x86\n",
        f'artifact: {artifact}\napi: {{listen: "127.0.0.1:{port}"}}\n',
    ]
    if broker is not None:
        lines.append(f"mqtt: {{host: 127.0.0.1, port: {broker}}}\n")
    lines.append(extra)
    path = folder / "agent.yaml"
    path.write_text("".join(lines))
    return path


def read_kib(pid: int) -> dict[str, int]:
    """VmRSS and Pss (kB) of a process."""
    fields = {}
    for name, line in (("VmRSS", s) for s in Path(f"/proc/{pid}/status").read_text().splitlines()):
        if line.startswith(name + ":"):
            fields[name] = int(line.split()[1])
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith(("Pss:", "Anonymous:", "Shared_Clean:")):
            fields[line.split(":")[0]] = int(line.split()[1])
    return fields


def by_mapping(pid: int, top: int = 10) -> dict[str, float]:
    """RSS (MiB) per mapping: anonymous memory (heap, arenas, stacks) and each file's pages."""
    totals: dict[str, int] = {}
    name = "[anonymous]"
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        parts = line.split()
        if parts and "-" in parts[0] and not parts[0].endswith(":"):
            name = parts[5].rsplit("/", 1)[-1] if len(parts) > 5 and parts[5].startswith("/") else "[anonymous]"
        elif parts and parts[0] == "Anonymous:":
            totals["[anonymous]"] = totals.get("[anonymous]", 0) + int(parts[1])
        elif parts and parts[0] == "Rss:" and name != "[anonymous]":
            totals[name] = totals.get(name, 0) + int(parts[1])
    ranked = sorted(totals.items(), key=lambda item: -item[1])
    shown = {key: round(value / KIB_PER_MIB, 1) for key, value in ranked[:top]}
    shown["other files"] = round(sum(value for _, value in ranked[top:]) / KIB_PER_MIB, 1)
    return shown


def wait_ready(proc: subprocess.Popen[bytes], port: int, deadline_s: float = 120) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the agent exited with {proc.returncode} before /healthz answered")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError("/healthz did not answer in time")


@contextmanager
def running_agent(code: Path, folder: Path, config: Path, env: dict[str, str]) -> Iterator[subprocess.Popen[bytes]]:
    hook = folder / "hook"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(HOOK)
    environ = {
        **os.environ,
        **env,
        "PYTHONPATH": os.pathsep.join(str(p) for p in (code, hook, *PRIVATE)),
        "EDGEPACK_RSS_MODULES": str(folder / "modules.txt"),
    }
    script = Path(sys.executable).with_name("edgepack-agent")
    proc = subprocess.Popen(
        [str(script), "run", "--config", str(config)],
        env=environ,
        stdout=subprocess.DEVNULL,
        stderr=(folder / "agent.log").open("wb"),
    )
    try:
        yield proc
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def loaded_modules(proc: subprocess.Popen[bytes], path: Path) -> list[str]:
    path.unlink(missing_ok=True)
    proc.send_signal(signal.SIGUSR1)
    deadline = time.monotonic() + 10
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)  # the handler runs when the main thread next wakes (at most 1 s)
    return path.read_text().split()


def predict(port: int, png: bytes) -> float:
    """One PNG prediction; its round trip in ms."""
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/predict", data=png, headers={"Content-Type": "image/png"}
    )
    began = time.perf_counter()
    with urllib.request.urlopen(request, timeout=30) as answer:
        answer.read()
    return (time.perf_counter() - began) * 1000


def samples(pid: int, count: int, interval: float) -> dict[str, float]:
    reads = []
    for index in range(count):
        if index:
            time.sleep(interval)
        reads.append(read_kib(pid))
    return {f"{key}_mib": round(statistics.median(r[key] for r in reads) / KIB_PER_MIB, 1) for key in reads[0]}


def measure(
    code: Path, folder: Path, inputs: dict[str, object], env: dict[str, str], args: argparse.Namespace
) -> dict[str, object]:
    """One agent from start to stop: idle after start, idle after requests, modules, mappings."""
    folder.mkdir(parents=True)
    port = free_port()
    env = dict(env)
    config = agent_yaml(folder, inputs["artifact"], inputs["pub"], port, inputs.get("broker"), env.pop(YAML, ""))
    with running_agent(code, folder, config, env) as proc:
        wait_ready(proc, port)
        time.sleep(args.settle)  # idling: nothing is asked of it
        started = samples(proc.pid, args.samples, args.interval)
        modules = loaded_modules(proc, folder / "modules.txt")
        latencies = [predict(port, inputs["png"]) for _ in range(args.requests)]
        time.sleep(args.settle)
        served = samples(proc.pid, args.samples, args.interval)
        mappings = by_mapping(proc.pid)
        later = sorted({m.split(".")[0] for m in set(loaded_modules(proc, folder / "modules.txt")) - set(modules)})
        threads = len(os.listdir(f"/proc/{proc.pid}/task"))
    return {
        "idle": started,
        "after_requests": served,
        "mappings": mappings,
        "threads": threads,
        "modules": modules,
        "loaded_by_requests": later,
        "latency_ms": {
            "first": round(latencies[0], 2),
            "median_of_the_rest": round(statistics.median(latencies[1:]), 2),
        },
    }


def attribute(code: Path, modules: list[str], model: Path, runs: int, release: bool = True) -> dict[str, float]:
    """What each component adds, in COMPONENTS' order, medians over ``runs`` fresh interpreters."""
    left = [name for name in modules if name not in SKIP]
    steps: list[list[str] | None] = []
    for label, takes in COMPONENTS:
        if label == RELEASED:
            steps.append(["<release>"] if release else [])
            continue
        steps.append(None if label.startswith("the session") else [m for m in left if takes(m)])
        left = [m for m in left if not takes(m)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(p) for p in (code, *PRIVATE))}
    series = []
    for _ in range(runs):
        done = subprocess.run(
            [sys.executable, "-c", ATTRIBUTE],
            input=json.dumps([steps, str(model)]),
            env=env,
            capture_output=True,
            text=True,
            check=True,
            timeout=300,
        )
        series.append([int(line) for line in done.stdout.split()])
    rss = [statistics.median(run[index] for run in series) for index in range(len(series[0]))]
    parts = [("interpreter", rss[0] / KIB_PER_MIB)]
    parts += [(label, (rss[i + 1] - rss[i]) / KIB_PER_MIB) for i, (label, _) in enumerate(COMPONENTS)]
    return {label: round(value, 1) for label, value in parts}


def private_copy(folder: Path) -> Path:
    """A copy of the packages with large native libraries (new inodes: their pages are this copy's alone)."""
    import shutil

    import numpy

    site = Path(numpy.__file__).parents[1]
    for name in PRIVATE_PACKAGES:
        if (site / name).is_dir():
            shutil.copytree(site / name, folder / name, symlinks=True)
    for library in site.glob("_cffi_backend*.so"):  # PyNaCl's binding
        shutil.copy2(library, folder / library.name)
    return folder


def code_at(rev: str, folder: Path) -> Path:
    """The device packages as of ``rev`` (git archive), to run beside this checkout's."""
    folder.mkdir(parents=True)
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", rev, "device_agent", "edgepack_core"], capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
    return folder


def median_of(runs: list[dict[str, object]], key: str) -> dict[str, float]:
    return {field: round(statistics.median(r[key][field] for r in runs), 1) for field in runs[0][key]}


def releases(code: Path, env: dict[str, str]) -> bool:
    """Whether an agent gives start-up pages back: its code has device_agent/memory.py (the
    attribution must not take it from this checkout through the editable install) and its
    agent.yaml does not turn it off."""
    return (code / "device_agent" / "memory.py").exists() and env.get(YAML) != KEEP_PAGES


def summary(
    runs: list[dict[str, object]], code: Path, model: Path, attribution_runs: int, release: bool = True
) -> dict[str, object]:
    """One agent's figures: medians over rounds, its last round's mappings and modules, per component."""
    last = runs[-1]
    idle = median_of(runs, "idle")
    components = attribute(code, last["modules"], model, attribution_runs, release)
    components["the agent's state"] = round(idle["VmRSS_mib"] - sum(components.values()), 1)
    return {
        "idle": idle,
        "idle_after_requests": median_of(runs, "after_requests"),
        "latency_ms": median_of(runs, "latency_ms"),
        "threads": last["threads"],
        "mappings_mib": last["mappings"],
        "components_mib": components,
        "loaded_by_requests": last["loaded_by_requests"],
        "modules": len(last["modules"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--samples", type=int, default=5)
    parser.add_argument("--interval", type=float, default=0.5)
    parser.add_argument("--settle", type=float, default=3.0, help="seconds of idling before the samples")
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--mqtt", action="store_true", help="with a real mosquitto and the mqtt: section")
    parser.add_argument("--before", help="also measure the agent as of this git revision (or in this folder)")
    parser.add_argument("--env", action="append", default=[], help="also measure this agent with NAME=VALUE set")
    parser.add_argument("--attribution-runs", type=int, default=3)
    parser.add_argument(
        "--private-libs",
        action="store_true",
        help="run the agents on their own copy of onnxruntime and numpy, so no other process on this machine "
        "maps the same pages (as on a device that runs only the agent)",
    )
    parser.add_argument(
        "--keep-pages", action="store_true", help="also measure this agent with memory.release_startup_pages: false"
    )
    parser.add_argument(
        "--session-options",
        action="store_true",
        help="also compare onnxruntime's memory arena and memory pattern on the model, side by side",
    )
    parser.add_argument("--package-into", type=Path, help=argparse.SUPPRESS)  # the child of package()
    args = parser.parse_args()
    if args.package_into:
        package_here(args.package_into)
        return
    with tempfile.TemporaryDirectory(prefix="agent-rss-") as tmp:
        folder = Path(tmp)
        artifact, pub = package(folder)
        if args.private_libs:
            PRIVATE.append(private_copy(folder / "private"))
        png = next(iter(sorted((folder / "demo" / "digits" / "val").glob("*.png")))).read_bytes()
        agents: dict[str, tuple[Path, dict[str, str]]] = {"this checkout": (ROOT, {})}
        if args.before:
            before = Path(args.before) if Path(args.before).is_dir() else code_at(args.before, folder / "before")
            agents[f"before ({args.before})"] = (before, {})
        if args.keep_pages:
            agents["this checkout, memory.release_startup_pages: false"] = (ROOT, {YAML: KEEP_PAGES})
        for assignment in args.env:
            name, _, value = assignment.partition("=")
            agents[f"this checkout, {assignment}"] = (ROOT, {name: value})
        broker = start_mosquitto(workdir=folder / "mosquitto") if args.mqtt else None
        try:
            inputs = {"artifact": artifact, "pub": pub, "png": png, "broker": broker.port if broker else None}
            runs: dict[str, list[dict[str, object]]] = {name: [] for name in agents}
            for round_index in range(args.rounds):
                for index, (name, (code, env)) in enumerate(agents.items()):
                    runs[name].append(measure(code, folder / f"r{round_index}-{index}", inputs, env, args))
                    print(name, json.dumps(runs[name][-1]["idle"]), file=sys.stderr, flush=True)
            model = next((folder / "r0-0" / "store" / "models").glob("*/model/model.onnx"))
            report = {
                name: summary(runs[name], code, model, args.attribution_runs, releases(code, env))
                for name, (code, env) in agents.items()
            }
            sessions = session_options_side_by_side(model, args.rounds) if args.session_options else None
        finally:
            if broker is not None:
                broker.stop()
    print(
        json.dumps(
            {
                "command": " ".join(sys.argv),
                "mqtt": args.mqtt,
                "rounds": args.rounds,
                "agents": report,
                "session_options": sessions,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
