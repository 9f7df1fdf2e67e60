"""Encoded images in datasets (Minari's JPEG-encoded image observations, PNG files): told apart
by their magic bytes and decoded with Pillow (an optional dependency, which Minari requires)."""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..build import missing_extra
from .source import ImportFormatError

MAGIC = {b"\xff\xd8\xff": "jpeg", b"\x89PNG\r\n\x1a\n": "png"}


def image_codec(blob: bytes) -> str | None:
    """``"jpeg"`` or ``"png"`` when ``blob`` starts as such an image does, else None."""
    return next((codec for magic, codec in MAGIC.items() if bytes(blob[:len(magic)]) == magic), None)


def require_pil() -> Any:
    """The ``PIL.Image`` module, or ImportError saying how to install it."""
    try:
        from PIL import Image
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise missing_extra("Pillow", "images", "decoding JPEG / PNG images") from e
    return Image


def decode_image(blob: bytes, where: str) -> np.ndarray:
    """One JPEG or PNG image as ``uint8 [height, width(, channels)]``, as Pillow decodes it."""
    if image_codec(blob) is None:
        raise ImportFormatError(f"{where}: {bytes(blob[:8])!r}... is not a JPEG or PNG image")
    try:
        image = np.asarray(require_pil().open(io.BytesIO(bytes(blob))))
    except (OSError, ValueError, SyntaxError) as e:
        raise ImportFormatError(f"{where}: a damaged {image_codec(blob)} image ({e})") from e
    if image.dtype != np.uint8:
        raise ImportFormatError(f"{where}: a {image.dtype} image, expected 8-bit pixels")
    return image


def decode_images(blobs: Sequence[bytes], shape: tuple[int, ...], where: str) -> np.ndarray:
    """Images of ``shape`` as ``uint8 [len(blobs), *shape]``; ImportFormatError naming ``where``
    and the row for one that is not a JPEG / PNG image of that shape."""
    out = np.empty((len(blobs), *shape), np.uint8)
    for i, blob in enumerate(blobs):
        image = decode_image(blob, f"{where}: row {i}")
        if image.shape != shape:
            raise ImportFormatError(f"{where}: row {i}: an image of shape {image.shape}, the first one's is {shape}")
        out[i] = image
    return out
