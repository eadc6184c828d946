"""A vision-language model's image encoder: the vision tower and projector in a jitted call of
their own, images batched to a bucket (1, 2, 4, ... images), the features of each image kept
by its content hash (least recently used first out), so a repeated image is not encoded again.

Images are encoded when their request is added, on the engine's thread, before the request is
scheduled: the features then travel with the request to each step that computes its image
tokens (InputPreparer.image_features)."""
from __future__ import annotations

from collections import OrderedDict

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


class ImageEncoder:
    def __init__(self, graphdef, state, max_batch: int, cache_images: int = 64):
        self.state = state
        self.cache_images = cache_images
        self.buckets = [1 << i for i in range(max(1, max_batch - 1).bit_length() + 1)]
        self._fn = jax.jit(lambda state, px: nnx.merge(graphdef, state).encode_images(px).astype(jnp.float32))
        self._cache: OrderedDict[str, np.ndarray] = OrderedDict()
        self.images_encoded = 0  # images run through the tower (cache misses)
        self.cache_hits = 0

    def encode(self, pixels: list[np.ndarray], hashes: list[str]) -> list[np.ndarray]:
        """Each image's features [tokens_per_image, E] (f32), from the cache where its hash
        is there."""
        todo = {h: p for p, h in zip(pixels, hashes) if h not in self._cache}
        self.cache_hits += len(hashes) - len(todo)
        items = list(todo.items())
        while items:
            n = min(len(items), self.buckets[-1])
            B = next(b for b in self.buckets if b >= n)
            batch = np.zeros((B, *items[0][1].shape), np.float32)
            for i, (_, p) in enumerate(items[:n]):
                batch[i] = p
            out = np.asarray(self._fn(self.state, batch))
            for i, (h, _) in enumerate(items[:n]):
                self._cache[h] = out[i]
            self.images_encoded += n
            items = items[n:]
        feats = []
        for h in hashes:
            self._cache.move_to_end(h)
            feats.append(self._cache[h])
        while len(self._cache) > max(self.cache_images, len(set(hashes))):
            self._cache.popitem(last=False)
        return feats
