"""SmoothQuant (Xiao et al., 2022) for w8a8: calibration and smoothing vectors.

w8a8 quantizes each token's activations with one int8 scale. LLMs' activations have a few
input channels far larger than the rest (the same channels in every token), so that scale is
set by the outliers and the other channels round to a handful of levels. SmoothQuant moves
part of that range into the weights, which quantize per output channel and are flat: for
input channel j of a matrix W [N, K],

    s_j = max|X_j|^alpha / max_n |W[n, j]|^(1 - alpha)

and the matrix is quantized as W[:, j] * s_j while activations are divided by s_j before their
per-token quantization (the CPU kernel and the XLA path do it with a QWeight's `smooth`
vector). In exact arithmetic x @ W^T is unchanged; alpha sets how much of the range moves.

max|X_j| comes from the float model itself, run over a calibration text: its forward pass's
`lora=` hook names every projection site and receives the layer's slice of the scanned
weights, so a probe put there records each projection's input without a second copy of the
model. The text is the last topics of CPython's `pydoc_data.topics` (in every Python
install), disjoint from the first tokens of the same text that `jaxllm bench quality` scores.

q/k/v are one fused matrix reading one input, and gate/up another, so each fused matrix has
one vector, from the max over all its rows; the paper shares it the same way (it folds the
vector into the norm that feeds them). Here it is divided at run time instead: o and down
are smoothed too, which no preceding norm could absorb, and the norms stay as loaded.

Checkpoints from llm-compressor's SmoothQuant (compressed-tensors W8A8) have the vectors
folded into their norm weights already: they load as they are, with nothing to add.
"""
from __future__ import annotations

import logging
import threading
import time
from functools import partial

import numpy as np

logger = logging.getLogger(__name__)

DEFAULT_ALPHA = 0.5
CALIBRATION_TOKENS = 1024
CALIBRATION_CHUNK = 512
# s within these bounds: a channel that never fires (or a zero weight column) must not make
# an infinite or zero divisor
S_MIN, S_MAX = 1e-4, 1e4
EPS = 1e-5
SITES = ("wqkv", "wo", "w_gate_up", "w_down")  # the model's projection sites under `lora=`


def _topics() -> list[str]:
    from pydoc_data.topics import topics
    return [topics[k] for k in sorted(topics)]


def corpus_text() -> str:
    """CPython's language documentation, sorted topics (the quality benchmark's text)."""
    return "\n\n".join(_topics())


def calibration_text(num_chars: int) -> tuple[str, int]:
    """The last topics of corpus_text() holding at least num_chars characters, and the
    offset in corpus_text() where they start (evaluations stay before it)."""
    parts = _topics()
    first = len(parts)
    while first > 0 and sum(len(p) + 2 for p in parts[first:]) < num_chars:
        first -= 1
    offset = sum(len(p) + 2 for p in parts[:first])
    return "\n\n".join(parts[first:]), offset


def calibration_chunks(tokenizer, num_tokens: int = CALIBRATION_TOKENS,
                       chunk: int = CALIBRATION_CHUNK) -> list[list[int]]:
    """num_tokens tokens from the end of the calibration text, cut into whole chunks."""
    text, _ = calibration_text(8 * num_tokens)  # English prose: about 4 characters a token
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][-num_tokens:]
    chunks = [ids[i:i + chunk] for i in range(0, len(ids) - chunk + 1, chunk)]
    if not chunks:
        raise ValueError(f"SmoothQuant calibration: fewer than {chunk} tokens of text")
    return chunks


def activation_maxima(graphdef, state, arch, chunks: list[list[int]]) -> dict[str, np.ndarray]:
    """Per input channel, max |x| over the chunks' tokens of the input of every projection
    site of the float model (graphdef, state): {"layers.<site>": [L, K]}. All chunks have
    one length (one compilation)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxllm.runner.model_runner import attention_metadata, kv_cache_shape, table_width

    maxima: dict[str, np.ndarray] = {}
    lock = threading.Lock()  # host callbacks may arrive from several XLA threads

    def sink(site, layer, amax):
        name = f"layers.{site}"
        with lock:
            if name not in maxima:
                maxima[name] = np.zeros((arch.num_layers, amax.shape[-1]), np.float32)
            maxima[name][int(layer)] = np.maximum(maxima[name][int(layer)], amax)

    class Probe:
        """Stands in for a step's LoRA inputs: `weights` are scanned with the layers' (so
        each layer's hook knows its index) and `hook` sees each projection's input."""

        def __init__(self):
            self.weights = {"layer": jnp.arange(arch.num_layers, dtype=jnp.int32)}

        def hook(self, site, layer_weights, policy):
            def record(x, y):
                amax = jnp.max(jnp.abs(x.astype(jnp.float32)).reshape(-1, x.shape[-1]), axis=0)
                jax.debug.callback(partial(sink, site), layer_weights["layer"], amax)
                return y
            return record

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
        hidden, _ = model(kv, ids, md, lora=Probe())
        return hidden[-1]

    for c in chunks:
        forward(state, jnp.asarray(c, jnp.int32)).block_until_ready()
    jax.effects_barrier()
    missing = [s for s in SITES if f"layers.{s}" not in maxima]
    if missing:  # a family whose projections skip the hook would be smoothed blind
        raise ValueError(f"SmoothQuant calibration saw no input for {missing} of {arch.architecture}")
    return maxima


def smoothing_vector(act_max: np.ndarray, w_max: np.ndarray, alpha: float) -> np.ndarray:
    """s = act_max^alpha / w_max^(1 - alpha) per input channel ([.., K] each), bounded."""
    a = np.maximum(np.asarray(act_max, np.float64), EPS)
    w = np.maximum(np.asarray(w_max, np.float64), EPS)
    return np.clip(a ** alpha / w ** (1.0 - alpha), S_MIN, S_MAX).astype(np.float32)


def weight_maxima(w: np.ndarray, matrix: str) -> np.ndarray:
    """max |W| over the output channels, per input channel: [(L,) K], layer by layer."""
    axis = -1 if matrix == "in_out" else -2
    if w.ndim == 3:
        return np.stack([np.abs(np.asarray(w[i], np.float32)).max(axis) for i in range(w.shape[0])])
    return np.abs(np.asarray(w, np.float32)).max(axis)


def smoothing(graphdef, state, arch, specs: dict, weights: dict, tokenizer,
              alpha: float) -> tuple[dict[str, np.ndarray], dict]:
    """The smoothing vectors of w8a8's activation-quantized matrices ({name: [L, K]}) for
    the float model (graphdef, state) holding `weights`, and a record of how they were made."""
    from jaxllm.quantization import online_layout
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
