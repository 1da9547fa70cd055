"""Code both sides share: artifact format, manifest, signing, verifier, preprocessing spec.

Importable on a device: it depends only on numpy, cryptography, pyyaml and Pillow, never on
onnx, click or anything under ``sdk``.
"""

__version__ = "0.1.0"
