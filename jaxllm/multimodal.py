"""Images for vision-language models: decoding (PIL images, data URLs), the checkpoint's own
preprocessing (CLIP's: the shortest edge resized, a centre crop, scaled and normalised per
channel, as its preprocessor_config.json says), and the content hash that keys an image's
tokens in the prefix cache and its features in the encoder cache."""
from __future__ import annotations

import base64
import binascii
import hashlib
import io
import json
import os
from dataclasses import dataclass

import numpy as np

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
MAX_ASPECT = 32  # longest side over shortest an image may have
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def load_image(source):
    """A PIL image from a PIL image, raw bytes or a `data:image/...;base64,` URL, as RGB. A
    source that does not decode is a ValueError saying so."""
    from PIL import Image, UnidentifiedImageError
    if isinstance(source, Image.Image):
        image = source
    else:
        data = source
        if isinstance(source, str):
            if not source.startswith("data:"):
                raise ValueError("image is not a data URL (data:image/...;base64,...)")
            head, _, payload = source.partition(",")
            if ";base64" not in head:
                raise ValueError("image data URL is not base64-encoded")
            try:
                data = base64.b64decode(payload, validate=True)
            except (binascii.Error, ValueError):
                raise ValueError("image data URL is not valid base64") from None
        if not isinstance(data, (bytes, bytearray)):
            raise ValueError(f"image must be a PIL image, bytes or a data URL, got {type(source).__name__}")
        try:
            image = Image.open(io.BytesIO(data))
            image.load()
        except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
            raise ValueError(f"image does not decode: {e}") from None
    if image.width < 1 or image.height < 1:
        raise ValueError("image is empty")
    return image.convert("RGB")


@dataclass(frozen=True)
class ImageProcessor:
    """CLIP's preprocessing, from a checkpoint's preprocessor_config.json (defaults: the
    vision tower's image size, OpenAI CLIP's mean and std, bicubic)."""
    shortest_edge: int
    crop: tuple[int, int]
    mean: tuple[float, ...] = OPENAI_CLIP_MEAN
    std: tuple[float, ...] = OPENAI_CLIP_STD
    resample: int = 3  # PIL.Image.BICUBIC
    rescale: float = 1 / 255
    do_resize: bool = True
    do_center_crop: bool = True
    do_normalize: bool = True

    @classmethod
    def for_checkpoint(cls, path: str | None, vision: dict) -> "ImageProcessor":
        size = vision["image_size"]
        cfg = {}
        file = os.path.join(path, "preprocessor_config.json") if path and os.path.isdir(path) else None
        if file and os.path.exists(file):
            with open(file) as f:
                cfg = json.load(f)
        edge = cfg.get("size", {"shortest_edge": size})
        edge = edge.get("shortest_edge", min(edge.get("height", size), edge.get("width", size))) \
            if isinstance(edge, dict) else int(edge)
        crop = cfg.get("crop_size", {"height": size, "width": size})
        crop = (crop["height"], crop["width"]) if isinstance(crop, dict) else (int(crop), int(crop))
        if crop != (size, size):
            raise ValueError(f"preprocessor crop_size {crop} does not match the vision tower's "
                             f"image_size {size}")
        return cls(int(edge), crop, tuple(cfg.get("image_mean", OPENAI_CLIP_MEAN)),
                   tuple(cfg.get("image_std", OPENAI_CLIP_STD)), int(cfg.get("resample", 3)),
                   float(cfg.get("rescale_factor", 1 / 255)), bool(cfg.get("do_resize", True)),
                   bool(cfg.get("do_center_crop", True)), bool(cfg.get("do_normalize", True)))

    def __call__(self, image) -> np.ndarray:
        """An image -> float32 [3, H, W] pixels."""
        image = load_image(image)
        if self.do_resize:
            w, h = image.size
            short, long = (w, h) if w <= h else (h, w)
            if long > MAX_ASPECT * short:  # (resized whole, a thin strip would be huge)
                raise ValueError(f"image of {w}x{h} pixels is too elongated: at most "
                                 f"{MAX_ASPECT}:1")
            new_long = int(self.shortest_edge * long / short)
            size = (self.shortest_edge, new_long) if w <= h else (new_long, self.shortest_edge)
            image = image.resize(size, resample=self.resample)
        a = np.asarray(image, dtype=np.float32)
        if self.do_center_crop:
            ch, cw = self.crop
            top, left = max(0, (a.shape[0] - ch) // 2), max(0, (a.shape[1] - cw) // 2)
            a = a[top:top + ch, left:left + cw]
            if a.shape[:2] != (ch, cw):  # smaller than the crop: padded with zeros, as HF pads
                pad = np.zeros((ch, cw, a.shape[2]), np.float32)
                t, l_ = (ch - a.shape[0]) // 2, (cw - a.shape[1]) // 2
                pad[t:t + a.shape[0], l_:l_ + a.shape[1]] = a
                a = pad
        a = a * self.rescale
        if self.do_normalize:
            a = (a - np.asarray(self.mean, np.float32)) / np.asarray(self.std, np.float32)
        return np.ascontiguousarray(a.transpose(2, 0, 1), dtype=np.float32)


def image_hash(pixels: np.ndarray) -> str:
    """The key of an image's tokens and features: its preprocessed pixels' bytes (two files
    that decode to the same pixels share it)."""
    return hashlib.sha256(np.ascontiguousarray(pixels).tobytes()).hexdigest()
