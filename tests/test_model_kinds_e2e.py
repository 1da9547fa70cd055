"""Real model kinds end to end (issue 15): models trained and exported with torch
(tools/demos: a YOLOv8-style detector, a CTC recognizer, a stateful LSTM VAD, a model with
literal -1 dims, a classifier ending in Softmax), each built from its recipe in recipes/ with
`edgepack build` (int8 where it applies), checked by `edgepack verify`, and served through the
agent's CLI (`edgepack-agent predict --json`), its Python API (`device_agent.runtime`) and its
HTTP `/predict` on a running `edgepack-agent run`. Every served task result is checked against
an independent reference (tests/model_kinds.py): the drawn boxes and a brute-force decode of the
fp32 torch output, the rendered strings, the torch LSTM run frame by frame, torch's probabilities.

The int8 rule of the issue is asserted as a rule: an artifact whose manifest says int8 keeps
the budget on the task metric, measured here again independently of the build (detector recall
and precision against fp32 at IoU 0.5 >= 0.95, recognizer per-step agreement >= 0.99,
classifier top-1 within 1 point), or the artifact is fp32 and the build said why in one line.

Whether a recipe above ships int8 also rests on the speed rule (``quantize.min_speedup`` 1.0),
which this machine's timing decides; variants of the detector and recognizer recipes with
``min_speedup: 0`` take timing out, so int8 ships whenever it keeps the budget and is served
through the CLI, the Python API and HTTP against the same references (or the build said in
one line why the budget refused it). ``validate.min_string_match`` refusing the recognizer's
int8 on noisy images whose steps still agree is built through the CLI here too.

The demos are trained once per checkout (tools/demos/cache.py keys them by their source) and
built once per session here."""

from __future__ import annotations

import io
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from PIL import Image

from tests.conftest import run_cli
from tests.model_kinds import (
    AgentDaemon,
    artifact_member,
    ctc_greedy,
    cut_frames,
    gray_tensor,
    ground_truth,
    iou,
    letterbox,
    matched,
    read_wav_16bit,
    softmax,
    to_original,
    yolo_detections,
)
from tools.demos import build_torch_demos, dynamic_dims, lstm_vad, ocr_ctc, softmax_classifier, yolo

torch = pytest.importorskip("torch", reason="the model-kind demos are trained with torch (installed in CI)")

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parent.parent
RECIPES = ("yolo-int8", "ocr-int8", "lstm-vad", "points", "orientation-int8")
# How far an int8 detector's score may move from fp32's on a box both find. The issue's budget
# is recall and precision at IoU 0.5; a score that moved further than this has collapsed (one
# quantization step of a head whose pixel boxes set the range is 0.2 to 1.3).
SCORE_SHIFT = 0.1


@dataclass
class Built:
    artifact: Path
    manifest: dict[str, Any]
    report: dict[str, Any]
    log: str   # what `edgepack build` printed

    @property
    def precision(self) -> str:
        return self.manifest["model"]["precision"]

    def model_bytes(self) -> bytes:
        return artifact_member(self.artifact, "model/model.onnx")


@pytest.fixture(scope="session")
def workspace(tmp_path_factory) -> Path:
    """demo/ with the trained models and their data, recipes/ as the repository has them."""
    root = tmp_path_factory.mktemp("kinds")
    build_torch_demos(root / "demo")
    (root / "recipes").mkdir()
    for name in RECIPES:
        shutil.copy(REPO / "recipes" / f"{name}.yaml", root / "recipes")
    return root


@pytest.fixture(scope="session")
def built(workspace, keypair):
    """``built(recipe)``: the artifact of ``recipes/<recipe>.yaml``, built once by the CLI."""
    done: dict[str, Built] = {}

    def get(recipe: str) -> Built:
        if recipe not in done:
            artifact = workspace / "dist" / f"{recipe}.edgepkg"
            run = run_cli("edgepack", "build", str(workspace / "recipes" / f"{recipe}.yaml"),
                          "--allow-external-paths", "--key", str(keypair[0]), "--output", str(artifact), timeout=900)
            assert run.returncode == 0, run.stderr[-3000:]
            done[recipe] = Built(artifact, json.loads(artifact_member(artifact, "manifest.json")),
                                 json.loads(artifact_member(artifact, "report.json")), run.stdout + run.stderr)
        return done[recipe]

    return get


@pytest.fixture(scope="session")
def agent(workspace, built, keypair):
    """``agent(recipe)``: an `edgepack-agent run` daemon serving that artifact (one per recipe)."""
    daemons: dict[str, AgentDaemon] = {}

    def get(recipe: str) -> AgentDaemon:
        if recipe not in daemons:
            daemons[recipe] = AgentDaemon(workspace / "agents" / recipe, built(recipe).artifact, keypair[1])
        return daemons[recipe]

    yield get
    for daemon in daemons.values():
        daemon.stop()


