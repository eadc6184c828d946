"""SmoothQuant (w8a8 with smoothing vectors) and AWQ scale search: the outlier channel they
ease, in a tiny Llama, their convert round trips, and refusals."""
import os

import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.layers.dtype_policy import uniform_policy
from jaxllm.loader import load_model
from jaxllm.quantization import formats as F
from jaxllm.quantization.qweight import QWeight, matmul_xla
from model_util import all_logits, hf_logits
from quant_util import IDS, rel, tiny_hf  # noqa: F401 (tiny_hf: a fixture)


def _w8a8_reference(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """numpy W8A8: x per token and w per output channel to symmetric int8, the product."""
    sx = np.abs(x).max(-1, keepdims=True) / 127.0
    xq = np.clip(np.rint(x / sx), -127, 127)
    h = F.quantize_int8(w)
    return (xq @ h.codes().astype(np.float64).T) * sx * h.scale[:, 0].astype(np.float64)


def test_smoothquant_eases_an_activation_outlier_channel():
    """One input channel 50x the others (LLMs' activation outliers): per-token int8 spends its
    range on it. Smoothing (alpha 0.5) leaves x @ W^T unchanged in exact arithmetic and cuts
    the mean quantization error to about a quarter; the model's path (quantize_online + the XLA matmul)
    computes the numpy reference."""
    from jaxllm.models.base import ParamSpec
    from jaxllm.quantization import quantize_online
    from jaxllm.quantization.smoothquant import S_MAX, S_MIN, smoothing_vector, weight_maxima
    rng = np.random.default_rng(3)
    K, N = 128, 96
    x = rng.standard_normal((64, K))
    x[:, 7] *= 50.0
    w = rng.standard_normal((N, K)) * 0.05
    exact = x @ w.T
    s = smoothing_vector(np.abs(x).max(0), np.abs(w).max(0), 0.5)
    np.testing.assert_allclose((x / s) @ (w * s).T, exact, rtol=1e-9, atol=1e-9)
    err_plain = np.abs(_w8a8_reference(x, w) - exact).mean()
    err_smooth = np.abs(_w8a8_reference(x / s, w * s) - exact).mean()
    assert err_smooth < 0.4 * err_plain, (err_smooth, err_plain)  # measured: 0.24
    # bounded where a channel never fires or a weight column is zero
    s0 = smoothing_vector(np.array([0.0, 1.0, 1e9]), np.array([1.0, 0.0, 1e-9]), 0.5)
    assert np.all(np.isfinite(s0)) and s0.min() >= S_MIN and s0.max() <= S_MAX
    # through the loader's quantizer and the model's matmul (one layer of a stack, [in, out])
    spec = ParamSpec((1, K, N), ("layers", "mlp", "embed"), matrix="in_out")
    w_io = w.T[None].astype(np.float32)
    np.testing.assert_array_equal(weight_maxima(w_io, "in_out")[0], np.abs(w.astype(np.float32)).max(0))
    out, layouts = quantize_online({"layers.w_down": w_io}, {"layers.w_down": spec}, "w8a8",
                                   {"layers.w_down": s[None]})
    h = out["layers.w_down"]
    assert layouts["layers.w_down"].smooth and layouts["layers.w_down"].act == "int8"
    np.testing.assert_array_equal(h.smooth[0], s)
    np.testing.assert_allclose(h.dequantize()[0], w, atol=float(h.scale.max()) / 2 / s.min() + 1e-6)
    qw = QWeight(*(jnp.asarray(a) for a in (h.q, h.scale)), None, jnp.asarray(h.smooth), jnp.int32(0), "int8", "xla")
    got = np.asarray(matmul_xla(jnp.asarray(x, jnp.float32), qw, uniform_policy(jnp.float32)))
    ref = _w8a8_reference((x / s).astype(np.float32), (w * s).astype(np.float32))
    assert rel(got, ref) < 1e-3


@pytest.fixture(scope="module")
def outlier_hf(tiny_hf, tmp_path_factory, tokenizer_dir):
    """The tiny Llama with an outlier channel planted in front of q/k/v and gate/up, the way
    trained LLMs have them: the norm's weight on one channel x40 and the matrices' columns
    reading it /40, so the float model computes the same function."""
    import copy

    import torch
    _, hf = tiny_hf
    model = copy.deepcopy(hf)
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            for norm, projs, j in ((layer.input_layernorm, (layer.self_attn.q_proj, layer.self_attn.k_proj,
                                                            layer.self_attn.v_proj), 5 + i),
                                   (layer.post_attention_layernorm, (layer.mlp.gate_proj, layer.mlp.up_proj), 11 + i)):
                norm.weight[j] *= 40.0
                for p in projs:
                    p.weight[:, j] /= 40.0
    d = tmp_path_factory.mktemp("outlier")
    model.save_pretrained(d, safe_serialization=True)
    for name in os.listdir(tokenizer_dir):
        with open(os.path.join(tokenizer_dir, name), "rb") as src, open(d / name, "wb") as dst:
            dst.write(src.read())
    return str(d), model


def test_smoothquant_in_a_tiny_llama(outlier_hf):
    """w8a8 with SmoothQuant calibrated at load: the layer matrices carry smoothing vectors
    (the head stays float), the logits stay near the float model's and, with activation
    outliers, much nearer than plain w8a8's; the CPU kernels equal the XLA path."""
    path, hf = outlier_hf
    ref = hf_logits(hf, IDS)
    smooth = load_model(path, jnp.float32, load_tokenizer=False, quantization="w8a8", smoothquant_alpha=0.5)
    layouts = dict(smooth.quant.layouts)
    assert {n for n, lay in layouts.items() if lay.smooth} == {"layers.wqkv", "layers.wo",
                                                              "layers.w_gate_up", "layers.w_down"}
    assert "lm_head" not in layouts  # the head stays float
    assert smooth.smoothquant["alpha"] == 0.5 and smooth.smoothquant["calibration_tokens"] > 0
    s = np.asarray(smooth.state["layers"]["wqkv"]["smooth"][...])
    assert s.shape == (2, 64) and s[0, 5] > 4 * np.median(s[0])  # the outlier channel moved most
    plain = load_model(path, jnp.float32, load_tokenizer=False, quantization="w8a8")
    got, base = all_logits(smooth, IDS), all_logits(plain, IDS)
    assert rel(got, ref) < 0.05
    assert rel(got, ref) < 0.5 * rel(base, ref), (rel(got, ref), rel(base, ref))
    xla = load_model(path, jnp.float32, load_tokenizer=False, quantization="w8a8", smoothquant_alpha=0.5,
                     matmul_backend="xla")
    assert xla.quant.backend == "xla" and smooth.quant.backend == "cpu"
    assert rel(got, all_logits(xla, IDS)) < 1e-4


def test_smoothquant_convert_round_trip(outlier_hf, tmp_path, capsys):
    """`jaxllm convert -q w8a8 --smoothquant-alpha A` writes the smoothing vectors and the alpha
    into the Orbax checkpoint; it restores as the same model; another alpha asked of it is
    refused with the convert command that makes it."""
    from jaxllm.cli import main
    from jaxllm.loader import orbax as jo
    path, _ = outlier_hf
    out = str(tmp_path / "sq")
    assert main(["convert", path, out, "--dtype", "float32", "-q", "w8a8", "--smoothquant-alpha", "0.6"]) == 0
    meta = jo.read_metadata(out)
    assert meta["quantization"] == "w8a8" and meta["smoothquant"]["alpha"] == 0.6
    assert meta["quant_layouts"]["layers.w_down"]["smooth"] is True
    assert meta["params"]["layers.w_down.smooth"] == {"shape": [2, 128], "dtype": "float32"}
    ref = load_model(path, jnp.float32, load_tokenizer=False, quantization="w8a8", smoothquant_alpha=0.6)
    got = load_model(out, jnp.float32, load_tokenizer=False)
    assert got.quant == ref.quant and got.smoothquant == ref.smoothquant
    for name in ("wqkv", "wo", "w_gate_up", "w_down"):
        np.testing.assert_array_equal(np.asarray(got.state["layers"][name]["smooth"][...]),
                                      np.asarray(ref.state["layers"][name]["smooth"][...]))
    np.testing.assert_array_equal(all_logits(got, IDS[:11]), all_logits(ref, IDS[:11]))
    load_model(out, jnp.float32, load_tokenizer=False, quantization="w8a8", smoothquant_alpha=0.6)
    with pytest.raises(ValueError, match=r"SmoothQuant vectors of alpha 0.6 but smoothquant_alpha=0.8"
                                         r".*--quantization w8a8 --smoothquant-alpha 0.8"):
        load_model(out, jnp.float32, load_tokenizer=False, quantization="w8a8", smoothquant_alpha=0.8)
    # --smoothquant alone: alpha 0.5; without w8a8: refused before anything is written
    assert main(["convert", path, str(tmp_path / "no"), "--smoothquant"]) == 1
    assert "smoothquant_alpha needs quantization='w8a8'" in capsys.readouterr().err
    assert not (tmp_path / "no").exists()


def test_bad_smoothquant_inputs(tiny_hf):
    from jaxllm.cli import _smoothquant_alpha
    from jaxllm.config import EngineConfig
    path, _ = tiny_hf
    for bad in (1.5, -0.1, float("nan"), "0.5", True):
        with pytest.raises(ValueError, match="smoothquant_alpha must be a number in"):
            EngineConfig(quantization="w8a8", smoothquant_alpha=bad)
    for method in (None, "int8", "fp8"):
        with pytest.raises(ValueError, match="smoothquant_alpha needs quantization='w8a8'"):
            EngineConfig(quantization=method, smoothquant_alpha=0.5)
    with pytest.raises(ValueError, match="folded into its norm weights"):
        EngineConfig(quantization="compressed-tensors", smoothquant_alpha=0.5)
    with pytest.raises(ValueError, match="smoothquant_alpha needs quantization='w8a8'"):
        load_model(path, jnp.float32, load_tokenizer=False, smoothquant_alpha=0.5)
    assert EngineConfig(quantization="w8a8", smoothquant_alpha=0).smoothquant_alpha == 0
    # the CLI: --smoothquant is alpha 0.5, --smoothquant-alpha A implies it
    ns = lambda flag, alpha: type("A", (), {"smoothquant": flag, "smoothquant_alpha": alpha})()  # noqa: E731
    assert (_smoothquant_alpha(ns(True, None)), _smoothquant_alpha(ns(None, 0.8)),
            _smoothquant_alpha(ns(True, 0.8)), _smoothquant_alpha(ns(None, None))) == (0.5, 0.8, 0.8, None)


# AWQ (int4 with activation-aware scaling) and int4's group sizes
def test_awq_search_scales_the_outlier_channel():
    """On rows with one large input channel, AWQ's search picks a scale that grows that
    channel's weights and lowers the output error below round-to-nearest's; on flat
    activations the search may keep alpha 0, which is round-to-nearest exactly."""
    from jaxllm.quantization import awq
    rng = np.random.default_rng(3)
    w = rng.normal(0, 1, (64, 128)).astype(np.float32)
    x = rng.normal(0, 1, (128, 128)).astype(np.float32)
    x[:, 7] *= 50.0
    s, alpha, ratio = awq.search(w, x, np.abs(x).mean(0), 32)
    assert alpha > 0 and ratio < 0.8, (alpha, ratio)
    assert s[7] == s.max() and s[7] > 4 * np.median(s)
    s0, _, ratio0 = awq.search(w, x, np.ones(128, np.float32), 32)  # no channel stands out
    np.testing.assert_allclose(s0, 1.0, rtol=1e-6)
    assert ratio0 == 1.0
    # the fake quantizer is the loader's own rounding
    np.testing.assert_allclose(np.asarray(awq.fake_int4(jnp.asarray(w), 32)),
                               F.quantize_int4(w, 32).dequantize(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("group", [32, 64])
def test_awq_in_a_tiny_llama(outlier_hf, group):
    """int4 with AWQ at each group size: the layer matrices carry AWQ's vectors (the int8
    embedding and head do not), the logits are nearer the float model's
    than round-to-nearest's (the planted outlier's weights, divided by 40, round to a few
    levels without it), and the CPU kernels equal the XLA path."""
    path, hf = outlier_hf
    ref = hf_logits(hf, IDS)
    awq = load_model(path, jnp.float32, load_tokenizer=False, quantization="int4",
                     quantization_group_size=group, int4_calibration="awq")
    layouts = dict(awq.quant.layouts)
    assert {n for n, lay in layouts.items() if lay.smooth} == {"layers.wqkv", "layers.wo",
                                                              "layers.w_gate_up", "layers.w_down"}
    assert {lay.group for n, lay in layouts.items() if lay.kind == "int4"} == {group}
    assert layouts["lm_head"].kind == "int8" and not layouts["lm_head"].smooth
    assert awq.smoothquant["method"] == "awq" and awq.smoothquant["calibration_tokens"] > 0
    s = np.asarray(awq.state["layers"]["wqkv"]["smooth"][...])
    assert s.shape == (2, 64) and not np.allclose(s, 1.0)
    rtn = load_model(path, jnp.float32, load_tokenizer=False, quantization="int4",
                     quantization_group_size=group)  # round to nearest, the default
    got, base = all_logits(awq, IDS), all_logits(rtn, IDS)
    assert rel(got, ref) < 0.5 * rel(base, ref), (rel(got, ref), rel(base, ref))
    xla = load_model(path, jnp.float32, load_tokenizer=False, quantization="int4",
                     quantization_group_size=group, int4_calibration="awq", matmul_backend="xla")
    assert xla.quant.backend == "xla" and awq.quant.backend == "cpu"
    np.testing.assert_array_equal(np.asarray(xla.state["layers"]["wqkv"]["smooth"][...]), s)
    assert rel(got, all_logits(xla, IDS)) < 1e-4


def test_awq_convert_round_trip(outlier_hf, tmp_path):
    """`jaxllm convert -q int4 --quantization-group-size 64 --int4-calibration awq` stores the
    codes and AWQ's vectors; the checkpoint restores as the model made at load, and the int4
    options asked of it again are refused (they were applied when converting)."""
    from jaxllm.cli import main
    from jaxllm.loader import orbax as jo
    path, _ = outlier_hf
    out = str(tmp_path / "awq")
    assert main(["convert", path, out, "--dtype", "float32", "-q", "int4",
                 "--quantization-group-size", "64", "--int4-calibration", "awq"]) == 0
    meta = jo.read_metadata(out)
    assert meta["quant_layouts"]["layers.w_down"]["smooth"] is True
    assert meta["quant_layouts"]["layers.w_down"]["group"] == 64 and meta["smoothquant"]["method"] == "awq"
    ref = load_model(path, jnp.float32, load_tokenizer=False, quantization="int4",
                     quantization_group_size=64, int4_calibration="awq")
    got = load_model(out, jnp.float32, load_tokenizer=False)
    assert got.quant == ref.quant
    np.testing.assert_array_equal(all_logits(got, IDS), all_logits(ref, IDS))
    with pytest.raises(ValueError, match="leave quantization_group_size and int4_calibration unset"):
        load_model(out, jnp.float32, load_tokenizer=False, quantization="int4", int4_calibration="awq")


def test_bad_int4_options(tiny_hf):
    from jaxllm.cli import main
    from jaxllm.config import EngineConfig
    path, _ = tiny_hf
    for bad in (16, 48, 256, 0, True, "64"):
        with pytest.raises(ValueError, match=r"quantization_group_size must be one of \(32, 64, 128\)"):
            EngineConfig(quantization="int4", quantization_group_size=bad)
    for method in (None, "int8", "w8a8", "awq"):
        with pytest.raises(ValueError, match="quantization_group_size needs quantization='int4'"):
            EngineConfig(quantization=method, quantization_group_size=64)
        with pytest.raises(ValueError, match="int4_calibration needs quantization='int4'"):
            EngineConfig(quantization=method, int4_calibration="awq")
    with pytest.raises(ValueError, match="int4_calibration must be one of"):
        EngineConfig(quantization="int4", int4_calibration="gptq")
    # the tiny model's hidden size is 64: groups of 128 do not divide it
    with pytest.raises(ValueError, match=r"quantization_group_size=128 does not divide the input "
                                         r"size 64 of \S+; choose 32 or 64"):
        load_model(path, jnp.float32, load_tokenizer=False, quantization="int4",
                   quantization_group_size=128, int4_calibration="none")
    with pytest.raises(SystemExit):  # the flag offers the same choices
        main(["generate", "-q", "int4", "--quantization-group-size", "48"])
