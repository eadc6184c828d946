"""`jaxllm bench moe`: a mixture-of-experts model's decode step, its experts through the
grouped path, against (a) every expert applied to every token (the dense reference) and (b) a
dense model with the same active parameters per token (its MLP as wide as the k experts a
token uses, and no router), in the same run. Random weights of an OLMoE shape scaled down
(the flags), one forward pass of `batch` decoding sequences at `context` tokens each, logits
included, sampling not; the CPU's attention kernels in all three."""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import numpy as np

from benchmarks.common import write_result


def add_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model shape (OLMoE-1B-7B has 2048, 16, 16, 64, 8, 1024)")
    g.add_argument("--hidden-size", type=int, default=1024)
    g.add_argument("--num-layers", type=int, default=8)
    g.add_argument("--num-heads", type=int, default=8)
    g.add_argument("--num-experts", type=int, default=64)
    g.add_argument("--experts-per-token", type=int, default=8)
    g.add_argument("--expert-size", type=int, default=512, help="each expert's intermediate size")
    g.add_argument("--vocab-size", type=int, default=50304)
    g.add_argument("--dtype", default="bfloat16")
    w = p.add_argument_group("workload")
    w.add_argument("--batch-sizes", default="1,4,16")
    w.add_argument("--context", type=int, default=256)
    w.add_argument("--iters", type=int, default=20)
    w.add_argument("--no-dense-reference", action="store_true",
                   help="skip every-expert-on-every-token (slow at large shapes)")
    o = p.add_argument_group("output")
    o.add_argument("--results-dir", default=os.environ.get("OUT") or "benchmarks/results")
    o.add_argument("--tag", default=None)


def configs(args) -> dict[str, dict]:
    """HF configs of the MoE model and its dense twin (same attention, MLP of k experts' width)."""
    E, H = args.hidden_size, args.num_heads
    common = dict(vocab_size=args.vocab_size, hidden_size=E, num_hidden_layers=args.num_layers,
                  num_attention_heads=H, num_key_value_heads=H, head_dim=E // H,
                  max_position_embeddings=4096, rms_norm_eps=1e-5, hidden_act="silu",
                  rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    moe = dict(common, architectures=["OlmoeForCausalLM"], num_experts=args.num_experts,
               num_experts_per_tok=args.experts_per_token, intermediate_size=args.expert_size,
               norm_topk_prob=False)
    dense = dict(common, architectures=["LlamaForCausalLM"],
                 intermediate_size=args.experts_per_token * args.expert_size)
    return {"moe": moe, "dense": dense}


def _decode_inputs(arch, batch: int, context: int, block_size: int = 16):
    import jax.numpy as jnp

    from jaxllm.layers.attention_metadata import attention_metadata, table_width
    width = table_width(context, block_size)
    per_seq = -(-context // block_size)
    tables = np.zeros((batch, width), np.int32)
    for i in range(batch):
        tables[i, :per_seq] = 1 + i * per_seq + np.arange(per_seq)
    md = attention_metadata(np.full(batch, context - 1, np.int32), np.ones(batch, np.int32), tables,
                            batch, batch, block_size)
    ids = jnp.asarray(np.random.default_rng(batch).integers(3, arch.vocab_size, batch), jnp.int32)
    return ids, md, 1 + batch * per_seq


def step_seconds(loaded, impl: str | None, batch: int, context: int, iters: int) -> float:
    """Median of `iters` forward passes (after a warm-up), each waited for."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxllm.layers.attention_metadata import kv_cache_shape
    ids, md, blocks = _decode_inputs(loaded.arch, batch, context)
    md = jax.tree.map(jnp.asarray, md)
    policy = nnx.merge(loaded.graphdef, loaded.state).policy
    kv = jnp.zeros(kv_cache_shape(loaded.arch, blocks, md.block_size), policy.activation)
    graphdef = loaded.graphdef

    @jax.jit
    def forward(state, kv, ids, md):
        model = nnx.merge(graphdef, state)
        if impl is not None:
            model.moe_impl = impl
        hidden, kv = model(kv, ids, md)
        return model.compute_logits(hidden), kv

    jax.block_until_ready(forward(loaded.state, kv, ids, md))
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        jax.block_until_ready(forward(loaded.state, kv, ids, md))
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def run(args) -> int:
    from jaxllm.layers.dtype_policy import resolve_policy
    from jaxllm.loader import load_model
    from jaxllm.models.base import parameter_counts
    from jaxllm.models.registry import get_model_class

    batches = [int(b) for b in str(args.batch_sizes).split(",")]
    policy = resolve_policy(args.dtype, "cpu", "cpu")
    results = {"shape": {k: getattr(args, k) for k in ("hidden_size", "num_layers", "num_heads", "num_experts",
                                                      "experts_per_token", "expert_size", "vocab_size")},
               "dtype": policy.describe(), "context": args.context, "models": {}}
    variants = [("moe", "grouped"), ("dense", None)]
    if not args.no_dense_reference:
        variants.insert(1, ("moe", "dense"))
    with tempfile.TemporaryDirectory() as tmp:
        for name, cfg in configs(args).items():
            os.makedirs(os.path.join(tmp, name))
            with open(os.path.join(tmp, name, "config.json"), "w") as f:
                json.dump(cfg, f)
        loaded = {name: load_model(os.path.join(tmp, name), policy, load_format="dummy",
                                   attention_backend="cpu", load_tokenizer=False)
                  for name in ("moe", "dense")}
        for name, impl in variants:
            key = name if impl is None else f"{name}_{impl}"
            arch = loaded[name].arch
            counts = parameter_counts(get_model_class(arch.architecture).param_specs(arch), arch)
            entry = results["models"].setdefault(key, {"parameters": counts})
            for b in batches:
                s = step_seconds(loaded[name], impl, b, args.context, args.iters)
                entry[f"batch_{b}_step_s"] = s
                print(f"{key:>12} batch {b:>3}: {s * 1e3:8.2f} ms per decode step", flush=True)
    models = results["models"]
    results["ratios"] = {}
    for b in batches:
        grouped = models["moe_grouped"][f"batch_{b}_step_s"]
        r = {"dense_active_over_grouped": models["dense"][f"batch_{b}_step_s"] / grouped}
        if "moe_dense" in models:
            r["dense_reference_over_grouped"] = models["moe_dense"][f"batch_{b}_step_s"] / grouped
        results["ratios"][f"batch_{b}"] = r
        print(f"batch {b:>3}: grouped MoE at {r['dense_active_over_grouped']:.2f}x the speed of the "
              "dense model of its active parameters"
              + (f", {r['dense_reference_over_grouped']:.2f}x every-expert's" if "moe_dense" in models else ""))
    write_result(args, results, "moe")
    return 0
