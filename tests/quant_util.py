"""Quantized checkpoints written the way their tools write them, from each format's published
layout and independently of jaxllm's readers: AutoAWQ's GEMM packing, AutoGPTQ's packing (v1
zero points), and compressed-tensors' own packer. Each writer also puts the dequantized
weights back into the torch model, which is then the reference."""
import json
import os

import numpy as np
import pytest

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def int4_asym(w: np.ndarray, group: int, min_zero: int = 0):
    """w [out, in] -> codes [out, in] in 0..15, integer zeros and scales [out, in/group]."""
    N, K = w.shape
    g = w.reshape(N, K // group, group)
    lo, hi = g.min(-1), g.max(-1)
    scale = np.maximum(hi - lo, 1e-8) / 15.0
    zero = np.clip(np.round(-lo / scale), min_zero, 15)
    codes = np.clip(np.round(g / scale[..., None]) + zero[..., None], 0, 15).astype(np.int64)
    deq = (codes - zero[..., None]) * scale[..., None]
    return codes.reshape(N, K), zero.astype(np.int64), scale.astype(np.float16), deq.reshape(N, K)


def _pack8(cols: np.ndarray, order) -> np.ndarray:
    """[..., 8 * n] codes -> [..., n] int32 words; nibble i holds code order[i] of its eight."""
    c = cols.reshape(*cols.shape[:-1], -1, 8)
    word = np.zeros(c.shape[:-1], np.int64)
    for i in range(8):
        word |= c[..., order[i]] << (4 * i)
    return word.astype(np.uint32).view(np.int32)


def awq_tensors(w: np.ndarray, group: int):
    codes, zero, scale, deq = int4_asym(w, group)
    # AutoAWQ keeps [in, out] and packs along out
    s16 = scale.astype(np.float16)
    deq = (codes.reshape(*zero.shape, group) - zero[..., None]) * s16.astype(np.float32)[..., None]
    return {"qweight": _pack8(codes.T, AWQ_ORDER), "qzeros": _pack8(zero.T, AWQ_ORDER),
            "scales": s16.T.copy()}, deq.reshape(w.shape)


def gptq_tensors(w: np.ndarray, group: int):
    # v1 stores zero - 1 in unsigned words: a zero of 0 cannot be written (it would spill
    # into the neighbouring nibbles), so GPTQ's own quantizers never produce one here
    codes, zero, scale, _ = int4_asym(w, group, min_zero=1)
    K = w.shape[1]
    s16 = scale.astype(np.float16)
    deq = (codes.reshape(*zero.shape, group) - zero[..., None]) * s16.astype(np.float32)[..., None]
    # AutoGPTQ: qweight [in/8, out] packed along in; qzeros store zero - 1, packed along out
    qweight = _pack8(codes.T.T, list(range(8)))  # [out, in/8]
    return {"qweight": qweight.T.copy(), "qzeros": _pack8((zero - 1).T, list(range(8))),
            "scales": s16.T.copy(), "g_idx": (np.arange(K) // group).astype(np.int32)}, deq.reshape(w.shape)


def pack_quantized_tensors(w: np.ndarray, group: int):
    """compressed-tensors W4A16 symmetric by its own packer."""
    import torch
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    N, K = w.shape
    g = w.reshape(N, K // group, group)
    scale = (np.abs(g).max(-1) / 7.0).astype(np.float32)
    q = np.clip(np.round(g / scale[..., None]), -8, 7).astype(np.int8)
    deq = (q * scale[..., None]).reshape(N, K)
    packed = pack_to_int32(torch.from_numpy(q.reshape(N, K)), 4).numpy()
    return {"weight_packed": packed, "weight_scale": scale,
            "weight_shape": np.array([N, K], np.int64)}, deq


def write_quantized(hf_model, path, method: str, group: int = 32) -> None:
    """Save the torch model's linears in `method`'s format (other tensors as they are) and
    set the model's weights to the dequantized values, the reference."""
    import torch
    from safetensors.numpy import save_file

    writer = {"awq": awq_tensors, "gptq": gptq_tensors,
              "compressed-tensors": pack_quantized_tensors}[method]
    sd = {k: v.detach().float().numpy() for k, v in hf_model.state_dict().items()}
    out = {}
    for name, t in sd.items():
        module = name[:-len(".weight")] if name.endswith(".weight") else None
        if module and any(module.endswith(m) for m in LINEARS):
            tensors, deq = writer(t, group)
            for part, arr in tensors.items():
                out[f"{module}.{part}"] = np.ascontiguousarray(arr)
            with torch.no_grad():
                hf_model.get_parameter(name).copy_(torch.from_numpy(deq.astype(np.float32)))
        else:
            out[name] = np.ascontiguousarray(t)
    if hf_model.config.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    save_file(out, os.path.join(path, "model.safetensors"))
    config = hf_model.config.to_dict()
    config["quantization_config"] = {
        "awq": {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
                "version": "gemm"},
        "gptq": {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": False,
                 "sym": False, "checkpoint_format": "gptq"},
        "compressed-tensors": {
            "quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None,
                                          "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                                      "strategy": "group", "group_size": group}}},
            "ignore": ["lm_head"]},
    }[method]
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)


def rel(a, b) -> float:
    """The largest difference relative to the reference's largest magnitude."""
    return float(np.abs(a - b).max() / np.abs(b).max())


def set_dequantized(hf, layout_of):
    """Replace every matrix of the torch model by its quantize-dequantize round trip."""
    import torch

    from jaxllm.quantization import quantize_host
    with torch.no_grad():
        for name, p in hf.named_parameters():
            layout = layout_of(name, p)
            if layout is not None:
                w = quantize_host(p.detach().numpy().astype(np.float32), layout).dequantize()
                p.copy_(torch.from_numpy(w))


IDS = np.random.default_rng(0).integers(0, 49152, 37).tolist()  # a prompt for the tiny models


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory, tokenizer_dir):
    """A tiny Llama checkpoint (its path) and its torch model, once per module that imports
    this fixture."""
    from conftest import make_tiny_checkpoint
    d = tmp_path_factory.mktemp("qtiny")
    return str(d), make_tiny_checkpoint(d, "llama3", tokenizer_dir)
