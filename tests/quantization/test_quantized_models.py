"""Quantized models: online quantization, quantized checkpoints (ours, AWQ, GPTQ,
compressed-tensors, GGUF) and the default model's Q4_1 weights against the float model
holding the same dequantized weights; tensor parallelism, the quantized KV cache, refusals."""
import json
import os
import subprocess
import sys

import gguf
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import make_tiny_checkpoint
from jaxllm.loader import load_model
from model_util import all_logits, hf_logits
from quant_util import IDS, rel, set_dequantized, tiny_hf  # noqa: F401 (tiny_hf: a fixture)

T = gguf.GGMLQuantizationType


@pytest.mark.parametrize("method", ["int8", "int4", "int4 g64"])
def test_online_weight_only_equals_its_dequantized_weights(tiny_hf, method):
    """Every matrix (the embedding and LM head too, int8 under int4) quantized at load,
    rounded to nearest: the logits equal HF's on the same dequantized weights, at each int4
    group size."""
    import copy

    from jaxllm.quantization import DEFAULT_INT4_GROUP, QuantLayout
    path, hf = tiny_hf
    kind, group = method.split()[0], int(method.split(" g")[1]) if " g" in method else None
    extra = {} if kind == "int8" or group is None else dict(quantization_group_size=group)
    loaded = load_model(path, jnp.float32, load_tokenizer=False, quantization=kind, **extra)
    assert loaded.quant.method == kind and loaded.quant.backend == "cpu"
    assert {n for n, _ in loaded.quant.layouts} >= {"embed_tokens", "lm_head", "layers.wqkv",
                                                     "layers.wo", "layers.w_gate_up", "layers.w_down"}
    want = group or DEFAULT_INT4_GROUP
    layouts = dict(loaded.quant.layouts)
    heads = ("embed_tokens", "lm_head")
    assert all(layouts[n].kind == "int8" and layouts[n].group == 64 for n in heads)
    assert kind == "int8" or {lay.group for n, lay in layouts.items() if n not in heads} == {want}
    assert not any(lay.smooth for _, lay in loaded.quant.layouts)
    ref_model = copy.deepcopy(hf)

    def layout(name, p):
        if p.ndim != 2:
            return None
        K = p.shape[1]
        head = name.split(".")[-2] in heads
        return QuantLayout("int8", K) if kind == "int8" or head else QuantLayout("int4", want, True)

    set_dequantized(ref_model, layout)
    assert rel(all_logits(loaded, IDS), hf_logits(ref_model, IDS)) < 1e-4


def test_pallas_backend_in_the_model(tiny_hf):
    """int4 weights through the GPU kernel (interpreted): the same logits as XLA's dots."""
    path, _ = tiny_hf
    kernel = load_model(path, jnp.float32, load_tokenizer=False, quantization="int4",
                        matmul_backend="pallas_interpret")
    assert kernel.quant.backend == "pallas_interpret"
    xla = load_model(path, jnp.float32, load_tokenizer=False, quantization="int4", matmul_backend="xla")
    assert rel(all_logits(kernel, IDS[:12]), all_logits(xla, IDS[:12])) < 1e-5


def test_int4_with_int8_block_activations(tiny_hf):
    """int4_activations="int8": 4-bit matrices in the CPU kernels multiply activations
    rounded to int8 per block of 32 (the default keeps them float, exact to the dequantized
    weights): the logits move, but stay near the float-activation ones."""
    from jaxllm.cli import main
    from jaxllm.config import EngineConfig
    from jaxllm.quantization import QuantLayout, QuantSpec
    path, _ = tiny_hf
    exact = all_logits(load_model(path, jnp.float32, load_tokenizer=False, quantization="int4"), IDS)
    blocks = all_logits(load_model(path, jnp.float32, load_tokenizer=False, quantization="int4",
                                   int4_activations="int8"), IDS)
    assert 0 < rel(blocks, exact) < 0.05
    # only where the kernel's blocks fit: groups of 32s, inputs of 64s, the CPU kernels
    spec = QuantSpec("int4", (("a", QuantLayout("int4", 32, True)), ("b", QuantLayout("int4", 16, True))),
                     "cpu", "int8")
    assert (spec.act_of("a", 128), spec.act_of("a", 96), spec.act_of("b", 128)) == ("int8_block", "none", "none")
    assert QuantSpec("int4", spec.layouts, "xla", "int8").act_of("a", 128) == "none"
    assert QuantSpec("int4", spec.layouts, "cpu").act_of("a", 128) == "none"
    with pytest.raises(ValueError, match="int4_activations must be one of"):
        EngineConfig(int4_activations="int4")
    with pytest.raises(SystemExit):  # the flag offers the same choices
        main(["generate", "--int4-activations", "int4"])