@pytest.fixture(scope="session")
def service(workspace, built, keypair):
    """``service(recipe)``: the Python API on the verified, extracted artifact."""
    from device_agent.runtime import InferenceService, load_model
    from edgepack_core.artifact import extract_artifact
    from edgepack_core.signing import TrustStore, load_public_key

    services: dict[str, InferenceService] = {}

    def get(recipe: str) -> InferenceService:
        if recipe not in services:
            verified = extract_artifact(built(recipe).artifact, workspace / "extracted" / recipe,
                                        TrustStore([load_public_key(keypair[1])]))
            services[recipe] = InferenceService(load_model(verified.root, verified.manifest))
        return services[recipe]

    return get


def torch_model(module, folder: Path):
    model = module.make_model()
    model.load_state_dict(torch.load(folder / "model.pt"))
    return model.eval()


def run_onnx(model: bytes, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
    import onnxruntime as ort

    session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    return session.run(None, feed)


def cli_predict(built: Built, trust: Path, path: Path, *extra: str) -> dict[str, Any]:
    run = run_cli("edgepack-agent", "predict", "--artifact", str(built.artifact), "--trust", str(trust),
                  "--input", str(path), "--json", *extra)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)


def assert_int8_keeps_the_budget_or_fp32_says_why(built: Built, measured: float | None, floor: float) -> None:
    """The issue's rule: int8 only with the task metric within budget (``measured``, computed by
    the test on the shipped graph), else fp32 with one line saying why."""
    quantize = built.report["passes"]["quantize"]
    if built.precision == "int8":
        assert quantize["applied"] is True
        assert measured is not None and measured >= floor, f"int8 shipped with task metric {measured} < {floor}"
    else:
        assert built.precision == "fp32" and quantize["applied"] is False
        reasons = [w for w in built.report["warnings"] if "shipping fp32" in w]
        assert len(reasons) == 1 and "\n" not in reasons[0], built.report["warnings"]
        assert reasons[0] in built.log  # and the build printed it


def test_every_artifact_verifies(built, keypair):
    for recipe in RECIPES:
        run = run_cli("edgepack", "verify", str(built(recipe).artifact), "--trust", str(keypair[1]))
        assert run.returncode == 0, (recipe, run.stderr)


# ----------------------------------------------------------------------------- detector


def _detector_reference(workspace: Path) -> dict[str, dict[str, Any]]:
    """Per validation image: the letterbox geometry, the fp32 torch head, its brute-force
    detections in original pixels, and the drawn boxes."""
    folder = workspace / "demo" / "yolo"
    model = torch_model(yolo, folder)
    truth = json.loads((folder / "val" / "boxes.json").read_text())
    reference = {}
    for name, boxes in truth.items():
        image = Image.open(folder / "val" / name)
        tensor, *geometry = letterbox(image, yolo.SIZE, yolo.PAD_VALUE)
        with torch.no_grad():
            head = model(torch.from_numpy(tensor)).numpy()[0]
        reference[name] = {"tensor": tensor, "head": head, "truth": ground_truth(boxes), "size": image.size,
                           "torch": to_original(yolo_detections(head), tuple(geometry), *image.size)}
    return reference


@pytest.fixture(scope="session")
def detector_reference(workspace):
    return _detector_reference(workspace)


def _agreement(found: list[list[dict]], expected: list[list[dict]]) -> tuple[float, float]:
    hits = sum(matched(f, e) for f, e in zip(found, expected, strict=True))
    return hits / max(sum(map(len, expected)), 1), hits / max(sum(map(len, found)), 1)


def _worst_score_shift(found: list[list[dict]], expected: list[list[dict]]) -> float:
    """The largest score difference between a found box and the reference box of its class
    it overlaps most (IoU >= 0.5): a sigmoid score that collapsed onto one quantization step
    (the issue's 1.268) shows here while recall and precision stay perfect."""
    worst = 0.0
    for boxes, references in zip(found, expected, strict=True):
        for box in boxes:
            twins = [(iou(box["box"], r["box"]), r) for r in references if r["index"] == box["index"]]
            overlap, twin = max(twins, key=lambda pair: pair[0], default=(0.0, None))
            if twin is not None and overlap >= 0.5:
                worst = max(worst, abs(box["score"] - twin["score"]))
    return worst


def test_detector_int8_keeps_recall_and_scores_against_fp32_or_ships_fp32_saying_why(built, detector_reference):
    artifact = built("yolo-int8")
    shipped = [yolo_detections(run_onnx(artifact.model_bytes(), {"images": r["tensor"]})[0][0])
               for r in detector_reference.values()]
    fp32 = [yolo_detections(r["head"]) for r in detector_reference.values()]
    recall, precision = _agreement(shipped, fp32)
    scores = [d["score"] for boxes in shipped for d in boxes]
    if artifact.precision == "int8":  # scores are sigmoid probabilities: in [0, 1], near fp32's
        assert all(0.0 <= s <= 1.0 for s in scores) and _worst_score_shift(shipped, fp32) <= SCORE_SHIFT, \
            f"int8 detector shipped with collapsed scores: {sorted(set(round(s, 3) for s in scores))[:8]}"
    assert_int8_keeps_the_budget_or_fp32_says_why(artifact, min(recall, precision), 0.95)


