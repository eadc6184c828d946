"""Tensor parallelism: the plan (padding, KV-head repetition, errors), greedy outputs and
logprobs identical to one device on 2, 4 and 8 fake CPU devices, the default model on 3, and a
real 2-process run over loopback with gloo collectives."""
import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from conftest import _tiny_config
from jaxllm.models.arch import ArchConfig
from jaxllm.parallel import plan, runtime_arch

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/


def run_worker(model: str, sizes: str, backend: str = "cpu") -> dict:
    proc = subprocess.run([sys.executable, os.path.join(HERE, "tp_worker.py"), model, sizes],
                          capture_output=True, text=True, timeout=1200,
                          env={**os.environ, "JAXLLM_TEST_BACKEND": backend})
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))
    return {int(k) if k.isdigit() else k: v for k, v in json.loads(line[len("RESULT "):]).items()}


def assert_same_as_one_device(res: dict, sizes):
    one = res[1]
    for tp in sizes:
        assert "error" not in res[tp], res[tp]
        assert res[tp]["tokens"] == one["tokens"], f"tp={tp}"
        for key in ("logprobs", "prompt_logprobs"):
            np.testing.assert_allclose(np.concatenate(res[tp][key]), np.concatenate(one[key]),
                                       atol=1e-4, rtol=1e-4)
        assert res[tp]["devices_per_weight"] == tp
        # each device holds its slice of the heads, not a copy of the whole weight
        full, shard = res[tp]["wqkv_full"], res[tp]["wqkv_shard"]
        if res[tp]["wqkv_quantized"]:  # codes are [layers, heads * head_dim, embed']
            assert shard == [full[0], full[1] // tp, full[2]]
        else:
            assert shard == full[:2] + [full[2] // tp]


def arch(**over) -> ArchConfig:
    base = dict(architecture="LlamaForCausalLM", vocab_size=1001, hidden_size=64,
                intermediate_size=100, num_layers=2, num_heads=8, num_kv_heads=2, head_dim=8)
    base.update(over)
    return ArchConfig(**base)


def test_plan_pads_and_repeats():
    p = plan(arch(), 4)
    assert (p.vocab_pad, p.mlp_pad, p.kv_repeat) == (3, 0, 2)
    rt = runtime_arch(arch(), p)
    assert rt.num_kv_heads == 4 and rt.vocab_size == 1001 and rt.vocab_pad == 3
    p8 = plan(arch(intermediate_size=99), 8)
    assert p8.mlp_pad == 5 and p8.kv_repeat == 4
    with pytest.raises(ValueError, match="num_attention_heads"):
        plan(arch(num_heads=9, num_kv_heads=3), 2)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        plan(arch(num_heads=12, num_kv_heads=3), 4)
    assert plan(arch(), 1).size == 1


def test_repeated_kv_heads_keep_the_gqa_mapping():
    """Query head h reads KV head h // (H / KVH) before; after repeating each KV head r times,
    head h's virtual KV head (h // (H / (KVH * r))) holds the same weights. The fused q/k/v
    columns are device-major: device d's shard is its q heads, then its k and v heads."""
    from jaxllm.models.llama import LlamaForCausalLM, split_device_major
    a = arch()
    p = plan(a, 8)
    rt = runtime_arch(a, p)
    rng = np.random.default_rng(0)
    H, K, D = a.num_heads, a.num_kv_heads, a.head_dim
    wqkv = rng.standard_normal((2, 64, (H + 2 * K) * D)).astype(np.float32)
    gate_up = rng.standard_normal((2, 64, 200)).astype(np.float32)
    out = LlamaForCausalLM.tp_transform({"layers.wqkv": wqkv, "layers.w_gate_up": gate_up,
                                         "layers.w_down": np.zeros((2, 100, 64)),
                                         "embed_tokens": np.zeros((1001, 64))}, a, p)
    K2 = rt.num_kv_heads
    assert out["layers.wqkv"].shape == (2, 64, (H + 2 * K2) * D)
    q, k, v = (np.asarray(x) for x in split_device_major(out["layers.wqkv"], [H * D, K2 * D, K2 * D], 8))
    np.testing.assert_array_equal(q, wqkv[..., :H * D])
    virt, orig = k.reshape(2, 64, K2, D), wqkv[..., H * D:(H + K) * D].reshape(2, 64, K, D)
    for h in range(H):
        np.testing.assert_array_equal(virt[:, :, h // (H // K2)], orig[:, :, h // (H // K)])
    # each device's columns: its q heads, then its (repeated) k and v heads
    shard = out["layers.wqkv"][..., :(H + 2 * K2) * D // 8]
    np.testing.assert_array_equal(shard[..., :D], wqkv[..., :D])
    np.testing.assert_array_equal(shard[..., D:2 * D], orig[:, :, 0])
    F2 = rt.intermediate_size  # padded to a multiple of 8 with zero units
    gate, up = (np.asarray(x) for x in split_device_major(out["layers.w_gate_up"], [F2, F2], 8))
    np.testing.assert_array_equal(gate[..., :100], gate_up[..., :100])
    np.testing.assert_array_equal(up[..., :100], gate_up[..., 100:])
    assert not gate[..., 100:].any() and not up[..., 100:].any()
    assert out["embed_tokens"].shape == (1008, 64)


@pytest.fixture(scope="module")
def tp_checkpoint(tmp_path_factory, tokenizer_dir):
    """8 query heads over 2 KV heads, an MLP of 100 (padded at 8) and a vocabulary of 49157
    (padded at 2, 4 and 8): every plan path at once."""
    import torch
    import transformers

    d = tmp_path_factory.mktemp("tp_model")
    cfg = _tiny_config("LlamaForCausalLM", num_attention_heads=8, num_key_value_heads=2,
                       head_dim=8, intermediate_size=100, vocab_size=49157)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(d)
    for name in os.listdir(tokenizer_dir):
        with open(os.path.join(tokenizer_dir, name), "rb") as s, open(d / name, "wb") as t:
            t.write(s.read())
    return str(d)


@pytest.mark.slow
def test_tp_2_4_8_match_one_device(tp_checkpoint):
    res = run_worker(tp_checkpoint, "1,2,4,8")
    assert_same_as_one_device(res, (2, 4, 8))
    assert res[8]["kv_cache_spec"] == ["P(None, None, 'tp', None, None)"]


@pytest.mark.slow
def test_moe_tensor_and_expert_parallel_match_one_device(tmp_path, tokenizer_dir):
    """Qwen3-MoE with 8 experts of width 30: split by the experts' columns (padded to 32 at
    4 devices) or, with expert parallelism, by whole experts; both equal one device."""
    from conftest import make_tiny_checkpoint
    make_tiny_checkpoint(tmp_path, "qwen3_moe", tokenizer_dir, num_experts=8, moe_intermediate_size=30)
    res = run_worker(str(tmp_path), "1,4,2e,4e")
    one = res[1]
    for key in (4, "2e", "4e"):
        assert "error" not in res[key], res[key]
        assert res[key]["tokens"] == one["tokens"], key
        for part in ("logprobs", "prompt_logprobs"):
            np.testing.assert_allclose(np.concatenate(res[key][part]), np.concatenate(one[part]),
                                       atol=1e-4, rtol=1e-4)
    # [layers, experts, embed, gate and up columns] on one device
    assert one["experts_shard"] == [2, 8, 64, 60]
    assert res[4]["experts_shard"] == [2, 8, 64, 16]
    assert res["2e"]["experts_shard"] == [2, 4, 64, 60]
    assert res["4e"]["experts_shard"] == [2, 2, 64, 60]


def test_expert_parallel_needs_experts_that_divide():
    arch = ArchConfig("MixtralForCausalLM", 64, 32, 16, 1, 4, 2, 8, num_experts=6,
                      num_experts_per_tok=2, expert_parallel=True)
    assert plan(arch, 2).mlp_pad == 0
    with pytest.raises(ValueError, match="the 6 experts of MixtralForCausalLM do not divide over 4"):
        plan(arch, 4)


@pytest.mark.slow
def test_pallas_kernels_under_shard_map(tp_checkpoint):
    res = run_worker(tp_checkpoint, "1,4", backend="pallas")
    assert_same_as_one_device(res, (4,))


@pytest.mark.slow
def test_default_model_where_its_heads_allow():
    res = run_worker("default", "1,2,3")
    assert "num_attention_heads (9)" in res[2]["error"]
    assert_same_as_one_device(res, (3,))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_over_loopback(tiny_llama, tiny_llm, tmp_path):
    rng = np.random.default_rng(5)
    prompts = [rng.integers(10, 40000, size=n).tolist() for n in (5, 20, 70)]
    from jaxllm import SamplingParams
    want = [o.outputs[0].token_ids for o in tiny_llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)]
    env = {**os.environ, "JAXLLM_TEST_PROMPTS": json.dumps(prompts), "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": ""}
    worker = os.path.join(HERE, "multiprocess_worker.py")
    out = tmp_path / "out.json"
    for attempt in range(3):
        coord = f"127.0.0.1:{free_port()}"
        procs = [subprocess.Popen([sys.executable, worker, tiny_llama, coord, str(i), str(out)],
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True)
                 for i in (1, 0)]
        logs = [p.communicate(timeout=600)[0] for p in procs]
        # the port can be taken between free_port() and the coordinator's bind (other tests
        # run beside this one): only that failure runs it again, on another port
        if attempt < 2 and any("Failed to add port to server" in log for log in logs):
            continue
        break
    assert [p.returncode for p in procs] == [0, 0], "\n".join(l[-2000:] for l in logs)
    assert json.loads(out.read_text()) == want


def test_quantized_experts_with_tensor_parallelism_are_refused_at_load(tmp_path):
    """Refused when the model is built, naming the option, not when a step is traced."""
    import textwrap

    from conftest import make_tiny_checkpoint
    make_tiny_checkpoint(tmp_path, "mixtral")
    code = textwrap.dedent(f"""
        import os
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
        import jax.numpy as jnp
        from jaxllm.loader import load_model
        from jaxllm.parallel import make_mesh
        try:
            load_model({str(tmp_path)!r}, jnp.float32, load_tokenizer=False, quantization="int8",
                       mesh=make_mesh(2))
        except ValueError as e:
            print("REFUSED", e)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert "REFUSED" in out.stdout and "tensor_parallel_size > 1" in out.stdout, out.stderr[-2000:]