@pytest.mark.parametrize("method", ["w8a8", "fp8"])
def test_activation_quantized_methods(tiny_hf, method):
    """W8A8 and FP8 quantize activations per token (the head stays float): the CPU kernels equal
    the XLA path, and the logits stay near the float model's."""
    path, hf = tiny_hf
    loaded = load_model(path, jnp.float32, load_tokenizer=False, quantization=method)
    layouts = dict(loaded.quant.layouts)
    assert "layers.wqkv" in layouts
    assert not {"embed_tokens", "lm_head"} & set(layouts)  # the head stays float
    ours = all_logits(loaded, IDS)
    xla = load_model(path, jnp.float32, load_tokenizer=False, quantization=method, matmul_backend="xla")
    assert xla.quant.backend == "xla"
    assert rel(ours, all_logits(xla, IDS)) < 1e-4
    assert rel(ours, hf_logits(hf, IDS)) < 0.05


@pytest.mark.parametrize("method", ["awq", "gptq", "compressed-tensors"])
def test_prequantized_checkpoints_load_quantized(tmp_path, tokenizer_dir, method):
    from quant_util import write_quantized
    hf = make_tiny_checkpoint(tmp_path, "llama3", tokenizer_dir, seed=3)
    write_quantized(hf, str(tmp_path), method, group=32)
    loaded = load_model(str(tmp_path), jnp.float32, load_tokenizer=False)
    assert loaded.quant.method == method
    layouts = dict(loaded.quant.layouts)
    assert layouts["layers.wqkv"].kind == "int4" and layouts["layers.wqkv"].group == 32
    assert "embed_tokens" not in layouts  # float in these checkpoints
    assert rel(all_logits(loaded, IDS), hf_logits(hf, IDS)) < 1e-4


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0"])
def test_gguf_files_run_quantized(tmp_path, default_gguf, qtype):
    """A tiny model written as a Q4_0 / Q8_0 GGUF with the gguf package: kept quantized, its
    logits equal those of transformers reading the same file (which dequantizes it)."""
    import torch
    import transformers
    from gguf_util import write_gguf
    # no RoPE scaling: transformers' GGUF reader ignores llama.cpp's rope_freqs
    hf = make_tiny_checkpoint(tmp_path / "hf", "mistral", seed=5)
    path = tmp_path / "tiny.gguf"
    write_gguf(hf, str(path), tokenizer_from=default_gguf, qtype=T[qtype])
    loaded = load_model(str(path), jnp.float32, load_tokenizer=False)
    assert loaded.quant.method == "gguf"
    assert dict(loaded.quant.layouts)["layers.w_down"].kind == ("int4" if qtype == "Q4_0" else "int8")
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file="tiny.gguf", torch_dtype=torch.float32)
    assert rel(all_logits(loaded, IDS), hf_logits(ref, IDS)) < 1e-4


def test_open_gguf_reads_what_gguf_reads(default_gguf):
    """The loader's reader (plain-array slicing of the mapping) against the gguf package's
    own: every metadata value and every tensor's bytes, shape and type."""
    import gguf

    from jaxllm.loader.gguf_loader import open_gguf
    ours, theirs = open_gguf(default_gguf), gguf.GGUFReader(default_gguf)
    assert list(ours.fields) == list(theirs.fields)
    for key, field in theirs.fields.items():
        assert ours.fields[key].contents() == field.contents(), key
    assert len(ours.tensors) == len(theirs.tensors) > 0
    for a, b in zip(ours.tensors, theirs.tensors):
        assert (a.name, a.tensor_type, list(a.shape)) == (b.name, b.tensor_type, list(b.shape))
        assert np.array_equal(np.asarray(a.data), np.asarray(b.data)), a.name