def test_detector_torch_reference_finds_the_drawn_shapes(detector_reference):
    recall, precision = _agreement([r["torch"] for r in detector_reference.values()],
                                   [r["truth"] for r in detector_reference.values()])
    assert recall >= 0.9 and precision >= 0.9


def _same_detections(served: list[dict], reference: list[dict], exact: bool) -> None:
    """Served boxes (original pixels) against the reference: one to one, same class; for an
    fp32 artifact the same boxes and scores, for int8 at IoU >= 0.5 with scores near fp32's."""
    assert len(served) == len(reference)
    assert matched(served, reference, 0.99 if exact else 0.5) == len(reference)
    if exact:
        for got, want in zip(sorted(served, key=lambda d: -d["score"]), reference, strict=True):
            assert got["index"] == want["index"] and got["score"] == pytest.approx(want["score"], abs=1e-4)
            assert got["box"] == pytest.approx(want["box"], abs=0.02)
    else:
        assert _worst_score_shift([served], [reference]) <= SCORE_SHIFT


def test_detector_served_by_python_api_finds_the_drawn_boxes_and_matches_torch(built, service, workspace,
                                                                               detector_reference):
    api = service("yolo-int8")
    exact = built("yolo-int8").precision == "fp32"
    served = {}
    for name, reference in detector_reference.items():
        answer = api.predict((workspace / "demo" / "yolo" / "val" / name).read_bytes())
        assert {d["label"] for d in answer.result} <= set(yolo.CLASSES)
        assert all(d["label"] == yolo.CLASSES[d["index"]] for d in answer.result)
        _same_detections(answer.result, reference["torch"], exact)
        served[name] = answer.result
    recall, precision = _agreement(list(served.values()), [r["truth"] for r in detector_reference.values()])
    assert recall >= 0.9 and precision >= 0.9


def test_detector_cli_and_http_answer_boxes_in_original_pixels(built, agent, service, workspace, keypair,
                                                               detector_reference):
    name = next(n for n, r in detector_reference.items() if r["size"][0] != r["size"][1] and len(r["truth"]) >= 2)
    path = workspace / "demo" / "yolo" / "val" / name
    reference = detector_reference[name]
    expected = service("yolo-int8").predict(path.read_bytes()).result
    by_cli = cli_predict(built("yolo-int8"), keypair[1], path)
    by_http = agent("yolo-int8").predict(path.read_bytes(), "image/png")
    for answer in (by_cli, by_http):
        assert "outputs" not in answer  # the task result only, not the raw head
        assert answer["geometry"]["original_size"] == [reference["size"][1], reference["size"][0]]
        assert answer["result"] == expected
        assert matched(answer["result"], reference["truth"]) == len(reference["truth"])


# ----------------------------------------------------------------------------- recognizer


@pytest.fixture(scope="session")
def recognizer_reference(workspace):
    folder = workspace / "demo" / "ocr"
    model = torch_model(ocr_ctc, folder)
    texts = json.loads((folder / "val" / "texts.json").read_text())
    reference = {}
    for name, text in texts.items():
        tensor = gray_tensor(folder / "val" / name)
        with torch.no_grad():
            probs = model(torch.from_numpy(tensor)).numpy()[0]
        reference[name] = {"tensor": tensor, "probs": probs, "text": text,
                           "torch_text": ctc_greedy(probs, ocr_ctc.CHARSET)}
    return reference


def test_recognizer_int8_keeps_per_step_agreement_or_ships_fp32_saying_why(built, recognizer_reference):
    artifact = built("ocr-int8")
    agree = total = 0
    for reference in recognizer_reference.values():
        probs = run_onnx(artifact.model_bytes(), {"x": reference["tensor"]})[0][0]
        agree += int((probs.argmax(-1) == reference["probs"].argmax(-1)).sum())
        total += len(probs)
    assert_int8_keeps_the_budget_or_fp32_says_why(artifact, agree / total, 0.99)


def test_recognizer_reads_the_rendered_strings_through_the_python_api(service, workspace, recognizer_reference):
    api = service("ocr-int8")
    right = 0
    for name, reference in recognizer_reference.items():
        result = api.predict((workspace / "demo" / "ocr" / "val" / name).read_bytes()).result
        assert result["text"] == reference["torch_text"]
        right += result["text"] == reference["text"]
    assert right >= 0.95 * len(recognizer_reference)


