"""Calibration at load for SmoothQuant (w8a8) and AWQ (int4): the float model run over the
calibration text, each projection's input recorded per channel (and a sample of its rows for
AWQ), and the vectors made from them (the methods: jaxllm.quantization.smoothquant, .awq)."""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxllm.quantization import awq, int4_group_of, online_layout, to_out_in
from jaxllm.quantization.smoothquant import (CALIBRATION_CHUNK, CALIBRATION_TOKENS, calibration_chunks,
                                             smoothing_vector, weight_maxima)
from jaxllm.layers.attention_metadata import attention_metadata
from jaxllm.layers.attention_metadata import kv_cache_shape, table_width

logger = logging.getLogger(__name__)


@dataclass
class SiteStats:
    """What calibration keeps of one projection site's input, per layer: max |x| and mean |x|
    per channel ([L, K]), and `rows` sampled tokens ([L, R, K]; R = 0 unless asked)."""
    maxima: np.ndarray
    abs_sum: np.ndarray
    count: np.ndarray
    rows: list

    @property
    def mean_abs(self) -> np.ndarray:
        return self.abs_sum / np.maximum(self.count, 1)[:, None]

    def sample(self, layer: int) -> np.ndarray:
        return np.concatenate(self.rows[layer])


def activation_stats(graphdef, state, arch, chunks: list[list[int]],
                     rows_per_chunk: int = 0) -> dict[str, SiteStats]:
    """Per input channel, max |x| and mean |x| over the chunks' tokens of the input of every
    projection site of the float model (graphdef, state), and rows_per_chunk of its tokens
    from each chunk, evenly spaced: {"layers.<site>": SiteStats}. All chunks have one length
    (one compilation)."""
    stats: dict[str, SiteStats] = {}
    lock = threading.Lock()  # host callbacks may arrive from several XLA threads

    def sink(site, layer, amax, asum, rows):
        name, i = f"layers.{site}", int(layer)
        with lock:
            if name not in stats:
                K, L = amax.shape[-1], arch.num_layers
                stats[name] = SiteStats(np.zeros((L, K), np.float32), np.zeros((L, K), np.float64),
                                        np.zeros(L, np.int64), [[] for _ in range(L)])
            st = stats[name]
            st.maxima[i] = np.maximum(st.maxima[i], amax)
            st.abs_sum[i] += asum
            st.count[i] += T
            if rows_per_chunk:
                st.rows[i].append(np.asarray(rows, np.float32))

    def observe(site, layer, x):
        a = jnp.abs(x.astype(jnp.float32)).reshape(-1, x.shape[-1])
        rows = x.reshape(-1, x.shape[-1])[::max(1, T // rows_per_chunk)][:rows_per_chunk] \
            if rows_per_chunk else jnp.zeros((0, x.shape[-1]))
        jax.debug.callback(partial(sink, site), layer, a.max(0), a.sum(0), rows.astype(jnp.float32))

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
    missing = [s for s in sites if f"layers.{s}" not in stats]
    if missing:  # a family whose projections skip `observe` would be calibrated blind
        raise ValueError(f"calibration saw no input for {missing} of {arch.architecture}")
    return stats


def activation_maxima(graphdef, state, arch, chunks: list[list[int]]) -> dict[str, np.ndarray]:
    """Per input channel, max |x| of every projection site's input: {"layers.<site>": [L, K]}."""
    return {n: st.maxima for n, st in activation_stats(graphdef, state, arch, chunks).items()}


def _chunks(arch, tokenizer) -> list[list[int]]:
    return calibration_chunks(tokenizer, CALIBRATION_TOKENS, min(CALIBRATION_CHUNK, arch.max_position_embeddings))


def smoothing(graphdef, state, arch, specs: dict, weights: dict, tokenizer,
              alpha: float) -> tuple[dict[str, np.ndarray], dict]:
    """The smoothing vectors of w8a8's activation-quantized matrices ({name: [L, K]}) for
    the float model (graphdef, state) holding `weights`, and a record of how they were made."""
    start = time.perf_counter()
    chunks = _chunks(arch, tokenizer)
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
    record = {"alpha": alpha, "calibration_tokens": tokens, "calibration_chunk": len(chunks[0]),
              "calibration_text": "pydoc_data.topics, the last sorted topics"}
    return out, record


def awq_scaling(graphdef, state, arch, specs: dict, weights: dict, tokenizer,
                group_size: int | None) -> tuple[dict[str, np.ndarray], dict]:
    """AWQ's vectors of int4's layer matrices ({name: [L, K]}) for the float model (graphdef,
    state) holding `weights`, searched per layer and matrix, and a record of the search."""
    start = time.perf_counter()
    chunks = _chunks(arch, tokenizer)
    stats = activation_stats(graphdef, state, arch, chunks, -(-awq.SAMPLE_ROWS // len(chunks)))
    out, alphas, ratios = {}, {}, []
    for name, spec in specs.items():
        layout = online_layout("int4", name, spec, smooth=True, group_size=group_size)
        if layout is None or not layout.smooth or name not in weights:
            continue
        if name not in stats:
            raise ValueError(f"AWQ calibration has no activations for {name}")
        st, w = stats[name], weights[name]
        group = int4_group_of(name, st.maxima.shape[-1], group_size)
        vectors = []
        for i in range(w.shape[0]):
            m = np.asarray(to_out_in(np.asarray(w[i], np.float32), spec.matrix))
            s, alpha, ratio = awq.search(m, st.sample(i), st.mean_abs[i], group)
            vectors.append(s)
            alphas.setdefault(name, []).append(alpha)
            ratios.append(ratio)
        out[name] = np.stack(vectors)
    seconds = time.perf_counter() - start
    tokens = sum(len(c) for c in chunks)
    logger.info("AWQ: searched %d layer matrices on %d tokens in %.1f s (output error %.2fx "
                "round-to-nearest's, median)", len(ratios), tokens, seconds,
                float(np.median(ratios)) if ratios else 1.0)
    record = {"method": "awq", "grid": awq.GRID, "sample_rows": awq.SAMPLE_ROWS,
              "calibration_tokens": tokens, "calibration_chunk": len(chunks[0]),
              "calibration_text": "pydoc_data.topics, the last sorted topics",
              "alphas": alphas, "seconds": round(seconds, 1)}
    return out, record
