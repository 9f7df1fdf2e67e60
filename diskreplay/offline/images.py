"""Encoded images in datasets (Minari's JPEG-encoded image observations, PNG files): told apart
by their magic bytes, checked by decoding them with Pillow (an optional dependency, which Minari
requires), and kept encoded in a ``codec="jpeg"`` / ``"png"`` frame field: each image's bytes are
stored as they are (`EncodedFrames`), so a read decodes exactly what the dataset held."""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..build import missing_extra
from ..format.ragged import EncodedFrames
from ..format.schema import Field
from .source import ImportFormatError

MAGIC = {b"\xff\xd8\xff": "jpeg", b"\x89PNG\r\n\x1a\n": "png"}
MODES = {"L": (), "RGB": (3,), "RGBA": (4,)}
"""Pillow image modes a frame field stores, and the channel axis of each (none for "L")."""


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


def decode_image(blob: bytes, where: str) -> tuple[np.ndarray, str]:
    """One JPEG or PNG image as ``uint8 [height, width(, channels)]``, as Pillow decodes it, and
    its Pillow mode. ImportFormatError naming ``where`` for anything else."""
    if image_codec(blob) is None:
        raise ImportFormatError(f"{where}: {bytes(blob[:8])!r}... is not a JPEG or PNG image")
    try:
        with require_pil().open(io.BytesIO(bytes(blob))) as image:
            pixels, mode = np.asarray(image), image.mode
    except (OSError, ValueError, SyntaxError) as e:
        raise ImportFormatError(f"{where}: a damaged {image_codec(blob)} image ({e})") from e
    if pixels.dtype != np.uint8:
        raise ImportFormatError(f"{where}: a {pixels.dtype} image, expected 8-bit pixels")
    return pixels, mode


def image_field(blob: bytes, where: str) -> Field:
    """The field for images like ``blob`` (the first of a column): encoded with its codec when it
    is an 8-bit gray, RGB or RGBA image (PNG) of those modes, else its decoded pixels."""
    pixels, mode = decode_image(blob, f"{where}: row 0")
    codec = image_codec(blob)
    if mode in MODES and (codec, mode) != ("jpeg", "RGBA"):
        return Field(pixels.shape, "uint8", codec=codec)
    return Field(pixels.shape, "uint8")


def image_rows(blobs: Sequence[bytes], field: Field, where: str) -> EncodedFrames | np.ndarray:
    """Rows of an image field: each blob checked to decode to an image of the field's shape
    (and codec and mode), kept encoded for a field with a codec, else decoded."""
    out = None if field.codec else np.empty((len(blobs), *field.shape), np.uint8)
    for i, blob in enumerate(blobs):
        pixels, mode = decode_image(blob, f"{where}: row {i}")
        if pixels.shape != field.shape or field.codec and (image_codec(blob) != field.codec or mode not in MODES):
            raise ImportFormatError(f"{where}: row {i}: a {image_codec(blob)} image of shape {pixels.shape} "
                                    f"({mode}), the first one's is {field.codec or 'an image'} of {field.shape}")
        if out is not None:
            out[i] = pixels
    if out is not None:
        return out
    data = [bytes(b) for b in blobs]
    return EncodedFrames(np.frombuffer(b"".join(data), np.uint8), np.array([len(b) for b in data], np.int64))