def test_default_model_runs_its_q4_1_weights(default_gguf):
    """The default model keeps its Q4_1 layers (int4, groups of 32, scale and offset) and its
    Q8_0 embedding; its logits equal the dequantized model's."""
    q = load_model(default_gguf, jnp.float32, load_tokenizer=False)
    layouts = dict(q.quant.layouts)
    assert q.quant.method == "gguf"
    assert layouts["layers.wqkv"] == layouts["layers.w_down"]
    assert (layouts["layers.wqkv"].kind, layouts["layers.wqkv"].group, layouts["layers.wqkv"].offset) == ("int4", 32, True)
    assert (layouts["embed_tokens"].kind, layouts["embed_tokens"].group) == ("int8", 32)
    f = load_model(default_gguf, jnp.float32, load_tokenizer=False, quantization="none")
    assert f.quant is None
    from jaxllm.quantization import weight_bytes
    assert weight_bytes(q.state) < 0.25 * weight_bytes(f.state)
    ids = IDS[:24]
    assert rel(all_logits(q, ids), all_logits(f, ids)) < 1e-4


# refusals
def test_bad_quantization_inputs(tmp_path, tiny_hf, tokenizer_dir):
    from jaxllm.config import EngineConfig
    from quant_util import write_quantized
    path, _ = tiny_hf
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(quantization="int3")
    with pytest.raises(ValueError, match="needs a checkpoint quantized with it"):
        load_model(path, jnp.float32, load_tokenizer=False, quantization="awq")
    hf = make_tiny_checkpoint(tmp_path, "llama3", tokenizer_dir)
    write_quantized(hf, str(tmp_path), "compressed-tensors", group=32)
    cfg_path = tmp_path / "config.json"
    cfg = json.loads(cfg_path.read_text())
    with pytest.raises(ValueError, match="online quantization needs float weights"):
        load_model(str(tmp_path), jnp.float32, load_tokenizer=False, quantization="int4")
    # the config says AWQ, the tensors are compressed-tensors'
    cfg_path.write_text(json.dumps(cfg | {"quantization_config": {
        "quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}}))
    with pytest.raises(ValueError, match="belongs to compressed-tensors, but quantization_config says awq"):
        load_model(str(tmp_path), jnp.float32, load_tokenizer=False)
    # a group size that does not divide the input size
    write_quantized(hf, str(tmp_path), "gptq", group=32)
    gptq = json.loads(cfg_path.read_text())
    gptq["quantization_config"]["group_size"] = 48
    cfg_path.write_text(json.dumps(gptq))
    with pytest.raises(ValueError, match=r"gptq group_size 48 does not divide the input size (64|128)"):
        load_model(str(tmp_path), jnp.float32, load_tokenizer=False)
    gptq["quantization_config"] = {"quant_method": "bitsandbytes"}
    cfg_path.write_text(json.dumps(gptq))
    with pytest.raises(ValueError, match="'bitsandbytes' is not supported"):
        load_model(str(tmp_path), jnp.float32, load_tokenizer=False)


@pytest.mark.slow
def test_tensor_parallel_quantized_weights(tiny_llama, tmp_path, default_gguf):
    """Quantized weights split over 2 devices, scales sharded with their weights: int8 per
    channel made at load, and a Q4_0 GGUF whose groups of 32 split along the row-parallel
    o projection's input. The same greedy tokens as one device."""
    from gguf_util import write_gguf
    hf = make_tiny_checkpoint(tmp_path / "hf", "llama3", seed=2)
    gguf_path = str(tmp_path / "q4_0.gguf")
    write_gguf(hf, gguf_path, tokenizer_from=default_gguf, qtype=T.Q4_0)
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/
    cases = ((tiny_llama, "int8"), (gguf_path, ""))
    # both workers at once: most of each one's time is starting up and compiling
    procs = [subprocess.Popen([sys.executable, os.path.join(here, "tp_worker.py"), model, "1,2"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=dict(os.environ, JAXLLM_TEST_QUANT=method))
             for model, method in cases]
    outputs = [p.communicate(timeout=600) for p in procs]
    for (model, method), (stdout, stderr) in zip(cases, outputs):
        line = next((x for x in stdout.splitlines() if x.startswith("RESULT ")), None)
        assert line, stderr[-3000:]
        res = json.loads(line[len("RESULT "):])
        assert "error" not in res["2"], res["2"]
        assert res["1"]["tokens"] == res["2"]["tokens"], model
        np.testing.assert_allclose(np.concatenate(res["1"]["logprobs"]), np.concatenate(res["2"]["logprobs"]),
                                   atol=2e-3)
        full, shard = res["2"]["wqkv_full"], res["2"]["wqkv_shard"]
        assert shard[1] * 2 == full[1] and shard[2] == full[2], (model, full, shard)
        sfull, sshard = res["2"]["wo_scale_full"], res["2"]["wo_scale_shard"]
        if method == "int8":  # one scale per output channel: whole on each device
            assert sshard == sfull
        else:  # 64 inputs of o in two groups of 32: one group per device
            assert sfull[2] == 2 and sshard[2] == 1 and sshard[1] == sfull[1]


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_quantized_kv_cache_through_the_engine(tiny_llama, caplog, kv_dtype):
    """An int8 / fp8 KV cache holds 4 / (1 + 4 / head_dim) times the tokens of f32 in the same
    memory (3.2x at this model's head_dim of 16, 3.8x at 64; the log says so); on this CPU the
    attention kernels read it in place (fp8 kept as its bytes, which XLA:CPU writes in place);
    greedy tokens and logprobs stay close to an f32 cache's; swapping its blocks out and back
    and copy-on-write forks move values and scales exactly: greedy tokens equal an unpreempted
    run's."""
    import logging

    from conftest import SMALL_ENGINE
    from jaxllm import LLM, SamplingParams
    from jaxllm.layers.attention import cpu_kernels_apply
    from jaxllm.quantization import kv as kvq
    rng = np.random.default_rng(12)
    prompts = [rng.integers(10, 40000, size=40).tolist() for _ in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, n=2, best_of=2)
    with caplog.at_level(logging.INFO, logger="jaxllm"):
        roomy = LLM(tiny_llama, kv_cache_dtype=kv_dtype, kv_cache_memory_bytes=1 << 22,
                    warmup=False, **SMALL_ENGINE)
    assert f"KV cache dtype {kv_dtype}: 3.20x the tokens of float32" in caplog.text
    f32_blocks = (1 << 22) // (2 * 2 * 16 * 2 * 16 * 4)  # layers, K/V, block, kv heads, head_dim, f32
    assert roomy.llm_engine.kv_manager.pool.num_blocks >= 3.19 * f32_blocks
    cache = roomy.llm_engine.runner.kv_cache
    assert cache.data.dtype == (jnp.int8 if kv_dtype == "int8" else kvq.FP8_BITS)
    assert cpu_kernels_apply(cache)
    one = SamplingParams(temperature=0.0, max_tokens=8, logprobs=0, ignore_eos=True)
    full = LLM(tiny_llama, dtype="float32", kv_cache_memory_bytes=1 << 22, warmup=False,
               **SMALL_ENGINE)
    a = roomy.generate(prompts[:2], one, use_tqdm=False)
    b = full.generate(prompts[:2], one, use_tqdm=False)
    for x, y in zip(a, b):
        x, y = x.outputs[0], y.outputs[0]
        assert x.token_ids[0] == y.token_ids[0]
        assert abs(x.logprobs[0][x.token_ids[0]].logprob - y.logprobs[0][y.token_ids[0]].logprob) < 0.05
    del full
    want = [[c.token_ids for c in o.outputs] for o in roomy.generate(prompts, params, use_tqdm=False)]
    tight = LLM(tiny_llama, kv_cache_dtype=kv_dtype, num_gpu_blocks_override=17,
                preemption_mode="swap", swap_space=0.01, enable_prefix_caching=False,
                warmup=False, **SMALL_ENGINE)
    got = [[c.token_ids for c in o.outputs] for o in tight.generate(prompts, params, use_tqdm=False)]
    assert got == want
    sched, kv = tight.llm_engine.scheduler, tight.llm_engine.kv_manager
    assert sched.num_swaps > 0
    assert kv.num_free_blocks == kv.pool.num_usable_blocks


# SmoothQuant (w8a8 with smoothing vectors)
