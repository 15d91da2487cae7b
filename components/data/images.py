"""Decoded input images to 8-bit RGB.

The official processor takes an image through transformers' `load_image`: EXIF orientation, then
`convert("RGB")`. For every 8-bit mode (1, L, P, PA, LA, RGB, RGBA, CMYK, YCbCr, ...) `to_rgb` is
exactly that conversion. PIL's conversion of the wide modes clips instead of scaling: a 16-bit
gray PNG (mode I;16, values up to 65535) would come out almost all white. Those modes are scaled
to 8 bits first, the way Pillow itself reads a 16-bit RGB PNG (the high byte of each sample), so a
16-bit gray image and the same image stored as 16-bit RGB give the same pixels.
"""

from __future__ import annotations

import numpy as np
from PIL import Image

# single-channel modes whose samples do not fit 8 bits
WIDE_MODES = ("I;16", "I;16L", "I;16B", "I;16N", "I", "F")


def to_8bit(image: Image.Image) -> Image.Image:
    """A wide-mode image as mode L (its metadata, EXIF included, kept); any other image as is.

    16-bit and 32-bit integer samples are clipped to [0, 65535] and keep their high byte. Float
    samples in [0, 1] are scaled by 255; floats with a larger range are taken as 0..255 values;
    both are rounded and clipped (NaN -> 0)."""
    if image.mode not in WIDE_MODES:
        return image
    if image.mode == "F":
        samples = np.nan_to_num(np.asarray(image, dtype=np.float64), nan=0.0, posinf=255.0, neginf=0.0)
        scale = 255.0 if samples.size and samples.max() <= 1.0 else 1.0
        eight = np.clip(np.rint(samples * scale), 0, 255).astype(np.uint8)
    else:
        samples = np.asarray(image).astype(np.int64)  # I;16B reads big-endian, I as int32
        eight = (np.clip(samples, 0, 65535) >> 8).astype(np.uint8)
    out = Image.fromarray(eight)  # 2-D uint8: mode L
    # the tRNS gray value of a 16-bit PNG means nothing in 8 bits; EXIF etc. still apply
    out.info = {k: v for k, v in image.info.items() if k != "transparency"}
    return out


def to_rgb(image: Image.Image) -> Image.Image:
    """Any decoded image as 8-bit RGB: `convert("RGB")` after scaling a wide mode to 8 bits."""
    return to_8bit(image).convert("RGB")
