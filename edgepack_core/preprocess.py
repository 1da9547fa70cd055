"""The preprocessing executor: one raw input (an encoded image, a WAV file, a tensor) to one
model input tensor, following a :class:`~edgepack_core.preprocess_spec.PreprocessSpec`.

The same :class:`Preprocessor` runs on the workstation (calibration, validation, golden
samples) and on the device (``predict``), so the packager measures exactly the tensors a
device will compute. It needs only numpy, plus Pillow for images (imported lazily, so a
tensor-only device never loads it). The steps, their order and the fast path's bounds are in
docs/packager.md ("Image preprocessing"); the spec is :mod:`edgepack_core.preprocess_spec`, the
resize maths :mod:`edgepack_core.geometry`.
"""

from __future__ import annotations

import io
from collections.abc import Iterable, Mapping
from os import PathLike
from typing import TYPE_CHECKING, Any

import numpy as np

from edgepack_core import jpeg_scans, resample
from edgepack_core.errors import PreprocessError
from edgepack_core.geometry import (
    REDUCING_GAP,
    array_reduction,
    image_geometry,
    padded_size,
    reduction_factor,
    resize_plan,
    source_region,
)
from edgepack_core.preprocess_spec import Dim, PreprocessSpec, Resize, parse_preprocess

if TYPE_CHECKING:
    from PIL import Image

__all__ = ["DEFAULT_MAX_PIXELS", "REDUCING_GAP", "PreprocessSpec", "Preprocessor", "Resize", "array_reduction",
           "fused_scale_bias", "image_geometry", "pillow_view", "reduction_factor", "resize_plan", "source_region"]

DEFAULT_MAX_PIXELS = 50_000_000
_EXIF_ORIENTATION = 0x0112


def fused_scale_bias(spec: PreprocessSpec) -> tuple[np.ndarray, np.ndarray]:
    """``(gain, bias)``, float32 per output channel, with ``x * gain + bias`` equal to the spec's
    ``(x * scale - mean) / std`` up to float32 rounding: one multiply-add instead of three
    passes. Computed in float64 and rounded once; the in-graph lowering uses the same constants,
    so Python and the graph compute the same tensor."""
    std = np.asarray(spec.std, dtype=np.float64)
    gain = spec.scale / std
    bias = -np.asarray(spec.mean, dtype=np.float64) / std
    return gain.astype(np.float32), bias.astype(np.float32)


def pillow_view(pixels: np.ndarray) -> Image.Image:
    """A uint8 HxW (L) or HxWx3 (RGB) array as a Pillow image, read straight from the array's
    memory when each row is a run of whole pixels (a window of a frame, or a BGR frame's
    ``[:, :, ::-1]`` view, read as Pillow's "BGR" raw mode), with one contiguous copy first
    otherwise. Pillow keeps RGB as 4 bytes a pixel, so an image is always one (unpacking) copy;
    this saves the copy before it (a window: 7%; a BGR view: 0.8 ms against 4.5 ms for numpy's
    copy of a 640x640 window, measured)."""
    from PIL import Image

    height, width = pixels.shape[:2]
    channels = 1 if pixels.ndim == 2 else pixels.shape[2]
    row, pixel = pixels.strides[0], pixels.strides[1]
    order = 1 if channels == 1 else pixels.strides[2]
    if pixels.dtype != np.uint8 or pixel != channels * abs(order) or abs(order) != 1 or row < width * channels \
            or height * width == 0:
        pixels = np.ascontiguousarray(pixels)
        return Image.fromarray(pixels, mode="L" if channels == 1 else "RGB")
    first = pixels[:, :, ::-1] if order < 0 else pixels  # the row's first byte is the first pixel's first channel
    span = np.lib.stride_tricks.as_strided(first, shape=((height - 1) * row + width * channels,), strides=(1,))
    mode = "L" if channels == 1 else "RGB"
    return Image.frombytes(mode, (width, height), span, "raw", "BGR" if order < 0 else mode, row, 1)


def _matches(shape: tuple[int, ...], expected: tuple[Dim, ...]) -> bool:
    if len(shape) != len(expected):
        return False
    return all(not isinstance(want, int) or got == want for got, want in zip(shape, expected, strict=True))


