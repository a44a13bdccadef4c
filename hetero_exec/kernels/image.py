"""ImageDecoder: encoded image bytes -> (H, W, C) uint8, decoded by Pillow on the host."""

from __future__ import annotations

import io

import numpy as np

from hetero_exec.kernels.registry import kernel


def _pil_image():
    try:
        import PIL.Image
    except ImportError as e:
        raise ImportError(
            "ImageDecoder needs Pillow: install the 'image' extra "
            "(pip install 'hetero_exec[image]')"
        ) from e
    return PIL.Image


@kernel("ImageDecoder", since=20, host_only="decoding runs in Pillow on the host")
def ImageDecoder(xp, encoded_stream, *, pixel_format="RGB"):
    if pixel_format not in ("RGB", "BGR", "Grayscale"):
        raise ValueError(f"unsupported pixel_format {pixel_format!r}")
    Image = _pil_image()
    data = np.ascontiguousarray(np.asarray(encoded_stream, dtype=np.uint8)).tobytes()
    with Image.open(io.BytesIO(data)) as img:
        if pixel_format == "Grayscale":
            out = np.asarray(img.convert("L"))[:, :, None]
        else:
            out = np.asarray(img if img.mode == "RGB" else img.convert("RGB"))
            if pixel_format == "BGR":
                out = out[:, :, ::-1]
    return (np.ascontiguousarray(out, dtype=np.uint8),)