def test_recognizer_cli_and_http_read_the_string_with_the_models_own_probability(built, agent, workspace, keypair,
                                                                                  recognizer_reference):
    name, reference = next((n, r) for n, r in recognizer_reference.items() if r["torch_text"] == r["text"])
    path = workspace / "demo" / "ocr" / "val" / name
    probs = reference["probs"]
    kept = [i for i, c in enumerate(probs.argmax(-1)) if c != 0 and (i == 0 or c != probs[i - 1].argmax())]
    score = float(np.mean(probs.max(-1)[kept]))  # the graph ends in Softmax: its own probabilities
    tolerance = 1e-4 if built("ocr-int8").precision == "fp32" else 0.05
    for answer in (cli_predict(built("ocr-int8"), keypair[1], path), agent("ocr-int8").predict(path.read_bytes(),
                                                                                               "image/png")):
        assert answer["result"]["text"] == reference["text"]
        assert answer["result"]["score"] == pytest.approx(score, abs=tolerance)
    assert built("ocr-int8").manifest["postprocess"]["apply_softmax"] is False


# ----------------------------------------------------------------------------- int8 forced to ship

# The real recipe with quantize.min_speedup 0: int8 ships whenever it keeps the accuracy budget,
# however this machine times it. Named apart, so the CLI and HTTP answers say which artifact.
FORCED_SUFFIX = "-min-speedup-0"
QDQ_OPS = {"QuantizeLinear", "DequantizeLinear"}
DYNAMIC_OPS = {"DynamicQuantizeLinear", "MatMulInteger", "ConvInteger"}


@pytest.fixture(scope="session")
def forced(workspace):
    """``forced(recipe)``: the name of ``recipes/<recipe>.yaml`` rewritten into the workspace
    with ``quantize.min_speedup: 0`` (for ``built``, ``service`` and ``agent``)."""

    def get(recipe: str) -> str:
        name = recipe + FORCED_SUFFIX
        path = workspace / "recipes" / f"{name}.yaml"
        if not path.exists():
            doc = yaml.safe_load((REPO / "recipes" / f"{recipe}.yaml").read_text())
            doc["name"] = name
            doc["quantize"]["min_speedup"] = 0
            path.write_text(yaml.safe_dump(doc, sort_keys=False))
        return name

    return get


def _refused_on_accuracy(artifact: Built) -> str:
    """The one line of a forced build that shipped fp32: the accuracy budget (missed, or met on
    too little validation data to show it), never the speed."""
    reasons = [w for w in artifact.report["warnings"] if "shipping fp32" in w]
    accuracy = ("could not meet the accuracy budget", "on too little validation data to show it")
    assert len(reasons) == 1 and any(why in reasons[0] for why in accuracy), reasons
    return reasons[0]


def _assert_forced_int8_graph(artifact: Built) -> None:
    """An int8 manifest over a graph that holds quantized ops (QDQ, or the dynamic ones)."""
    import onnx

    quantize = artifact.report["passes"]["quantize"]
    assert quantize["min_speedup"] == 0 and quantize["applied"] is True
    assert artifact.manifest["model"]["precision"] == "int8"
    ops = {node.op_type for node in onnx.load_from_string(artifact.model_bytes()).graph.node}
    assert ops >= QDQ_OPS or ops & DYNAMIC_OPS, f"an int8 manifest over a graph of {sorted(ops)}"


def _int8_or_skip(artifact: Built) -> None:
    if artifact.precision != "int8":
        pytest.skip(f"the search refused int8 on accuracy (its gate test checks the line): "
                    f"{_refused_on_accuracy(artifact)}")


def test_forced_detector_ships_quantized_int8_keeping_recall_against_fp32_or_says_why(forced, built,
                                                                                      detector_reference):
    artifact = built(forced("yolo-int8"))
    assert artifact.report["passes"]["quantize"]["min_speedup"] == 0
    shipped = [yolo_detections(run_onnx(artifact.model_bytes(), {"images": r["tensor"]})[0][0])
               for r in detector_reference.values()]
    fp32 = [yolo_detections(r["head"]) for r in detector_reference.values()]
    recall, precision = _agreement(shipped, fp32)
    if artifact.precision == "int8":
        _assert_forced_int8_graph(artifact)
        scores = [d["score"] for boxes in shipped for d in boxes]
        assert scores and all(0.0 <= s <= 1.0 for s in scores)
        assert _worst_score_shift(shipped, fp32) <= SCORE_SHIFT, "int8 detector shipped with collapsed scores"
    else:
        _refused_on_accuracy(artifact)
    assert_int8_keeps_the_budget_or_fp32_says_why(artifact, min(recall, precision), 0.95)


