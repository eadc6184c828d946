"""Mixture-of-experts families: parity with HF on tiny random checkpoints, the grouped matmul
against a per-expert reference, quantized experts, and the refusals."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import MOE_VARIANTS, SMALL_ENGINE, make_tiny_checkpoint
from jaxllm.layers.dtype_policy import CPU_BF16_POLICY, uniform_policy
from jaxllm.layers.moe import ExpertStack, grouped_matmul, route
from jaxllm.loader import load_model
from model_util import all_logits


@pytest.fixture(scope="module")
def moe_checkpoints(tmp_path_factory):
    out = {}
    for variant in MOE_VARIANTS:
        d = tmp_path_factory.mktemp(variant)
        out[variant] = (str(d), make_tiny_checkpoint(d, variant))
    return out


def _hf_logits(hf, ids):
    import torch
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].numpy()


@pytest.mark.parametrize("variant,backend", [(v, "cpu") for v in sorted(MOE_VARIANTS)] + [("mixtral", "xla")])
def test_logits_match_hf(moe_checkpoints, variant, backend):
    """cpu: the experts through the CPU kernel; xla: through jax.lax.ragged_dot (the other
    families meet it in the quantized, bf16 and expert-parallel tests)."""
    path, hf = moe_checkpoints[variant]
    loaded = load_model(path, jnp.float32, load_tokenizer=False, matmul_backend=backend)
    ids = np.random.default_rng(0).integers(0, hf.config.vocab_size, size=37).tolist()
    ref = _hf_logits(hf, ids)
    ours = all_logits(loaded, ids)
    rel = np.abs(ours - ref).max() / np.abs(ref).max()
    assert rel < 1e-4, f"{variant}: max relative error {rel:.2e}"
    unrolled = all_logits(loaded, ids, scan_layers=False)
    np.testing.assert_allclose(unrolled, ours, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


@pytest.mark.parametrize("variant", sorted(MOE_VARIANTS))
def test_greedy_generation_matches_hf(moe_checkpoints, variant):
    import torch

    from jaxllm import LLM, SamplingParams
    path, hf = moe_checkpoints[variant]
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, hf.config.vocab_size, size=n).tolist() for n in (7, 19, 30)]
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True, **SMALL_ENGINE)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False,
                              min_new_tokens=8)[0, len(p):].tolist()
        assert list(o.outputs[0].token_ids) == ref


def _reference(x, w, sizes):
    out, start = np.zeros((x.shape[0], w.shape[-1]), np.float32), 0
    for e, n in enumerate(sizes):
        out[start:start + n] = x[start:start + n] @ w[e]
        start += n
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_grouped_matmul_against_per_expert_products(dtype):
    """Groups of 0, 1, 3 and 20 rows (20: the kernel's packed bf16 path), padding rows past
    the groups, and a layer picked from the stack in place; the kernel and ragged_dot agree
    with a product per expert."""
    rng = np.random.default_rng(0)
    L, X, K, N = 2, 4, 64, 48
    stack = rng.standard_normal((L, X, K, N)).astype(np.float32)
    sizes = np.array([3, 0, 20, 1], np.int32)
    M = int(sizes.sum()) + 5  # five padding rows
    x = rng.standard_normal((M, K)).astype(np.float32)
    policy = CPU_BF16_POLICY if dtype == "bfloat16" else uniform_policy(jnp.float32)
    w = jnp.asarray(stack, dtype)
    # what the products see: bf16 weights, and activations rounded to bf16 by the policy
    wf = np.asarray(w.astype(jnp.float32))
    xf = np.asarray(jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32)) if dtype == "bfloat16" else x
    want = _reference(xf, wf[1], sizes)
    from jaxllm.kernels.cpu import build
    assert build.available()
    fn = jax.jit(lambda x, s, g: grouped_matmul(x, ExpertStack(s, 1), g, policy))
    assert "jaxllm_grouped" in fn.lower(x, w, sizes).as_text()
    kernel = np.asarray(fn(x, w, sizes))
    ragged = np.asarray(jax.jit(lambda x, s, g: grouped_matmul(x, s[1], g, policy))(x, w, sizes))
    pallas = np.asarray(jax.jit(lambda x, s, g: grouped_matmul(x, s[1], g, policy, "pallas_interpret"))(x, w, sizes))
    for got in (kernel, ragged, pallas):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-4)
        assert not got[-5:].any()


def test_pallas_grouped_matmul_in_the_model(moe_checkpoints):
    """The GPU's grouped kernel, in its interpreter, through a whole model."""
    path, hf = moe_checkpoints["qwen3_moe"]
    loaded = load_model(path, jnp.float32, load_tokenizer=False, matmul_backend="pallas_interpret")
    ids = np.random.default_rng(6).integers(0, hf.config.vocab_size, size=19).tolist()
    ref = _hf_logits(hf, ids)
    assert np.abs(all_logits(loaded, ids) - ref).max() / np.abs(ref).max() < 1e-4


@pytest.mark.parametrize("M,K,N", [(1, 4096, 28672), (512, 14336, 4096), (40, 2048, 96)])
def test_pallas_grouped_matmul_lowers_for_cuda(M, K, N):
    """Mixtral's gate/up and down shapes at decode and prefill, and an OLMoE-sized one: the
    kernel lowers through Triton (no dense all-experts dot in the program)."""
    from jax import export

    from pallas_kernels.grouped_matmul import grouped_matmul as gm
    fn = jax.jit(lambda x, w, g: gm(x, w, g))
    exp = export.export(fn, platforms=["cuda"],
                        disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(
        jax.ShapeDtypeStruct((M, K), jnp.bfloat16), jax.ShapeDtypeStruct((8, K, N), jnp.bfloat16),
        jax.ShapeDtypeStruct((8,), jnp.int32))
    text = exp.mlir_module()
    assert "jaxllm_grouped_matmul" in text and "stablehlo.dot_general" not in text


def test_routing_weights():
    logits = jnp.array([[2.0, 1.0, 0.0, -1.0], [0.0, 0.0, 3.0, 1.0]])
    w, e = route(logits, 2, normalize=False)
    p = np.asarray(jax.nn.softmax(logits))
    assert np.asarray(e).tolist() == [[0, 1], [2, 3]]
    np.testing.assert_allclose(w, [[p[0, 0], p[0, 1]], [p[1, 2], p[1, 3]]], rtol=1e-6)
    w, _ = route(logits, 2, normalize=True)
    np.testing.assert_allclose(np.asarray(w).sum(-1), 1.0, rtol=1e-6)


@pytest.mark.parametrize("backend", ["cpu", "xla"])
def test_grouped_matmul_of_quantized_experts(backend):
    """A quantized stack [L, X, N, K] (int8 per channel) read at a layer equals the product
    with its dequantized experts."""
    from jaxllm.quantization import formats
    from jaxllm.quantization.qweight import QWeight
    rng = np.random.default_rng(1)
    L, X, K, N = 2, 3, 32, 16
    h = formats.quantize_int8(rng.standard_normal((L, X, N, K)).astype(np.float32))
    sizes = np.array([2, 0, 5], np.int32)
    x = rng.standard_normal((9, K)).astype(np.float32)
    w = QWeight(jnp.asarray(h.q), jnp.asarray(h.scale), layer=1, backend=backend)
    got = np.asarray(jax.jit(lambda x, w, g: grouped_matmul(x, w, g, uniform_policy(jnp.float32)))(x, w, sizes))
    dequantized = np.swapaxes(h.q[1].astype(np.float32) * h.scale[1], -1, -2)
    np.testing.assert_allclose(got, _reference(x, dequantized, sizes), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("method", ["int8", "int4", "fp8"])
def test_quantized_experts(moe_checkpoints, method):
    """Online quantization reaches the experts (their codes are stacks [L, X, N, K]); the CPU
    kernel and ragged_dot agree on them, and the logits stay near the float model's."""
    path, hf = moe_checkpoints["mixtral"]
    ids = np.random.default_rng(2).integers(0, hf.config.vocab_size, size=21).tolist()
    got = {}
    for backend in ("cpu", "xla"):
        loaded = load_model(path, jnp.float32, load_tokenizer=False, quantization=method,
                            matmul_backend=backend)
        # [layers, experts, out, in] codes (int4: two to a byte)
        assert loaded.state["layers"]["experts_gate_up"]["q"][...].shape == (2, 6, 64, 32 if method == "int4" else 64)
        got[backend] = all_logits(loaded, ids)
    ref = _hf_logits(hf, ids)
    scale = np.abs(ref).max()
    np.testing.assert_allclose(got["cpu"], got["xla"], atol=2e-3 * scale)
    rel = np.abs(got["cpu"] - ref).max() / scale
    # 8-bit weights (fp8: 3 mantissa bits, and its activations too; int4: 4 bits in groups of
    # 32) against float ones
    assert 1e-6 < rel < (0.02 if method == "int8" else 0.15), f"{method}: max relative error {rel:.2e}"


def test_bf16_kernel_matches_ragged_dot(moe_checkpoints):
    path, hf = moe_checkpoints["olmoe"]
    ids = np.random.default_rng(3).integers(0, hf.config.vocab_size, size=29).tolist()
    got = {b: all_logits(load_model(path, CPU_BF16_POLICY, load_tokenizer=False, matmul_backend=b), ids)
           for b in ("cpu", "xla")}
    ref = _hf_logits(hf, ids)
    scale = np.abs(ref).max()
    np.testing.assert_allclose(got["cpu"], got["xla"], atol=2e-3 * scale)
    assert np.abs(got["cpu"] - ref).max() / scale < 3e-2


def _edit_config(path, **over):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(over)
    (path / "config.json").write_text(json.dumps(cfg))


def test_refusals(tmp_path):
    make_tiny_checkpoint(tmp_path, "qwen3_moe")
    _edit_config(tmp_path, mlp_only_layers=[1])
    with pytest.raises(ValueError, match="mlp_only_layers"):
        load_model(str(tmp_path), jnp.float32, load_tokenizer=False)
    _edit_config(tmp_path, mlp_only_layers=[], num_experts_per_tok=9)
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        load_model(str(tmp_path), jnp.float32, load_tokenizer=False)
    dense = tmp_path / "dense"
    make_tiny_checkpoint(dense, "mistral")
    with pytest.raises(ValueError, match="enable_expert_parallel: .* has no experts"):
        load_model(str(dense), jnp.float32, load_tokenizer=False, expert_parallel=True)


def test_missing_expert_is_named(tmp_path):
    from safetensors.numpy import save_file

    from jaxllm.loader.safetensors_io import read_safetensors
    make_tiny_checkpoint(tmp_path, "mixtral")
    f = tmp_path / "model.safetensors"
    weights = {k: np.array(v) for k, v in read_safetensors(str(f)).items()
               if k != "model.layers.1.block_sparse_moe.experts.4.w3.weight"}
    save_file(weights, str(f))
    with pytest.raises(ValueError, match="missing layers.experts_gate_up .*layer 1 expert 4 up"):
        load_model(str(tmp_path), jnp.float32, load_tokenizer=False)


def test_grouped_equals_every_expert_reference(moe_checkpoints):
    """The grouped path against every expert applied to every token (what `bench moe` also
    times), through the whole model."""
    from dataclasses import replace

    from flax import nnx
    path, hf = moe_checkpoints["mixtral"]
    loaded = load_model(path, jnp.float32, load_tokenizer=False)
    ids = np.random.default_rng(4).integers(0, hf.config.vocab_size, size=17).tolist()
    grouped = all_logits(loaded, ids)
    model = nnx.merge(loaded.graphdef, loaded.state)
    model.moe_impl = "dense"
    graphdef, state = nnx.split(model)
    dense = all_logits(replace(loaded, graphdef=graphdef, state=state), ids)
    np.testing.assert_allclose(grouped, dense, rtol=1e-5, atol=1e-5 * np.abs(dense).max())


@pytest.mark.parametrize("variant", sorted(MOE_VARIANTS))
def test_gguf_matches_its_hf_twin(tmp_path, moe_checkpoints, variant):
    """Each family written as llama.cpp's converter writes it (Mixtral as "llama" with
    experts, the experts of a layer merged into one tensor per projection) loads as its own
    class and gives the HF model's logits."""
    from gguf_util import write_gguf
    path, hf = moe_checkpoints[variant]
    gguf_path = str(tmp_path / "moe.gguf")
    write_gguf(hf, gguf_path, checkpoint=path)  # (no tokenizer: the logits are compared)
    loaded = load_model(gguf_path, jnp.float32, load_tokenizer=False)
    assert loaded.arch.architecture == MOE_VARIANTS[variant][0]
    assert loaded.arch.num_experts == 6 and loaded.arch.num_experts_per_tok == 2
    ids = np.random.default_rng(5).integers(0, hf.config.vocab_size, size=23).tolist()
    ref = _hf_logits(hf, ids)
    rel = np.abs(all_logits(loaded, ids) - ref).max() / np.abs(ref).max()
    assert rel < 1e-4, f"{variant}: max relative error {rel:.2e}"
