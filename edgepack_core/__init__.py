"""Code both sides share: artifact format, manifest, signing, verifier, preprocessing spec.

Importable on a device: it depends only on numpy, PyNaCl (Ed25519 verification), pyyaml and
Pillow, and on cryptography only where it signs or reads private keys (the host's side, imported
when that runs), never on onnx, click or anything under ``sdk``.
"""

__version__ = "0.1.0"