def test_forced_int8_detector_served_by_cli_api_and_http_finds_the_drawn_boxes(forced, built, service, agent,
                                                                               workspace, keypair,
                                                                               detector_reference):
    recipe = forced("yolo-int8")
    artifact = built(recipe)
    _int8_or_skip(artifact)
    folder = workspace / "demo" / "yolo" / "val"
    served = {name: service(recipe).predict((folder / name).read_bytes()).result for name in detector_reference}
    found, torch_found = list(served.values()), [r["torch"] for r in detector_reference.values()]
    # The budget on what the Python API serves: recall (and precision) against the
    # fp32 torch detections at IoU 0.5, scores where fp32 put them; and the drawn boxes found.
    recall, precision = _agreement(found, torch_found)
    assert recall >= 0.95 and precision >= 0.95, (recall, precision)
    assert _worst_score_shift(found, torch_found) <= SCORE_SHIFT
    assert all(d["label"] == yolo.CLASSES[d["index"]] for boxes in found for d in boxes)
    recall, precision = _agreement(found, [r["truth"] for r in detector_reference.values()])
    assert recall >= 0.9 and precision >= 0.9, (recall, precision)
    # HTTP answers every image as the API does; the CLI one non-square image, in original pixels.
    daemon = agent(recipe)
    for name in detector_reference:
        answer = daemon.predict((folder / name).read_bytes(), "image/png")
        assert answer["model"]["name"] == recipe and answer["result"] == served[name], name
    name = next(n for n, r in detector_reference.items() if r["size"][0] != r["size"][1] and len(r["truth"]) >= 2
                and matched(served[n], r["truth"]) == len(r["truth"]))
    by_cli = cli_predict(artifact, keypair[1], folder / name)
    assert by_cli["model"]["name"] == recipe and by_cli["result"] == served[name]
    size = detector_reference[name]["size"]
    assert by_cli["geometry"]["original_size"] == [size[1], size[0]]


def _step_agreement(probs: list[np.ndarray], reference: list[np.ndarray]) -> float:
    agree = sum(int((p.argmax(-1) == r.argmax(-1)).sum()) for p, r in zip(probs, reference, strict=True))
    return agree / sum(len(r) for r in reference)


def test_forced_recognizer_ships_quantized_int8_keeping_per_step_agreement_or_says_why(forced, built,
                                                                                       recognizer_reference):
    artifact = built(forced("ocr-int8"))
    assert artifact.report["passes"]["quantize"]["min_speedup"] == 0
    probs = [run_onnx(artifact.model_bytes(), {"x": r["tensor"]})[0][0] for r in recognizer_reference.values()]
    agreement = _step_agreement(probs, [r["probs"] for r in recognizer_reference.values()])
    if artifact.precision == "int8":
        _assert_forced_int8_graph(artifact)
    else:
        _refused_on_accuracy(artifact)
    assert_int8_keeps_the_budget_or_fp32_says_why(artifact, agreement, 0.99)


def test_forced_int8_recognizer_served_by_cli_api_and_http_reads_the_rendered_strings(forced, built, service, agent,
                                                                                      workspace, keypair,
                                                                                      recognizer_reference):
    recipe = forced("ocr-int8")
    artifact = built(recipe)
    _int8_or_skip(artifact)
    folder = workspace / "demo" / "ocr" / "val"
    served = {name: service(recipe).predict((folder / name).read_bytes()) for name in recognizer_reference}
    # The budget on the served probabilities (per-step argmax against torch fp32), and
    # the strings read are the rendered ones (an int8 model that collapsed reads none of them).
    agreement = _step_agreement([a.outputs["probs"][0] for a in served.values()],
                                [r["probs"] for r in recognizer_reference.values()])
    assert agreement >= 0.99, agreement
    texts = {name: answer.result["text"] for name, answer in served.items()}
    right = sum(texts[n] == r["text"] for n, r in recognizer_reference.items())
    assert right >= 0.95 * len(recognizer_reference), texts
    assert sum(texts[n] == r["torch_text"] for n, r in recognizer_reference.items()) >= 0.95 * len(texts)
    daemon = agent(recipe)
    for name in recognizer_reference:
        answer = daemon.predict((folder / name).read_bytes(), "image/png")
        assert answer["model"]["name"] == recipe and answer["result"] == served[name].result, name
    name, reference = next((n, r) for n, r in recognizer_reference.items() if texts[n] == r["text"])
    probs = reference["probs"]
    kept = [i for i, c in enumerate(probs.argmax(-1)) if c != 0 and (i == 0 or c != probs[i - 1].argmax())]
    by_cli = cli_predict(artifact, keypair[1], folder / name)
    assert by_cli["model"]["name"] == recipe and by_cli["result"] == served[name].result
    assert by_cli["result"]["text"] == reference["text"]
    assert by_cli["result"]["score"] == pytest.approx(float(np.mean(probs.max(-1)[kept])), abs=0.05)


# ----------------------------------------------------------------------------- min_string_match


