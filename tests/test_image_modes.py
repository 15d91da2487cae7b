"""Input images of every PIL mode reach the model as the right 8-bit RGB pixels.

Each image is a real encoded file (PNG or TIFF bytes) taken through a validated row
(`Job.pil_images`, what the AR and DiT steps hand the engine) and the engine's `load_image`, and
compared with a reference conversion computed here with numpy. 8-bit modes must also stay
byte-identical to the official path (`exif_transpose` then `convert("RGB")`)."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image, ImageOps

from components.data.datasets import validate_rows
from components.data.images import to_rgb
from components.engine.image_processing import load_image

H, W = 24, 40


def gradient16() -> np.ndarray:
    """Samples over the whole 16-bit range: PIL's clipping turns all but the darkest 0.4 % white."""
    return np.linspace(0, 65535, H * W).round().astype(np.uint16).reshape(H, W)


def png16(samples: np.ndarray) -> bytes:
    """A 16-bit PNG written by hand (Pillow cannot write 16-bit RGB): gray for [H, W], RGB for
    [H, W, 3]."""
    color_type = 0 if samples.ndim == 2 else 2
    rows = samples.astype(">u2").reshape(samples.shape[0], -1)
    raw = b"".join(b"\x00" + row.tobytes() for row in rows)

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))

    ihdr = struct.pack(">IIBBBBB", samples.shape[1], samples.shape[0], 16, color_type, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")


def encoded(image: Image.Image, fmt: str) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return buf.getvalue()


def through_row(data: bytes) -> np.ndarray:
    """The pixels the engine gets for a row whose image is `data`."""
    valid, errors = validate_rows([{"id": "r", "instruction": "make it blue", "image": data}], "edit")
    assert errors == [] and len(valid) == 1
    image = load_image(valid[0].pil_images()[0])
    assert image.mode == "RGB" and image.size == (W, H)
    return np.asarray(image)


def gray3(gray: np.ndarray) -> np.ndarray:
    return np.repeat(gray[:, :, None], 3, axis=2)


def test_16bit_gray_png_is_scaled_not_clipped() -> None:
    samples = gradient16()
    data = png16(samples)
    assert Image.open(io.BytesIO(data)).mode == "I;16"
    got = through_row(data)
    np.testing.assert_array_equal(got, gray3((samples >> 8).astype(np.uint8)))
    assert (got == 255).mean() < 0.01  # PIL's own convert("RGB") makes 99.6 % of it white
    # the same picture stored as 16-bit RGB (which Pillow reads as its high bytes) gives the same pixels
    np.testing.assert_array_equal(got, through_row(png16(np.stack([samples] * 3, axis=2))))


def test_16bit_rgb_png() -> None:
    samples = np.stack([gradient16(), gradient16()[::-1], np.full((H, W), 40000, np.uint16)], axis=2)
    got = through_row(png16(samples))
    np.testing.assert_array_equal(got, (samples >> 8).astype(np.uint8))


def test_16bit_gray_tiff_big_and_little_endian() -> None:
    samples = gradient16()
    for mode, dtype in (("I;16", "<u2"), ("I;16B", ">u2")):
        data = encoded(Image.frombytes(mode, (W, H), samples.astype(dtype).tobytes()), "TIFF")
        assert Image.open(io.BytesIO(data)).mode == mode
        np.testing.assert_array_equal(through_row(data), gray3((samples >> 8).astype(np.uint8)), err_msg=mode)


def test_32bit_int_and_float_tiff() -> None:
    samples = gradient16().astype(np.int32)
    samples[0, :4] = [-5, 70000, 2**31 - 1, -(2**31)]  # outside 16 bits: clipped to black / white
    want = (np.clip(samples, 0, 65535) >> 8).astype(np.uint8)
    assert Image.open(io.BytesIO(encoded(Image.fromarray(samples), "TIFF"))).mode == "I"
    np.testing.assert_array_equal(through_row(encoded(Image.fromarray(samples), "TIFF")), gray3(want))

    unit = np.linspace(0.0, 1.0, H * W, dtype=np.float32).reshape(H, W)  # floats in [0, 1]
    got = through_row(encoded(Image.fromarray(unit), "TIFF"))
    np.testing.assert_array_equal(got, gray3(np.rint(unit.astype(np.float64) * 255).astype(np.uint8)))
    wide = unit * 300 - 20  # floats beyond [0, 1]: 0..255 values, clipped
    got = through_row(encoded(Image.fromarray(wide), "TIFF"))
    np.testing.assert_array_equal(got, gray3(np.clip(np.rint(wide.astype(np.float64)), 0, 255).astype(np.uint8)))


def test_palette_png() -> None:
    rng = np.random.default_rng(0)
    palette = rng.integers(0, 256, size=(256, 3), dtype=np.uint8)
    index = rng.integers(0, 256, size=(H, W), dtype=np.uint8)
    image = Image.frombytes("P", (W, H), index.tobytes())
    image.putpalette(palette.tobytes())
    image.info["transparency"] = 3  # transparency is dropped, as the official path drops it
    data = encoded(image, "PNG")
    assert Image.open(io.BytesIO(data)).mode == "P"
    np.testing.assert_array_equal(through_row(data), palette[index])


def test_gray_alpha_png() -> None:
    rng = np.random.default_rng(1)
    la = rng.integers(0, 256, size=(H, W, 2), dtype=np.uint8)
    data = encoded(Image.frombytes("LA", (W, H), la.tobytes()), "PNG")
    assert Image.open(io.BytesIO(data)).mode == "LA"
    np.testing.assert_array_equal(through_row(data), gray3(la[:, :, 0]))  # alpha dropped


def test_cmyk_tiff() -> None:
    rng = np.random.default_rng(2)
    cmyk = rng.integers(0, 256, size=(H, W, 4), dtype=np.uint8)
    data = encoded(Image.frombytes("CMYK", (W, H), cmyk.tobytes()), "TIFF")
    assert Image.open(io.BytesIO(data)).mode == "CMYK"
    c = cmyk.astype(np.float64)
    want = (255 - c[:, :, :3]) * (255 - c[:, :, 3:]) / 255  # RGB = (1 - C)(1 - K)
    got = through_row(data).astype(np.float64)
    assert np.abs(got - want).max() <= 1.0  # PIL rounds each product


@pytest.mark.parametrize("mode", ["1", "L", "P", "LA", "RGB", "RGBA", "CMYK", "YCbCr", "PA", "RGBX", "HSV", "LAB"])
def test_8bit_modes_are_byte_identical_to_the_official_path(mode: str) -> None:
    rng = np.random.default_rng(3)
    rgb = Image.fromarray(rng.integers(0, 256, size=(H, W, 3), dtype=np.uint8))
    image = rgb.convert(mode) if mode not in ("HSV", "LAB", "PA") else Image.frombytes(
        mode, (W, H), rng.integers(0, 256, size=(H, W, len(mode)), dtype=np.uint8).tobytes())
    ex = Image.Exif()
    ex[0x0112] = 6  # rotated: EXIF orientation applies in both
    image.info["exif"] = ex.tobytes()
    official = ImageOps.exif_transpose(image).convert("RGB")
    ours = load_image(image)
    assert ours.size == official.size == (H, W)
    assert ours.tobytes() == official.tobytes()
    assert to_rgb(image).tobytes() == image.convert("RGB").tobytes()


def test_16bit_gray_keeps_its_exif_orientation() -> None:
    samples = gradient16()
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90° clockwise to display
    buf = io.BytesIO()
    Image.fromarray(samples).save(buf, format="PNG", exif=exif)
    valid, _ = validate_rows([{"id": "r", "instruction": "i", "image": buf.getvalue()}], "edit")
    got = load_image(valid[0].pil_images()[0])
    want = np.rot90(gray3((samples >> 8).astype(np.uint8)), k=-1)
    np.testing.assert_array_equal(np.asarray(got), want)
