"""Pixel-space helpers shared by the VAE path: bucket resize, PIL <-> [-1, 1] tensors."""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image
from torch import Tensor


def resize_center_crop(image: Image.Image, width: int, height: int) -> Image.Image:
    """Resize keeping the aspect ratio so the image covers (width, height), then center-crop.

    Same arithmetic as the official `resize_and_crop` (Lanczos, rounded sizes and offsets), so a
    conditioning image lands on exactly the pixels the checkpoint was trained with."""
    if width <= 0 or height <= 0:
        raise ValueError(f"target size must be positive, got {width}x{height}")
    image = image.convert("RGB")
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
