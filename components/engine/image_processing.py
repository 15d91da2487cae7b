"""Pixel-space helpers of the official image processor (image_processor.py): loading, bucket
resize, output size alignment, PIL <-> [-1, 1] tensors."""

from __future__ import annotations

import math

import numpy as np
import torch
from PIL import Image, ImageOps
from torch import Tensor


def load_image(image: Image.Image) -> Image.Image:
    """As transformers' `load_image`, which the official processor calls first: EXIF orientation
    applied, then RGB. Byte-identical to it for every 8-bit mode; a wide mode (16-bit gray, 32-bit
    int, float), which its `convert("RGB")` clips to near-white, is scaled to 8 bits first."""
    from components.data.images import to_rgb

    return to_rgb(ImageOps.exif_transpose(image))


def resize_and_crop(image: Image.Image, width: int, height: int, crop: str = "center") -> Image.Image:
    """The official `resize_and_crop` (Lanczos) to width x height.

    crop "center": resize keeping the aspect ratio so the image covers the target, then crop the
    middle (rounded sizes and offsets); "resize": stretch to the target (the official
    `infer_align_image_size` mode)."""
    if width <= 0 or height <= 0:
        raise ValueError(f"target size must be positive, got {width}x{height}")
    if crop == "resize":
        return image.resize((width, height), resample=Image.Resampling.LANCZOS)
    if crop != "center":
        raise ValueError(f"crop must be 'center' or 'resize', got {crop!r}")
    w, h = image.size
    if h / w < height / width:
        # relatively wider than the target: match heights, crop the sides
        resize_w, resize_h = int(round(height / h * w)), height
    else:
        resize_w, resize_h = width, int(round(width / w * h))
    image = image.resize((resize_w, resize_h), resample=Image.Resampling.LANCZOS)
    top = int(round((resize_h - height) / 2.0))
    left = int(round((resize_w - width) / 2.0))
    return image.crop((left, top, left + width, top + height))


def resize_center_crop(image: Image.Image, width: int, height: int) -> Image.Image:
    return resize_and_crop(image.convert("RGB"), width, height, "center")


def align_output_size(image: Image.Image, output_ratio_index: int, cond_images: list[tuple[int, int, int]],
                      resolutions) -> Image.Image:
    """The official `postprocess_outputs(infer_align_image_size=True)`: when a conditioning image
    (given as (ratio_index, original width, original height)) shares the output's ratio bucket but
    its own aspect ratio is off by >= 0.01, resize the output (Lanczos) to that image's aspect
    ratio at area base_size**2. With several conditioning images, the first one in the output's
    bucket decides."""
    target_area = resolutions.base_size ** 2
    for ratio_index, width, height in cond_images:
        if ratio_index != output_ratio_index:
            continue
        if abs(height / width - resolutions[output_ratio_index].ratio) >= 0.01:
            scale = math.sqrt(target_area / (width * height))
            image = image.resize((round(width * scale), round(height * scale)), resample=Image.Resampling.LANCZOS)
        break
    return image


def pil_to_tensor(image: Image.Image) -> Tensor:
    """RGB PIL image -> float32 [3, H, W] in [-1, 1] (ToTensor then Normalize(0.5, 0.5))."""
    array = np.asarray(image.convert("RGB"), dtype=np.float32)
    x = torch.from_numpy(array.copy()).permute(2, 0, 1)
    return (x / 255.0 - 0.5) / 0.5


def tensor_to_pil(x: Tensor) -> Image.Image:
    """[3, H, W] in [-1, 1] -> RGB PIL image (clamped, rounded to uint8)."""
    if x.ndim != 3 or x.shape[0] != 3:
        raise ValueError(f"expected a [3, H, W] tensor, got {tuple(x.shape)}")
    x = ((x.detach().float().cpu() + 1.0) * 127.5).clamp(0, 255).round()
    array = x.to(torch.uint8).permute(1, 2, 0).numpy()
    return Image.fromarray(np.ascontiguousarray(array))
