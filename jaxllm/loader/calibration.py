"""SmoothQuant's calibration at load: the float model run over the calibration text, each
projection's input recorded per channel, and the smoothing vectors made from those maxima
(the method and its formulas: jaxllm.quantization.smoothquant)."""
from __future__ import annotations

import logging
import threading
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxllm.quantization import online_layout
from jaxllm.quantization.smoothquant import (CALIBRATION_CHUNK, CALIBRATION_TOKENS, calibration_chunks,
                                             smoothing_vector, weight_maxima)
from jaxllm.layers.attention_metadata import attention_metadata
from jaxllm.layers.attention_metadata import kv_cache_shape, table_width

logger = logging.getLogger(__name__)


def activation_maxima(graphdef, state, arch, chunks: list[list[int]]) -> dict[str, np.ndarray]:
    """Per input channel, max |x| over the chunks' tokens of the input of every projection
    site of the float model (graphdef, state): {"layers.<site>": [L, K]}. All chunks have
    one length (one compilation)."""
    maxima: dict[str, np.ndarray] = {}
    lock = threading.Lock()  # host callbacks may arrive from several XLA threads

    def sink(site, layer, amax):
        name = f"layers.{site}"
        with lock:
            if name not in maxima:
                maxima[name] = np.zeros((arch.num_layers, amax.shape[-1]), np.float32)
            maxima[name][int(layer)] = np.maximum(maxima[name][int(layer)], amax)

    def observe(site, layer, x):
        amax = jnp.max(jnp.abs(x.astype(jnp.float32)).reshape(-1, x.shape[-1]), axis=0)
        jax.debug.callback(partial(sink, site), layer, amax)

    T, bs = len(chunks[0]), 16
    width = table_width(T, bs)
    table = np.zeros((1, width), np.int32)
    table[0, :-(-T // bs)] = np.arange(1, 1 - (-T // bs))  # block 0 is the null block
    md = jax.tree.map(jnp.asarray, attention_metadata(np.zeros(1, np.int32), np.array([T], np.int32),
                                                      table, T, 1, bs))

    @jax.jit
    def forward(state, ids):
        model = nnx.merge(graphdef, state)
        kv = jnp.zeros(kv_cache_shape(arch, width + 1, bs), model.policy.activation)
        hidden, _ = model(kv, ids, md, observe=observe)
        return hidden[-1]

    for c in chunks:
        forward(state, jnp.asarray(c, jnp.int32)).block_until_ready()
    jax.effects_barrier()
    sites = type(nnx.merge(graphdef, state)).PROJECTION_SITES
    missing = [s for s in sites if f"layers.{s}" not in maxima]
    if missing:  # a family whose projections skip `observe` would be smoothed blind
        raise ValueError(f"SmoothQuant calibration saw no input for {missing} of {arch.architecture}")
    return maxima


def smoothing(graphdef, state, arch, specs: dict, weights: dict, tokenizer,
              alpha: float) -> tuple[dict[str, np.ndarray], dict]:
    """The smoothing vectors of w8a8's activation-quantized matrices ({name: [L, K]}) for
    the float model (graphdef, state) holding `weights`, and a record of how they were made."""
    start = time.perf_counter()
    chunk = min(CALIBRATION_CHUNK, arch.max_position_embeddings)
    chunks = calibration_chunks(tokenizer, CALIBRATION_TOKENS, chunk)
    maxima = activation_maxima(graphdef, state, arch, chunks)
    out = {}
    for name, spec in specs.items():
        layout = online_layout("w8a8", name, spec)
        if layout is None or layout.act != "int8":
            continue
        if name not in maxima:
            raise ValueError(f"SmoothQuant calibration has no activations for {name}")
        out[name] = smoothing_vector(maxima[name], weight_maxima(weights[name], spec.matrix), alpha)
    seconds = time.perf_counter() - start
    tokens = sum(len(c) for c in chunks)
    logger.info("SmoothQuant alpha %g: calibrated %d matrices on %d tokens in %.1f s", alpha,
                len(out), tokens, seconds)
    record = {"alpha": alpha, "calibration_tokens": tokens, "calibration_chunk": chunk,
              "calibration_text": "pydoc_data.topics, the last sorted topics"}
    return out, record
