"""Logits parity with HF transformers on tiny random checkpoints made here, saved as safetensors."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import TINY_VARIANTS, make_tiny_checkpoint
from jaxllm.loader import load_model
from model_util import PANEL_SHAPES, all_logits, assert_same_tokenizer, hf_logits


@pytest.mark.parametrize("variant", sorted(TINY_VARIANTS))
def test_logits_match_hf(tmp_path, variant):
    import torch

    sharded = variant == "llama3"  # one checkpoint goes through a sharded safetensors index
    hf = make_tiny_checkpoint(tmp_path, variant, max_shard_size="1MB" if sharded else None)
    if sharded:
        assert (tmp_path / "model.safetensors.index.json").exists()
    loaded = load_model(str(tmp_path), jnp.float32, tokenizer=None, load_tokenizer=False)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, hf.config.vocab_size, size=37).tolist()
    ours = all_logits(loaded, ids)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()
    assert ours.shape == ref.shape
    rel = np.abs(ours - ref).max() / np.abs(ref).max()
    assert rel < 1e-4, f"{variant}: max relative error {rel:.2e}"
    unrolled = all_logits(loaded, ids, scan_layers=False)
    np.testing.assert_allclose(unrolled, ours, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


def test_unsupported_architecture(tmp_path):
    import json
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="unsupported architecture.*GPT2LMHeadModel"):
        load_model(str(tmp_path), jnp.float32, load_tokenizer=False)


def test_missing_path():
    with pytest.raises(ValueError, match="does not exist"):
        load_model("/nonexistent/model/dir", jnp.float32)


def test_wrong_tensor_shape(tmp_path):
    from safetensors.numpy import load_file, save_file

    make_tiny_checkpoint(tmp_path, "mistral")
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    name = "model.layers.1.self_attn.k_proj.weight"
    tensors[name] = np.zeros((3, 5), np.float32)
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"k_proj.weight has shape \(3, 5\)"):
        load_model(str(tmp_path), jnp.float32, load_tokenizer=False)


def test_dummy_load_format_builds_real_shapes(tmp_path):
    make_tiny_checkpoint(tmp_path, "qwen3")
    loaded = load_model(str(tmp_path), jnp.bfloat16, load_format="dummy", load_tokenizer=False)
    leaves = jax.tree.leaves(loaded.state)
    assert all(x.dtype == jnp.bfloat16 for x in leaves)
    assert loaded.state["layers"]["q_norm"][...].shape == (2, 32)


def test_gguf_tokenizer_matches_transformers_and_caches(default_gguf, tmp_path, monkeypatch):
    """The default model's tokenizer is built from GGUF metadata without torch, exactly as
    transformers' own (torch-based) GGUF reader builds it; then it is read back from the cache."""
    import os

    from transformers import AutoTokenizer

    from jaxllm.loader import loader
    monkeypatch.setenv("JAXLLM_TOKENIZER_CACHE_DIR", str(tmp_path))
    fresh = loader.get_tokenizer(default_gguf)
    assert len(list(tmp_path.iterdir())) == 1
    cached = loader.get_tokenizer(default_gguf)
    ref = AutoTokenizer.from_pretrained(os.path.dirname(default_gguf),
                                        gguf_file=os.path.basename(default_gguf))
    assert_same_tokenizer(fresh, ref)
    assert_same_tokenizer(cached, ref)


@pytest.mark.parametrize("variant", ["llama3", "llama_bias"])
def test_gguf_matches_its_hf_twin(tmp_path, variant):
    """A tiny checkpoint written as GGUF the way llama.cpp converts it: Llama 3.1 RoPE scaling
    comes back from the rope_freqs tensor, biases from their tensors, and the logits equal the
    HF model's."""
    from gguf_util import write_gguf

    hf = make_tiny_checkpoint(tmp_path / "hf", variant)
    path = str(tmp_path / "tiny.gguf")
    write_gguf(hf, path)  # (no tokenizer: the logits are compared)
    loaded = load_model(path, jnp.float32, load_tokenizer=False)
    if variant == "llama3":
        assert loaded.arch.rope_scaling["rope_type"] == "freq_factors"
    ids = np.random.default_rng(1).integers(0, hf.config.vocab_size, size=90).tolist()
    ref = hf_logits(hf, ids)
    ours = all_logits(loaded, ids)
    rel = np.abs(ours - ref).max() / np.abs(ref).max()
    assert rel < 1e-4, f"{variant}: max relative error {rel:.2e}"


