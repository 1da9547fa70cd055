"""A CTC text-line recogniser with a dynamic width, built from code, and the text-line images it
reads, for tests/test_real_world_ocr.py (issue 23, items 6 and 12).

The model is shaped like a CRNN export (Conv, Squeeze, Transpose to steps first, an LSTM,
a dense classifier, LogSoftmax; output ``[T, N, C]`` log-probabilities), with weights chosen so
that it reads a made-up script of column patterns rather than trained ones:

- input ``x`` float32 ``[N, 1, 32, W]``, gray pixels scaled to [0, 1], white glyphs on black;
- one step per 4 columns (a 32x4 Conv with stride 4: ``T = floor(W / 4)``);
- with ``t`` and ``b`` the mean brightness of the window's top and bottom 16 rows, the logits are
  blank ``1 - t - b``, ``a`` ``t - b``, ``b`` ``b - t``, ``c`` ``t + b - 0.5``: dark is the blank,
  a bright top is ``a``, a bright bottom ``b``, a bright column ``c``. A window partly over a
  glyph (the resize's blur, a glyph edge inside it) reads as that glyph or the blank, never
  another letter (the ``c`` and blank lines cross above the ``a``/``b`` ones);
- the LSTM is saturated to pass each step through (input and output gates open, forget gate
  shut, no recurrence): ``h = tanh(tanh(2 * logits))``, which keeps every step's argmax.

Classes: 0 blank, 1 ``a``, 2 ``b``, 3 ``c`` (PaddleOCR's convention: blank 0, charset lines for
classes 1..3). :func:`line_image` draws a string as glyphs a quarter of the image height wide,
separated and surrounded by gaps as wide, so after a resize to height 32 each glyph and each
gap is 8 columns: two steps.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from PIL import Image

HEIGHT = 32  # the model's fixed input height
STRIDE = 4  # columns per step
CHARSET = "abc"
BLANK = 0
HIDDEN = 1 + len(CHARSET)


def _conv_weights() -> tuple[np.ndarray, np.ndarray]:
    """[classes, 1, 32, 4] weights and [classes] biases of the logits in the module docs."""
    half = HEIGHT // 2
    per_pixel = 1.0 / (half * STRIDE)  # a mean over one half of the window
    # (top coefficient, bottom coefficient, bias) per class
    rules = {0: (-1.0, -1.0, 1.0), 1: (1.0, -1.0, 0.0), 2: (-1.0, 1.0, 0.0), 3: (1.0, 1.0, -0.5)}
    weights = np.zeros((HIDDEN, 1, HEIGHT, STRIDE), np.float32)
    bias = np.zeros(HIDDEN, np.float32)
    for cls, (top, bottom, offset) in rules.items():
        weights[cls, 0, :half] = top * per_pixel
        weights[cls, 0, half:] = bottom * per_pixel
        bias[cls] = offset
    return weights * 2.0, bias * 2.0


def _lstm_weights() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """W, R, B of a pass-through LSTM (ONNX gate order i, o, f, c)."""
    w = np.zeros((1, 4 * HIDDEN, HIDDEN), np.float32)
    w[0, 3 * HIDDEN :] = np.eye(HIDDEN, dtype=np.float32)  # the cell candidate is tanh(x)
    r = np.zeros((1, 4 * HIDDEN, HIDDEN), np.float32)
    b = np.zeros((1, 8 * HIDDEN), np.float32)
    b[0, :HIDDEN] = 20.0  # input gate open
    b[0, HIDDEN : 2 * HIDDEN] = 20.0  # output gate open
    b[0, 2 * HIDDEN : 3 * HIDDEN] = -20.0  # forget gate shut
    return w, r, b


def recognizer_model(path: Path, *, width: int | str = "W") -> Path:
    """The recogniser (module docs), its width symbolic (``"W"``) or fixed (an int)."""
    conv_w, conv_b = _conv_weights()
    lstm_w, lstm_r, lstm_b = _lstm_weights()
    inits = [
        numpy_helper.from_array(conv_w, "conv.weight"),
        numpy_helper.from_array(conv_b, "conv.bias"),
        numpy_helper.from_array(np.array([2], np.int64), "axis_h"),
        numpy_helper.from_array(np.array([1], np.int64), "axis_dir"),
        numpy_helper.from_array(lstm_w, "lstm.W"),
        numpy_helper.from_array(lstm_r, "lstm.R"),
        numpy_helper.from_array(lstm_b, "lstm.B"),
        numpy_helper.from_array(np.eye(HIDDEN, dtype=np.float32) * 8.0, "fc.weight"),
        numpy_helper.from_array(np.zeros(HIDDEN, np.float32), "fc.bias"),
    ]
    nodes = [
        helper.make_node(
            "Conv",
            ["x", "conv.weight", "conv.bias"],
            ["features"],
            kernel_shape=[HEIGHT, STRIDE],
            strides=[HEIGHT, STRIDE],
        ),
        helper.make_node("Squeeze", ["features", "axis_h"], ["columns"]),  # [N, C, T]
        helper.make_node("Transpose", ["columns"], ["steps"], perm=[2, 0, 1]),  # [T, N, C]
        helper.make_node("LSTM", ["steps", "lstm.W", "lstm.R", "lstm.B"], ["lstm_y"], hidden_size=HIDDEN),
        helper.make_node("Squeeze", ["lstm_y", "axis_dir"], ["hidden"]),  # [T, N, C]
        helper.make_node("MatMul", ["hidden", "fc.weight"], ["scores"]),
        helper.make_node("Add", ["scores", "fc.bias"], ["logits"]),
        helper.make_node("LogSoftmax", ["logits"], ["logprobs"], axis=2),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 1, HEIGHT, width])
    y = helper.make_tensor_value_info("logprobs", TensorProto.FLOAT, ["T", "N", HIDDEN])
    graph = helper.make_graph(nodes, "crnn", [x], [y], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="pytorch")
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, path)
    return path


def line_image(text: str, height: int = 64) -> np.ndarray:
    """``text`` in the column script as an ``height`` x W uint8 gray image (module docs)."""
    glyph = height // 4
    width = glyph * (2 * len(text) + 1)
    pixels = np.zeros((height, width), np.uint8)
    for index, char in enumerate(text):
        left = glyph * (2 * index + 1)
        rows = {"a": slice(0, height // 2), "b": slice(height // 2, height), "c": slice(0, height)}[char]
        pixels[rows, left : left + glyph] = 255
    return pixels


def save_line(path: Path, text: str, height: int = 64) -> Path:
    Image.fromarray(line_image(text, height), "L").save(path)
    return path


def greedy_ctc(logprobs: np.ndarray) -> list[str]:
    """An independent greedy CTC decode of ``[T, N, C]`` (this script's classes): per sample the
    argmax path, repeats merged, blanks dropped."""
    texts = []
    for sample in np.asarray(logprobs).transpose(1, 0, 2):
        path = sample.argmax(axis=1).tolist()
        chars = [CHARSET[c - 1] for i, c in enumerate(path) if c != BLANK and (i == 0 or path[i - 1] != c)]
        texts.append("".join(chars))
    return texts


def reference_tensor(image: np.ndarray, *, max_width: int, pad_to: int, pad_value: int = 0) -> np.ndarray:
    """The model input for ``image`` as the docs describe keep-aspect-height, computed here with
    Pillow and numpy alone: height 32, width ceil(w * 32 / h) capped at ``max_width``, padded on
    the right to a multiple of ``pad_to`` with ``pad_value``, scaled by 1/255."""
    h, w = image.shape
    width = min(max_width, max(1, -(-w * HEIGHT // h)))
    resized = np.asarray(Image.fromarray(image, "L").resize((width, HEIGHT), Image.Resampling.BILINEAR))
    padded = -(-width // pad_to) * pad_to
    canvas = np.full((HEIGHT, padded), pad_value, np.float32)
    canvas[:, :width] = resized
    return (canvas * np.float32(1 / 255))[None, None]


RECIPE = """\
name: {name}
version: 1.0.0
targets: [x86]
model: {{path: crnn.onnx}}
preprocess:
  kind: image
  color: gray
  resize: {{mode: keep-aspect-height, height: 32, max_width: {max_width}, pad_to: {pad_to}}}
  scale: 0.00392156862745098
postprocess: {{kind: ctc, blank: 0, layout: TNC, charset: charset.txt}}
validate:
  data: {{images: val}}
"""

VALIDATION = {"a": 64, "cab": 48, "bcca": 64, "abcabc": 40}  # text -> image height


def write_workspace(
    folder: Path, *, width: int | str = "W", max_width: int = 256, pad_to: int = 4, name: str = "crnn"
) -> Path:
    """The model, charset, validation images and the recipe a user writes; returns the recipe."""
    folder.mkdir(parents=True, exist_ok=True)
    recognizer_model(folder / "crnn.onnx", width=width)
    (folder / "charset.txt").write_text("\n".join(CHARSET) + "\n")
    (folder / "val").mkdir(exist_ok=True)
    for text, height in VALIDATION.items():
        save_line(folder / "val" / f"{text}.png", text, height)
    recipe = folder / f"{name}.yaml"
    recipe.write_text(RECIPE.format(name=name, max_width=max_width, pad_to=pad_to))
    return recipe