def _noisy_copies(source: Path, folder: Path, sigma: float) -> Path:
    """The validation images with Gaussian noise (fixed seed): steps the fp32 model reads with
    less margin, where int8 flips a few steps and so a few strings."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for path in sorted(source.glob("*.png")):
        pixels = np.asarray(Image.open(path).convert("L"), np.float32)
        noisy = np.clip(pixels + rng.normal(0.0, sigma, pixels.shape), 0, 255).astype(np.uint8)
        Image.fromarray(noisy).save(folder / path.name)
    return folder


def test_min_string_match_refuses_int8_whose_steps_agree_but_strings_do_not(workspace, keypair):
    """On noisy images the requested int8 candidate keeps per-step agreement (>= 0.95 here) but
    reads fewer strings as fp32 does: reported only by default (int8 ships), refused in one
    line naming the string match when the recipe sets ``validate.min_string_match``."""
    noisy = _noisy_copies(workspace / "demo" / "ocr" / "val", workspace / "demo" / "ocr" / "noisy-val", 60.0)
    doc = yaml.safe_load((REPO / "recipes" / "ocr-int8.yaml").read_text())
    doc["quantize"].update(min_speedup=0, search=False)  # the one candidate; speed out of the outcome
    doc["validate"] = {"data": {"images": f"../demo/ocr/{noisy.name}"}, "min_agreement": 0.95}
    results = {}
    for name, extra in (("reported", {}), ("gated", {"min_string_match": 0.95})):
        recipe = workspace / "recipes" / f"ocr-string-match-{name}.yaml"
        recipe.write_text(yaml.safe_dump({**doc, "validate": {**doc["validate"], **extra}}, sort_keys=False))
        artifact = workspace / "dist" / f"ocr-string-match-{name}.edgepkg"
        run = run_cli("edgepack", "build", str(recipe), "--allow-external-paths", "--key", str(keypair[0]),
                      "--output", str(artifact), timeout=600)
        assert run.returncode == 0, run.stderr[-3000:]
        results[name] = (json.loads(artifact_member(artifact, "manifest.json")),
                         json.loads(artifact_member(artifact, "report.json")), run.stdout + run.stderr)
    manifest, report, _ = results["reported"]
    task = report["passes"]["quantize"]["candidates"][0]["task"]["outputs"][0]
    assert manifest["model"]["precision"] == "int8"
    assert task["step_agreement"] >= 0.95 and task["string_match"] < 0.95, task  # the gap the key closes
    manifest, report, log = results["gated"]
    quantize = report["passes"]["quantize"]
    assert manifest["model"]["precision"] == "fp32" and quantize["applied"] is False
    assert quantize["candidates"][0]["task"]["outputs"][0]["string_match"] == task["string_match"]
    reasons = [w for w in report["warnings"] if "shipping fp32" in w]
    assert len(reasons) == 1 and "\n" not in reasons[0] and reasons[0] in log
    assert f"output probs: string match {task['string_match']:.4g} (required >= 0.95), short by" in reasons[0]


# ----------------------------------------------------------------------------- stateful LSTM


@pytest.fixture(scope="session")
def vad_torch(workspace):
    model = torch_model(lstm_vad, workspace / "demo" / "lstm_vad")

    def run(frames: np.ndarray, state: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Frame by frame, carrying the state: (outputs [n, 1, 1], final state)."""
        current = torch.zeros(2, 1, lstm_vad.HIDDEN) if state is None else torch.from_numpy(state)
        outputs = []
        with torch.no_grad():
            for frame in frames:
                out, current = model(torch.from_numpy(frame), current, torch.tensor(16000))
                outputs.append(out.numpy())
        return np.stack(outputs), current.numpy()

    return run


def _clip(workspace: Path) -> tuple[Path, np.ndarray]:
    path = workspace / "demo" / "lstm_vad" / "audio" / "talk-16k-pcm16.wav"
    samples, rate = read_wav_16bit(path)
    assert rate == 16000
    return path, samples


def test_lstm_vad_cli_runs_a_wav_frame_by_frame_as_torch_does(built, workspace, keypair, vad_torch):
    path, samples = _clip(workspace)
    expected, final = vad_torch(cut_frames(samples, 512, 64))
    answer = cli_predict(built("lstm-vad"), keypair[1], path)
    assert built("lstm-vad").precision == "fp32"
    np.testing.assert_allclose(np.asarray(answer["outputs"]["output"]), expected, atol=1e-4)
    np.testing.assert_allclose(np.asarray(answer["outputs"]["stateN"])[-1], final, atol=1e-4)
    truth = lstm_vad.demo_clips()["talk-16k-pcm16.wav"][3]
    voiced = np.asarray(answer["outputs"]["output"])[:, 0, 0] > 0.5
    assert (voiced == truth[:len(voiced)]).mean() >= 0.9  # and it finds the voiced stretches


def test_lstm_vad_python_api_streams_carry_the_state_and_reset_forgets_it(service, workspace, vad_torch):
    api = service("lstm-vad")
    _, samples = _clip(workspace)
    frames = cut_frames(samples, 512, 64)
    expected, _ = vad_torch(frames)
    for i, frame in enumerate(frames):
        got = api.predict_tensors({"input": frame}, stream="mic-1").outputs["output"]
        np.testing.assert_allclose(got, expected[i], atol=1e-4)
    carried = vad_torch(frames[:8])[1]
    assert api.reset_stream("mic-1") is True
    again = api.predict_tensors({"input": frames[7]}, stream="mic-1").outputs
    output, state = vad_torch(frames[7:8])  # from zeros again ...
    np.testing.assert_allclose(again["output"], output[0], atol=1e-4)
    np.testing.assert_allclose(again["stateN"], state, atol=1e-4)
    assert np.abs(again["stateN"] - carried).max() > 0.05  # ... which is not where the carried state was


