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

max|X_j| comes from the float model itself, run over a calibration text at load
(jaxllm.loader.calibration): the model's forward pass takes an `observe` callback that sees
each projection's input with its site and layer index, so calibration records them without a
second copy of the model. The text is the last topics of CPython's `pydoc_data.topics` (in every Python
install), disjoint from the first tokens of the same text that `jaxllm bench quality` scores.

q/k/v are one fused matrix reading one input, and gate/up another, so each fused matrix has
one vector, from the max over all its rows; the paper shares it the same way (it folds the
vector into the norm that feeds them). Here it is divided at run time instead: o and down
are smoothed too, which no preceding norm could absorb, and the norms stay as loaded.

Checkpoints from llm-compressor's SmoothQuant (compressed-tensors W8A8) have the vectors
folded into their norm weights already: they load as they are, with nothing to add.
"""
from __future__ import annotations

import numpy as np

DEFAULT_ALPHA = 0.5
CALIBRATION_TOKENS = 1024
CALIBRATION_CHUNK = 512
# s within these bounds: a channel that never fires (or a zero weight column) must not make
# an infinite or zero divisor
S_MIN, S_MAX = 1e-4, 1e4
EPS = 1e-5


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