def _pillow_filter(name: str) -> Any:
    from PIL import Image

    return {"nearest": Image.Resampling.NEAREST, "bilinear": Image.Resampling.BILINEAR,
            "bicubic": Image.Resampling.BICUBIC, "area": Image.Resampling.BOX}[name]


def _orientation(image: Image.Image) -> int:
    try:
        value = image.getexif().get(_EXIF_ORIENTATION, 1)
    except Exception as err:  # a damaged EXIF block: the reference path refuses it the same way
        raise PreprocessError(f"cannot apply the EXIF orientation ({type(err).__name__}: {err})") from err
    return value if isinstance(value, int) and 1 <= value <= 8 else 1


# ----------------------------------------------------------------------------- executor


class Preprocessor:
    """Turns one raw input into one model input tensor, following a typed spec (docs/packager.md).

    ``spec`` is the :class:`PreprocessSpec` the recipe or the verified manifest was parsed into
    (a mapping is parsed here, for tools and tests); ``self.spec`` is the complete spec actually
    executed. ``reference=True`` runs images through the literal steps of docs/packager.md
    ("Image preprocessing": full decode, resize then crop, float32 step by step) instead of the
    fast path: the yardstick of the parity test.
    """

    def __init__(self, spec: PreprocessSpec | Mapping[str, Any] | None, *, max_pixels: int = DEFAULT_MAX_PIXELS,
                 reference: bool = False) -> None:
        self.spec = parse_preprocess(spec)
        self.max_pixels = max_pixels
        self.reference = reference
        self.kind: str = self.spec.kind
        self.input_name: str | None = self.spec.input
        self.max_audio_bytes = 0  # no audio taken; an audio model's below (the WAV decoder loads for those only)
        if self.kind == "audio":
            from edgepack_core.audio import DEFAULT_MAX_BYTES

            self.max_audio_bytes = DEFAULT_MAX_BYTES
        if self.kind == "image":
            channels = self.spec.channels
            self._mean = np.asarray(self.spec.mean, dtype=np.float32).reshape(1, 1, channels)
            self._std = np.asarray(self.spec.std, dtype=np.float32).reshape(1, 1, channels)
            self._gain, self._bias = fused_scale_bias(self.spec)
            self.in_graph = bool(self.spec.in_graph)
            # uint8 out and nothing to compute: the pixels are copied, never converted.
            self._copy_only = self.in_graph or (self.spec.dtype == "uint8" and bool(np.all(self._gain == 1))
                                                and bool(np.all(self._bias == 0)))

    # ---- entry points

    def from_path(self, path: str | PathLike[str]) -> np.ndarray:
        """An encoded image file (image kind), a WAV file (audio kind: the stack of its frames,
        ``[n_frames, ...one frame's shape]``) or an ``.npy`` file (tensor kind)."""
        if self.kind == "tensor":
            try:
                array = np.load(path, allow_pickle=False)
            except (OSError, ValueError, EOFError) as err:
                raise PreprocessError(f"{path}: not a readable .npy file ({err})") from err
            if not isinstance(array, np.ndarray):
                raise PreprocessError(f"{path}: holds several arrays; a tensor spec takes one .npy array")
            return self.from_array(array)
        try:
            with open(path, "rb") as handle:
                data = handle.read()
        except OSError as err:
            raise PreprocessError(f"{path}: cannot read ({err.strerror or err})") from err
        return self.from_audio_bytes(data) if self.kind == "audio" else self.from_image_bytes(data)

    def from_audio_bytes(self, data: bytes) -> np.ndarray:
        """WAV bytes -> the stack of model-ready frames ``[n_frames, *spec.frame_shape()]``
        (``[n_frames, 1, context + frame]`` for the default layout ``[B, N]``): the one path
        the host's data sources and the device's requests both take."""
        if self.kind != "audio":
            raise PreprocessError(f"this model takes {self.kind} input (preprocess kind: {self.kind}), not audio")
        spec = self.spec
        from edgepack_core import audio

        samples, rate = audio.decode_wav(data, max_bytes=self.max_audio_bytes)
        audio.check_rate(rate, spec.sample_rate, resample=spec.resample)
        mono = audio.resample(audio.to_mono(samples), rate, spec.sample_rate)
        frames = audio.cut_frames(mono, spec.frame, spec.hop, spec.context, spec.last_frame)
        values = audio.to_values(frames, spec.scale, spec.dtype or "float32")
        return np.ascontiguousarray(values.reshape(len(values), *spec.frame_shape()))

    def batch_from_paths(self, paths: Iterable[str | PathLike[str]]) -> np.ndarray:
        """Several files as one tensor with the samples along the first axis (for calibration).

        With ``batch: false`` the per-sample tensors are stacked, giving the same layout.
        """
        tensors = [self.from_path(p) for p in paths]
        if not tensors:
            raise PreprocessError("no input files given")
        shapes = {t.shape for t in tensors}
        if len(shapes) > 1:
            raise PreprocessError(f"inputs give different shapes {sorted(shapes)}; add a resize to the spec")
        return np.concatenate(tensors, axis=0) if self.spec.batch else np.stack(tensors, axis=0)

    def from_image_bytes(self, data: bytes) -> np.ndarray:
        """Decode an encoded image (PNG, JPEG, ...) and preprocess it."""
        return self.image_with_geometry(data)[0]

    def image_with_geometry(self, data: bytes | np.ndarray, *, out: np.ndarray | None = None,
                            opened: Image.Image | None = None) -> tuple[np.ndarray, dict[str, Any]]:
        """Encoded image bytes, or an image array as :meth:`from_array` takes it -> the tensor
        and the geometry applied (:func:`image_geometry` of the upright image), so the
        detection postprocessing can map boxes back to the original's pixels.

        ``out``: a preallocated tensor of :meth:`tensor_shape` and the output dtype (e.g. one
        row of a batch) that the fast path writes into and returns. ``opened``: ``data`` with its
        header already read (and its JPEG scans counted) by the caller, decoded as it is."""
        if isinstance(data, np.ndarray):
            tensor = self.from_array(data, out=out)
            return tensor, image_geometry(data.shape[0], data.shape[1], self.spec.resize)
        if self.reference:
            image = self._upright(self._decode(data, opened))
            return _into(self._pipeline(image), out), image_geometry(image.height, image.width,
                                                                     self.spec.resize)
        image, factor, (height, width) = self._decode_reduced(data, opened)
        return self._fast_image(image, factor, height, width, out), image_geometry(height, width,
                                                                                  self.spec.resize)

    def tensor_shape(self) -> tuple[int, ...] | None:
        """The shape of every image tensor this spec gives, or None when it depends on the
        image (no ``resize``, or a keep-aspect-height one whose width varies)."""
        if self.kind != "image" or self.spec.resize is None or self.spec.resize.variable_width:
            return None
        return self._shape(*self.spec.resize.size)

    @property
    def out_dtype(self) -> np.dtype:
        """The dtype of the image tensors (uint8 when the arithmetic is in the graph)."""
        return np.dtype("uint8" if self.spec.in_graph else (self.spec.dtype or "float32"))

    def _open(self, data: bytes, opened: Image.Image | None = None) -> Image.Image:
        """The image with only its header read (``opened``, when the caller read it); the pixel
        cap is checked here, before decoding."""
        self._require_image()
        if opened is not None:
            self._check_pixels(opened.width, opened.height)
            return opened
        from PIL import Image

        jpeg_scans.count_scans(data)  # a progressive JPEG's CPU cost is scans x pixels: bounded first
        try:
            image = Image.open(io.BytesIO(data))
        except Image.DecompressionBombError as err:
            raise PreprocessError(f"image refused as a decompression bomb: {err}") from err
        except Exception as err:
            # Pillow's format plugins raise a zoo of types (OSError, SyntaxError, struct.error,
            # ValueError, ...) for hostile or damaged bytes; to the caller they all mean one thing.
            raise PreprocessError(f"cannot decode image ({type(err).__name__}: {err})") from err
        self._check_pixels(image.width, image.height)
        return image

    @staticmethod
    def _load(image: Image.Image) -> None:
        try:
            image.load()
        except Exception as err:
            raise PreprocessError(f"cannot decode image ({type(err).__name__}: {err})") from err

    def _decode(self, data: bytes, opened: Image.Image | None = None) -> Image.Image:
        image = self._open(data, opened)
        self._load(image)
        return image

    def _decode_reduced(self, data: bytes, opened: Image.Image | None = None
                        ) -> tuple[Image.Image, int, tuple[int, int]]:
        """Decode, at a reduced scale where the format allows it (JPEG) and the target is small
        enough: ``(upright image in the spec's color, reduction factor, upright (h, w) of the
        full-size image)``."""
        image = self._open(data, opened)
        stored_w, stored_h = image.size
        factor = 1
        if image.format in ("JPEG", "MPO") and self.spec.resize is not None:
            factor = self._draft(image, _orientation(image) >= 5)  # a JPEG's EXIF is in its header
        self._load(image)
        orientation = _orientation(image)
        height, width = (stored_w, stored_h) if orientation >= 5 else (stored_h, stored_w)
        image = self._transpose(image, orientation)
        return self._convert_color(image, keep_gray=True), factor, (height, width)

    def _draft(self, image: Image.Image, transposed: bool) -> int:
        """Ask libjpeg for the largest DCT scale (1/2, 1/4, 1/8) that keeps the decoded image at
        least 1/``reduction_factor`` of full size; returns the scale's denominator."""
        stored_w, stored_h = image.size
        height, width = (stored_w, stored_h) if transposed else (stored_h, stored_w)  # 5..8 swap the axes
        box, (out_h, out_w), _ = source_region(height, width, self._target)
        wanted = min(reduction_factor(box[2] - box[0], out_w), reduction_factor(box[3] - box[1], out_h))
        if wanted == 1:
            return 1
        request = (width // wanted, height // wanted)
        drafted = image.draft(None, request[::-1] if transposed else request)  # in the stored orientation
        return 1 if drafted is None else max(1, round(stored_w / drafted[1][2]))

    @staticmethod
    def _transpose(image: Image.Image, orientation: int) -> Image.Image:
        """The EXIF orientation applied (a new image only when there is one to apply)."""
        if orientation == 1:
            return image
        from PIL import Image

        method = {2: Image.Transpose.FLIP_LEFT_RIGHT, 3: Image.Transpose.ROTATE_180,
                  4: Image.Transpose.FLIP_TOP_BOTTOM, 5: Image.Transpose.TRANSPOSE, 6: Image.Transpose.ROTATE_270,
                  7: Image.Transpose.TRANSVERSE, 8: Image.Transpose.ROTATE_90}[orientation]
        return image.transpose(method)

    def from_image(self, image: Image.Image) -> np.ndarray:
        """Preprocess an already decoded Pillow image (EXIF orientation is still applied)."""
        if self.reference:
            return self._pipeline(self._upright(image))
        self._require_image()
        self._check_pixels(image.width, image.height)
        self._load(image)
        image = self._convert_color(self._transpose(image, _orientation(image)), keep_gray=True)
        return self._fast_image(image, 1, image.height, image.width, None)

    def _upright(self, image: Image.Image) -> Image.Image:
        self._require_image()
        from PIL import ImageOps

        self._check_pixels(image.width, image.height)
        try:
            image = ImageOps.exif_transpose(image)
        except Exception as err:
            raise PreprocessError(f"cannot apply the EXIF orientation ({type(err).__name__}: {err})") from err
        return self._convert_color(image)

    def from_array(self, array: np.ndarray, *, out: np.ndarray | None = None) -> np.ndarray:
        """Image kind: an HxWx3 uint8 RGB array (or HxW / HxWx1 gray, HxWx4 RGBA), as if decoded.
        A BGR camera frame goes in as ``frame[:, :, ::-1]``: a view, and the fast path copies
        only the window it resamples. Tensor kind: the tensor itself, checked against the
        spec's shape and cast to its dtype."""
        array = np.asarray(array)
        if self.kind == "tensor":
            return self._tensor(array)
        self._require_image()
        if array.dtype != np.uint8:
            raise PreprocessError(f"an image array must be uint8, got {array.dtype}")
        if array.ndim == 3 and array.shape[2] == 1:
            array = array[:, :, 0]
        if not (array.ndim == 2 or (array.ndim == 3 and array.shape[2] in (3, 4))):
            raise PreprocessError(f"an image array must be HxW, HxWx1, HxWx3 or HxWx4, got shape {list(array.shape)}")
        self._check_pixels(array.shape[1], array.shape[0])
        if self.reference:
            from PIL import Image

            mode = "L" if array.ndim == 2 else {3: "RGB", 4: "RGBA"}[array.shape[2]]
            image = Image.fromarray(np.ascontiguousarray(array), mode=mode)
            return _into(self._pipeline(self._convert_color(image)), out)
        if array.ndim == 3 and array.shape[2] == 4:
            array = array[:, :, :3]  # alpha dropped, as Pillow's RGBA -> RGB does
        return self._fast_array(array, out)

    # ---- fast path

    def _fast_image(self, image: Image.Image, factor: int, height: int, width: int,
                    out: np.ndarray | None) -> np.ndarray:
        """An upright image in the spec's color, decoded at 1/``factor`` of ``height`` x ``width``
        -> the tensor: the kept region resampled in one call (a stripe of a Pillow image would
        need a copy of its rows, which costs more than a second thread saves: measured)."""
        resize = self.spec.resize
        if resize is None:
            return self._emit(np.asarray(image), None, out)
        box, (out_h, out_w), paste = source_region(height, width, resize)
        scaled = (box[0] / factor, box[1] / factor, box[2] / factor, box[3] / factor)
        interpolation = resize.interpolation
        if (out_w, out_h) == image.size and scaled == (0.0, 0.0, float(image.width), float(image.height)):
            return self._emit(np.asarray(image), paste, out)
        return self._emit(np.asarray(image.resize((out_w, out_h), resample=_pillow_filter(interpolation), box=scaled)),
                          paste, out)

    def _fast_array(self, array: np.ndarray, out: np.ndarray | None) -> np.ndarray:
        """An HxW or HxWx3 uint8 view -> the tensor. Nothing is copied when no resampling is
        needed; otherwise only the window the filter reads goes into Pillow, reduced by
        :func:`array_reduction` when the target is small enough, and the resize's first pass
        runs in stripes over the cores (:mod:`edgepack_core.resample`), each stripe copying
        its own rows of the array into Pillow."""
        height, width = array.shape[:2]
        gray_to_luma = array.ndim == 3 and self.spec.color == "gray"
        resize = self.spec.resize
        if resize is None:
            if not gray_to_luma:
                return self._emit(array, None, out)
            return self._emit(np.asarray(self._pillow(array)), None, out)
        box, (out_h, out_w), paste = source_region(height, width, resize)
        whole = [round(v) for v in box]
        if not gray_to_luma and whole == list(box) and (whole[3] - whole[1], whole[2] - whole[0]) == (out_h, out_w):
            # A pure crop: numpy views only, straight into the output.
            return self._emit(array[whole[1]:whole[3], whole[0]:whole[2]], paste, out)
        factor = array_reduction(box, out_h, out_w, resize.interpolation)
        # The window in reduced pixels (the reduction's blocks start at the frame's top-left
        # corner), with every tap the filter reads around the box.
        reduced = (box[0] / factor, box[1] / factor, box[2] / factor, box[3] / factor)
        interpolation = resize.interpolation
        left, right = resample.reach(reduced[0], reduced[2], -(-width // factor), out_w, interpolation)
        top, bottom = resample.reach(reduced[1], reduced[3], -(-height // factor), out_h, interpolation)

        def region(x0: int, y0: int, x1: int, y1: int) -> Image.Image:
            """Pixels [x0, x1) x [y0, y1) of the reduced window, from the array's own rows."""
            image = self._pillow(array[(top + y0) * factor:min(height, (top + y1) * factor),
                                       (left + x0) * factor:min(width, (left + x1) * factor)])
            return image.reduce(factor) if factor > 1 else image

        shifted = (reduced[0] - left, reduced[1] - top, reduced[2] - left, reduced[3] - top)
        return self._emit(resample.resample(region, (right - left, bottom - top), shifted, (out_w, out_h),
                                            interpolation), paste, out)

    def _pillow(self, pixels: np.ndarray) -> Image.Image:
        """A uint8 HxW or HxWx3 array as a Pillow image in the spec's color (gray kept for an rgb
        spec: the output broadcasts it), by :func:`pillow_view`."""
        return self._convert_color(pillow_view(pixels), keep_gray=True)

    def _shape(self, height: int, width: int) -> tuple[int, ...]:
        channels = self.spec.channels
        layout = "NHWC" if self.in_graph else self.spec.layout
        shape = (channels, height, width) if layout == "NCHW" else (height, width, channels)
        return (1, *shape) if self.spec.batch else shape

    def _emit(self, pixels: np.ndarray, paste: tuple[int, int] | None, out: np.ndarray | None) -> np.ndarray:
        """Resized uint8 pixels (HxW or HxWxC, in RGB or gray) -> the tensor, in one pass: the
        fused scale-and-bias written straight into the output's layout (or a plain copy when
        the graph does the arithmetic), letterbox padding around it."""
        if pixels.ndim == 2:
            pixels = pixels[:, :, None]  # gray: broadcast to 3 channels for an rgb spec
        if self.spec.color == "bgr":
            pixels = pixels[:, :, ::-1]
        height, width = pixels.shape[:2]
        if paste is not None:
            height, width = padded_size(height, width, self._target)
        shape, dtype = self._shape(height, width), self.out_dtype
        if out is None:
            out = np.empty(shape, dtype=dtype)
        elif out.shape != shape or out.dtype != dtype:
            raise ValueError(f"out must be {dtype} {list(shape)}, got {out.dtype} {list(out.shape)}")
        nchw = not self.in_graph and self.spec.layout == "NCHW"
        planes = out[0] if self.spec.batch else out  # CHW or HWC
        left, top = paste if paste is not None else (0, 0)
        rows, cols = slice(top, top + pixels.shape[0]), slice(left, left + pixels.shape[1])
        target = planes[:, rows, cols] if nchw else planes[rows, cols]
        source = pixels.transpose(2, 0, 1) if nchw else pixels
        gain, bias = (self._gain[:, None, None], self._bias[:, None, None]) if nchw else (self._gain, self._bias)
        if self._copy_only:
            np.copyto(target, source)
        elif dtype == np.float32:
            np.multiply(source, gain, out=target)
            np.add(target, bias, out=target)
        else:
            target[...] = _cast(source * gain + bias, dtype.name)
        if paste is not None:
            self._pad(planes, nchw, rows, cols)
        return out

    def _pad(self, planes: np.ndarray, nchw: bool, rows: slice, cols: slice) -> None:
        """Fill the letterbox border (the four strips around the pasted image) with the pad
        value as the pixels became: the same fused arithmetic and cast."""
        value = np.float32(self._target.pad_value)
        fill = np.full(self._gain.shape, value, np.uint8) if self._copy_only else \
            _cast(value * self._gain + self._bias, planes.dtype.name)
        fill = fill[:, None, None] if nchw else fill
        strips = ((slice(0, rows.start), slice(None)), (slice(rows.stop, None), slice(None)),
                  (rows, slice(0, cols.start)), (rows, slice(cols.stop, None)))
        for strip_rows, strip_cols in strips:
            if nchw:
                planes[:, strip_rows, strip_cols] = fill
            else:
                planes[strip_rows, strip_cols] = fill

    # ---- steps

    @property
    def _target(self) -> Resize:
        """The spec's resize, where the caller already knows there is one (a paste, a draft)."""
        if self.spec.resize is None:
            raise PreprocessError("this preprocessing spec has no resize")
        return self.spec.resize

    def _require_image(self) -> None:
        if self.kind != "image":
            raise PreprocessError("this model takes raw tensors (preprocess kind: tensor), not images")

    def _check_pixels(self, width: int, height: int) -> None:
        if width * height > self.max_pixels:
            raise PreprocessError(f"image is {width}x{height} = {width * height} pixels, "
                                  f"over the limit of {self.max_pixels}")

    def _convert_color(self, image: Image.Image, *, keep_gray: bool = False) -> Image.Image:
        """RGB, or L for a gray spec (through RGB from any other mode). ``keep_gray``: an L image
        stays L for an rgb spec (the output broadcasts it to three equal channels, as L -> RGB
        would)."""
        wanted = "L" if self.spec.color == "gray" else "RGB"
        if image.mode == wanted or (keep_gray and image.mode == "L"):
            return image
        try:
            if image.mode not in ("RGB", "L"):
                # Palette, CMYK, alpha, 16-bit... all go through RGB first, so gray always means
                # the same luma formula on the same RGB values whatever the file's mode was.
                image = image.convert("RGB")
            return image.convert(wanted) if image.mode != wanted else image
        except ValueError as err:
            raise PreprocessError(f"cannot convert a {image.mode} image to {wanted} ({err})") from err

    # ---- the reference path: the literal steps of docs/packager.md

    def _resize(self, image: Image.Image) -> Image.Image:
        from PIL import Image

        resize = self.spec.resize
        if resize is None:
            return image
        (new_h, new_w), crop, paste = resize_plan(image.height, image.width, resize)
        out = image.resize((new_w, new_h), resample=_pillow_filter(resize.interpolation))
        if crop is not None:
            out = out.crop(crop)
        if paste is not None:
            target_h, target_w = padded_size(out.height, out.width, resize)
            fill = resize.pad_value if out.mode == "L" else (resize.pad_value,) * 3
            canvas = Image.new(out.mode, (target_w, target_h), fill)
            canvas.paste(out, paste)
            out = canvas
        return out

    def _pipeline(self, image: Image.Image) -> np.ndarray:
        if self.in_graph:
            pixels = np.asarray(self._resize(image))
            pixels = pixels[:, :, None] if pixels.ndim == 2 else pixels
            pixels = pixels[:, :, ::-1] if self.spec.color == "bgr" else pixels
            return np.ascontiguousarray(pixels[None] if self.spec.batch else pixels)
        pixels = np.asarray(self._resize(image), dtype=np.float32)
        if pixels.ndim == 2:
            pixels = pixels[:, :, None]
        if self.spec.scale != 1.0:
            pixels = pixels * np.float32(self.spec.scale)
        if self.spec.color == "bgr":
            pixels = pixels[:, :, ::-1]
        pixels = (pixels - self._mean) / self._std
        if self.spec.layout == "NCHW":
            pixels = pixels.transpose(2, 0, 1)
        tensor = _cast(pixels, self.out_dtype.name)
        if self.spec.batch:
            tensor = tensor[None]
        return np.ascontiguousarray(tensor)

    def _tensor(self, array: np.ndarray) -> np.ndarray:
        shape = self.spec.shape
        if shape is not None and not _matches(array.shape, shape):
            raise PreprocessError(f"tensor shape mismatch: expected {list(shape)}, got {list(array.shape)}")
        dtype = self.spec.dtype
        if dtype is not None and array.dtype != np.dtype(dtype):
            if not np.can_cast(array.dtype, dtype, casting="same_kind"):
                raise PreprocessError(f"tensor dtype {array.dtype} cannot be cast to {dtype} without changing "
                                      "its kind of number")
            array = array.astype(dtype)
        if self.spec.batch:
            array = array[None]
        return np.ascontiguousarray(array)


def _into(tensor: np.ndarray, out: np.ndarray | None) -> np.ndarray:
    """The reference path honours ``out`` too (copied in, same checks as the fast path)."""
    if out is None:
        return tensor
    if out.shape != tensor.shape or out.dtype != tensor.dtype:
        raise ValueError(f"out must be {tensor.dtype} {list(tensor.shape)}, got {out.dtype} {list(out.shape)}")
    out[...] = tensor
    return out


def _cast(pixels: np.ndarray, dtype: str) -> np.ndarray:
    if dtype in ("uint8", "int8"):
        info = np.iinfo(dtype)
        clipped: np.ndarray = np.clip(np.rint(pixels), info.min, info.max).astype(dtype)
        return clipped
    return pixels.astype(dtype, copy=False)