def _wav_bytes(samples: np.ndarray, folder: Path) -> bytes:
    from tools.demos.vad import write_wav

    return write_wav(folder / f"part-{len(samples)}.wav", samples, 16000, encoding="pcm16").read_bytes()


def test_lstm_vad_http_stream_continues_across_two_wav_bodies(agent, workspace, vad_torch, tmp_path):
    _, samples = _clip(workspace)
    first, second = samples[:512 * 6], samples[512 * 6:]
    daemon = agent("lstm-vad")
    one = daemon.predict(_wav_bytes(first, tmp_path), "audio/wav", **{"X-Edgepack-Stream": "door-3"})
    two = daemon.predict(_wav_bytes(second, tmp_path), "audio/wav", **{"X-Edgepack-Stream": "door-3"})
    # Each body is cut on its own (its first frame has zero context); the state goes on.
    expected_one, state = vad_torch(cut_frames(first, 512, 64))
    expected_two, _ = vad_torch(cut_frames(second, 512, 64), state)
    np.testing.assert_allclose(np.asarray(one["outputs"]["output"]), expected_one, atol=1e-4)
    np.testing.assert_allclose(np.asarray(two["outputs"]["output"]), expected_two, atol=1e-4)
    fresh = daemon.predict(_wav_bytes(second, tmp_path), "audio/wav")  # no stream: from init
    np.testing.assert_allclose(np.asarray(fresh["outputs"]["output"]), vad_torch(cut_frames(second, 512, 64))[0],
                               atol=1e-4)


# ----------------------------------------------------------------------------- -1 dims


@pytest.fixture(scope="session")
def points_data(workspace):
    folder = workspace / "demo" / "points"
    return torch_model(dynamic_dims, folder), np.load(folder / "val.npz"), np.load(folder / "clouds.npz")


def _logits(model, points: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(points)).numpy()


def test_points_model_with_literal_minus_one_dims_serves_any_batch_and_cloud_size(built, service, workspace,
                                                                                  points_data):
    import onnx

    artifact = built("points")
    exported = onnx.load(workspace / "demo" / "points" / "model.onnx")
    assert [d.dim_value for d in exported.graph.input[0].type.tensor_type.shape.dim] == [-1, -1, 3]
    # The manifest, which the agent checks requests against, names the two open dims.
    assert artifact.manifest["inputs"][0]["shape"] == ["points_dim0", "points_dim1", 3]
    model, _, clouds = points_data
    for count in (64, 200):
        points, labels = clouds[f"points_{count}"], clouds[f"label_{count}"]
        results = service("points").predict_tensors({"points": points}).result
        probs = softmax(_logits(model, points))
        tolerance = 1e-5 if artifact.precision == "fp32" else 0.05
        for result, row, label in zip(results, probs, labels, strict=True):
            assert result[0]["index"] == int(label) == int(row.argmax())
            assert result[0]["label"] == dynamic_dims.CLASSES[label]
            assert [r["score"] for r in result] == pytest.approx(sorted(row, reverse=True), abs=tolerance)


def test_points_int8_keeps_top1_or_ships_fp32_saying_why(built, points_data):
    artifact = built("points")
    model, val, _ = points_data
    points = val["points"][:, 0]
    fp32 = (_logits(model, points).argmax(1) == val["label"]).mean()
    shipped = (run_onnx(artifact.model_bytes(), {"points": points})[0].argmax(1) == val["label"]).mean()
    assert fp32 >= 0.95
    assert_int8_keeps_the_budget_or_fp32_says_why(artifact, 1 - (fp32 - shipped), 0.99)


def test_points_cli_and_http_take_clouds_of_any_size(built, agent, workspace, keypair, points_data):
    model, _, clouds = points_data
    cloud = clouds["points_64"][:1]
    path = workspace / "cloud64.npy"
    np.save(path, cloud)
    expected = softmax(_logits(model, cloud))[0]
    tolerance = 1e-5 if built("points").precision == "fp32" else 0.05
    by_cli = cli_predict(built("points"), keypair[1], path)["result"]
    by_json = agent("points").predict(json.dumps({"inputs": {"points": cloud.tolist()}}).encode(),
                                      "application/json")["result"]
    buffer = io.BytesIO()
    np.save(buffer, clouds["points_200"][:2])
    by_npy = agent("points").predict(buffer.getvalue(), "application/x-npy")["result"]
    for result in (by_cli, by_json):
        assert result[0]["index"] == int(clouds["label_64"][0])
        assert [r["score"] for r in result] == pytest.approx(sorted(expected, reverse=True), abs=tolerance)
    assert [r[0]["index"] for r in by_npy] == [int(v) for v in clouds["label_200"][:2]]


# ----------------------------------------------------------------------------- classifier ending in Softmax