def test_unknown_or_unexpected_tensors_are_errors(tmp_path):
    import gguf
    from safetensors.numpy import load_file, save_file

    from gguf_util import write_gguf

    hf = make_tiny_checkpoint(tmp_path, "mistral")
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    # a bias the configuration does not announce
    bad = dict(tensors, **{"model.layers.0.self_attn.o_proj.bias": np.zeros(64, np.float32)})
    save_file(bad, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"o_proj.bias has no place"):
        load_model(str(tmp_path), jnp.float32, load_tokenizer=False)
    # a tensor nobody maps
    bad = dict(tensors, **{"model.layers.1.mlp.experts.0.weight": np.zeros((2, 2), np.float32)})
    save_file(bad, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"mlp.experts.0.weight is not used"):
        load_model(str(tmp_path), jnp.float32, load_tokenizer=False)
    # inverse RoPE frequencies some checkpoints carry are recomputed, not an error
    ok = dict(tensors, **{"model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(8, np.float32)})
    save_file(ok, path, metadata={"format": "pt"})
    load_model(str(tmp_path), jnp.float32, load_tokenizer=False)
    # GGUF: an unknown tensor
    g = str(tmp_path / "x.gguf")
    write_gguf(hf, g)  # (no tokenizer: only the tensors matter here)
    r = gguf.GGUFReader(g)
    w = gguf.GGUFWriter(str(tmp_path / "y.gguf"), "llama")
    for k, f in r.fields.items():
        if k.startswith(("GGUF.", "general.architecture")):
            continue
        w.add_key_value(k, f.contents(), f.types[0] if len(f.types) == 1 else f.types[0],
                        sub_type=f.types[-1] if len(f.types) > 1 else None)
    for t in r.tensors:
        w.add_tensor(t.name, np.asarray(t.data).reshape([int(d) for d in reversed(t.shape)]))
    w.add_tensor("blk.0.ffn_gate_exps.weight", np.zeros((2, 2), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"blk.0.ffn_gate_exps.weight is not used"):
        load_model(str(tmp_path / "y.gguf"), jnp.float32, load_tokenizer=False)


def _config_dict(tmp_path, variant, **over):
    import json
    make_tiny_checkpoint(tmp_path, variant)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.update(over)
    (tmp_path / "config.json").write_text(json.dumps(cfg))


def test_activation_other_than_silu_is_refused(tmp_path):
    _config_dict(tmp_path, "mistral", hidden_act="gelu")
    with pytest.raises(ValueError, match="hidden_act 'gelu' is not supported"):
        load_model(str(tmp_path), jnp.float32, load_tokenizer=False)


@pytest.mark.parametrize("max_window_layers,window", [(2, None), (0, 32), (1, "error")])
def test_qwen2_sliding_window_honoured_or_refused(tmp_path, max_window_layers, window):
    """Qwen2's use_sliding_window applies from layer max_window_layers on: none, all layers
    (a window everywhere), or a mix, which is refused rather than run wrongly."""
    import transformers
    cfg = transformers.Qwen2Config(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True, sliding_window=32,
        max_window_layers=max_window_layers).to_dict()
    cfg["architectures"] = ["Qwen2ForCausalLM"]
    from jaxllm.models import ArchConfig
    for d in (cfg, {k: v for k, v in cfg.items() if k != "layer_types"}):
        if window == "error":
            with pytest.raises(ValueError, match="some layers only"):
                ArchConfig.from_hf(d)
        else:
            assert ArchConfig.from_hf(d).sliding_window == window


def test_cpu_bf16_policy_stores_bf16_and_stays_close(tmp_path):
    """dtype="bfloat16" on a CPU: projection weights and the embedding stored in bf16, norms
    in f32; logits close to the f32 model's (bf16 rounding of weights and dot inputs only)."""
    from jaxllm.layers.dtype_policy import CPU_BF16_POLICY
    make_tiny_checkpoint(tmp_path, "llama3")
    ref = load_model(str(tmp_path), jnp.float32, load_tokenizer=False)
    pol = load_model(str(tmp_path), CPU_BF16_POLICY, load_tokenizer=False)
    layers = pol.state["layers"]
    assert layers["wqkv"][...].dtype == jnp.bfloat16 and pol.state["embed_tokens"][...].dtype == jnp.bfloat16
    assert layers["input_norm"][...].dtype == jnp.float32
    rng = np.random.default_rng(0)
    for n in (3, 40):
        ids = rng.integers(0, 49152, size=n).tolist()
        a, b = all_logits(ref, ids), all_logits(pol, ids)
        rel = np.abs(a - b).max() / np.abs(a).max()
        assert 0 < rel < 3e-2, rel
        assert (a.argmax(-1) == b.argmax(-1)).mean() > 0.8


@pytest.mark.parametrize("family", ["llama3", "qwen2", "llama3 panels"])
def test_cpu_bf16_kernel_matches_xla_widening(tmp_path, cpu_amx, family):
    """The CPU kernel that reads bf16 weights in place (layers' stacks, the tied or untied
    head) computes what XLA computes from the same weights widened to f32. On AMX's tiles
    (where the CPU has them) the sums run in another order, so an activation the policy rounds
    to bf16 may land one bf16 step away (2^-8 relative), and the logits move by about that
    much; on AVX-512 the two agree to float noise. With panel-sized matrices every layer
    stack is read as the panels packed at load, by pairs of k at any row count: there too the
    sums run in another order."""
    from jaxllm.layers.dtype_policy import CPU_BF16_POLICY
    from jaxllm.kernels.cpu import build
    panels = family.endswith("panels")
    make_tiny_checkpoint(tmp_path, family.split()[0], **(PANEL_SHAPES if panels else {}))
    kern = load_model(str(tmp_path), CPU_BF16_POLICY, load_tokenizer=False)
    from flax import nnx
    assert nnx.merge(kern.graphdef, kern.state).dense_kernel
    stacks = [kern.state["layers"][n][...] for n in ("wqkv", "wo", "w_gate_up", "w_down")]
    assert all((w.dtype == jnp.uint32 and w.ndim == 4) == panels for w in stacks)
    ids = np.random.default_rng(1).integers(0, 49152, size=21).tolist()
    tiles = all_logits(kern, ids) if build.amx() else None
    cpu_amx(False)
    a = all_logits(kern, ids)
    xla = load_model(str(tmp_path), CPU_BF16_POLICY, load_tokenizer=False, matmul_backend="xla")
    assert not nnx.merge(xla.graphdef, xla.state).dense_kernel
    b = all_logits(xla, ids)
    # panels multiply by pairs of k (vdpbf16ps) at every row count: another order of sums
    assert np.abs(a - b).max() / np.abs(b).max() < (4e-3 if panels else 1e-5)
    if tiles is not None:
        assert np.abs(tiles - b).max() / np.abs(b).max() < 4e-3


def test_longrope_refuses_a_context_past_the_original(tmp_path):
    """LongRoPE's long factors would re-rotate cached keys: the model serves its original
    context with the short factors, and a longer max_model_len is refused."""
    from jaxllm import LLM
    make_tiny_checkpoint(tmp_path, "phi3_longrope", tokenizer_dir=None)
    loaded = load_model(str(tmp_path), jnp.float32, load_tokenizer=False)
    assert loaded.arch.max_position_embeddings == 64 and loaded.arch.rotary_dim == 8
    assert loaded.arch.rope_scaling["attention_factor"] > 1
    with pytest.raises(ValueError, match=r"max_model_len \(128\) is larger than the model's maximum context \(64\)"):
        LLM(model=str(tmp_path), max_model_len=128, load_format="dummy", warmup=False)


def test_registry_dispatches_on_architectures():
    from jaxllm.models import get_model_class
    from jaxllm.models.llama import LlamaForCausalLM
    from jaxllm.models.phi3 import Phi3ForCausalLM
    assert get_model_class("Phi3ForCausalLM") is Phi3ForCausalLM
    assert get_model_class("Qwen2ForCausalLM") is LlamaForCausalLM
    # the fused checkpoint names are Phi-3's alone
    assert Phi3ForCausalLM.HF_WEIGHTS.lookup("model.layers.0.self_attn.qkv_proj.weight")[0].segment is None
    with pytest.raises(ValueError, match="qkv_proj.weight is not used"):
        LlamaForCausalLM.HF_WEIGHTS.lookup("model.layers.0.self_attn.qkv_proj.weight")


def test_dtype_policy_per_platform():
    from jaxllm.kernels import matmul_backend
    from jaxllm.layers.dtype_policy import CPU_BF16_POLICY, resolve_policy
    # on one CPU device with the kernels, bf16 weights widened in registers (bench dots)
    assert matmul_backend("cpu", 1) == "cpu"
    assert resolve_policy("auto", "cpu", matmul_backend("cpu", 1)) == CPU_BF16_POLICY
    assert matmul_backend("cpu", 2) == "xla"  # no kernel under tensor parallelism
    assert resolve_policy("auto", "cpu", matmul_backend("cpu", 2)).weight == jnp.float32
    assert matmul_backend("cpu", 1, cpu_kernels=False) == "xla"  # EngineConfig.cpu_kernels
    assert matmul_backend("cpu", 1, "pallas_interpret") == "pallas_interpret"
    assert matmul_backend("gpu", 1) == "pallas" and matmul_backend("gpu", 2) == "xla"
    assert resolve_policy("auto", "cpu", "xla").weight == jnp.float32
    assert resolve_policy("bfloat16", "cpu") == CPU_BF16_POLICY
    assert CPU_BF16_POLICY.activation == CPU_BF16_POLICY.dot == CPU_BF16_POLICY.accum == jnp.float32
    assert resolve_policy("float32", "cpu", "cpu").weight == jnp.float32
    gpu = resolve_policy("auto", "gpu")
    assert gpu.weight == gpu.activation == jnp.bfloat16
    assert resolve_policy("float32", "gpu").dot == jnp.float32