@pytest.fixture(scope="session")
def orientation_reference(workspace):
    folder = workspace / "demo" / "orientation"
    model = torch_model(softmax_classifier, folder)
    labels = dict(line.split(",") for line in (folder / "val" / "labels.csv").read_text().splitlines()[1:])
    reference = {}
    for name, label in labels.items():
        tensor = gray_tensor(folder / "val" / name)
        with torch.no_grad():
            probs = model(torch.from_numpy(tensor)).numpy()[0]
        reference[name] = {"tensor": tensor, "label": int(label), "probs": probs}
    return reference


def test_orientation_int8_keeps_top1_or_ships_fp32_saying_why(built, orientation_reference):
    artifact = built("orientation-int8")
    fp32 = np.mean([r["probs"].argmax() == r["label"] for r in orientation_reference.values()])
    shipped = np.mean([run_onnx(artifact.model_bytes(), {"image": r["tensor"]})[0].argmax() == r["label"]
                       for r in orientation_reference.values()])
    assert_int8_keeps_the_budget_or_fp32_says_why(artifact, 1 - (fp32 - shipped), 0.99)


def test_topk_of_a_model_ending_in_softmax_reports_its_probabilities_not_a_second_softmax(built, service, agent,
                                                                                         workspace, keypair,
                                                                                         orientation_reference):
    artifact = built("orientation-int8")
    assert artifact.manifest["postprocess"]["apply_softmax"] is False
    assert "Softmax" in artifact.report["passes"]["io_spec"]["apply_softmax"]["why"]
    tolerance = 1e-5 if artifact.precision == "fp32" else 0.05
    right = 0
    for name, reference in orientation_reference.items():
        result = service("orientation-int8").predict((workspace / "demo" / "orientation" / "val" / name)
                                                     .read_bytes()).result
        probs = reference["probs"]
        assert [r["score"] for r in result] == pytest.approx(sorted(probs, reverse=True)[:2], abs=tolerance)
        right += result[0]["index"] == reference["label"]
    assert right >= 0.95 * len(orientation_reference)
    name, reference = next(iter(orientation_reference.items()))
    path = workspace / "demo" / "orientation" / "val" / name
    for answer in (cli_predict(artifact, keypair[1], path), agent("orientation-int8").predict(path.read_bytes(),
                                                                                              "image/png")):
        top = answer["result"][0]
        assert top["label"] == softmax_classifier.LABELS[reference["label"]]
        # A second softmax over four probabilities can never exceed e / (e + 3) = 0.475.
        assert top["score"] == pytest.approx(float(reference["probs"].max()), abs=tolerance) and top["score"] > 0.6


# ----------------------------------------------------------------------------- templates

# Each template of recipes/templates/ and its tested twin in recipes/, with the demo files a
# copy of the template finds next to it (the template's placeholder names).
TEMPLATES = {
    "detector-yolov8-int8.yaml": ("yolo-int8", "yolo", {"labels.txt": "labels.txt", "calib": "calib", "val": "val"}),
    "text-recognizer-ctc-int8.yaml": ("ocr-int8", "ocr", {"charset.txt": "charset.txt", "calib": "calib",
                                                         "val": "val"}),
    "stateful-audio.yaml": ("lstm-vad", "lstm_vad", {"val": "audio"}),
    "classifier-softmax-int8.yaml": ("orientation-int8", "orientation", {"labels.txt": "labels.txt",
                                                                         "calib": "calib", "val": "val"}),
    "dynamic-dims.yaml": ("points", "points", {"labels.txt": "labels.txt", "samples.npz": "val.npz"}),
}


def _key_paths(node: Any, prefix: str = "") -> set[str]:
    if not isinstance(node, dict):
        return set()
    paths = set()
    for key, value in node.items():
        paths |= {f"{prefix}{key}"} | _key_paths(value, f"{prefix}{key}.")
    return paths


@pytest.mark.parametrize("template", sorted(TEMPLATES))
def test_each_model_kind_template_is_a_valid_recipe_shaped_like_its_tested_twin(template, workspace, tmp_path):
    """A copy of the template next to the demo's model and data is a valid recipe (every path
    there, roles consistent), and it sets the same keys as the recipe the tests above build
    (the template's values are starting points: sizes and thresholds are the user's)."""
    from sdk.recipe import load_recipe

    twin, demo, files = TEMPLATES[template]
    source = workspace / "demo" / demo
    shutil.copy(source / "model.onnx", tmp_path / "model.onnx")
    for name, found in files.items():
        (shutil.copytree if (source / found).is_dir() else shutil.copy)(source / found, tmp_path / name)
    shutil.copy(REPO / "recipes" / "templates" / template, tmp_path / template)
    recipe = load_recipe(tmp_path / template)
    assert recipe.name.startswith("my-")
    tested = load_recipe(workspace / "recipes" / f"{twin}.yaml", allow_external_paths=True)
    ignored = {"name", "version", "description", "output", "golden", "golden.count", "golden.data",
               "golden.data.audio", "postprocess.append_space"}
    assert _key_paths(recipe.data) - ignored == _key_paths(tested.data) - ignored
