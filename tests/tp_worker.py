"""Runs one model at several tensor-parallel sizes on fake CPU devices and prints, as JSON, the
greedy tokens and prompt logprobs of each (test_parallel.py compares them)."""
import json
import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"


def main():
    model = None if sys.argv[1] == "default" else sys.argv[1]
    # "2e": two devices with the experts split whole over them (expert parallelism)
    sizes = sys.argv[2].split(",")
    import numpy as np
    from jaxllm import LLM, SamplingParams

    rng = np.random.default_rng(0)
    prompts = [rng.integers(10, 40000, size=n).tolist() for n in (5, 40, 90)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3,
                            prompt_logprobs=3)
    out = {}
    for key in sizes:
        tp, ep = int(key.rstrip("e")), key.endswith("e")
        try:
            llm = LLM(model, tensor_parallel_size=tp, enable_expert_parallel=ep, dtype="float32", max_num_seqs=4, max_num_batched_tokens=64,
                      max_model_len=256, warmup=False, token_buckets=[64], seq_buckets=[4], enable_prefix_caching=False,
                      attention_backend=os.environ.get("JAXLLM_TEST_BACKEND", "cpu"),
                      quantization=os.environ.get("JAXLLM_TEST_QUANT") or None)
        except ValueError as e:
            out[key] = {"error": str(e)}
            continue
        res = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        shards = {str(x.sharding.spec) for x in [llm.llm_engine.runner.kv_cache]}
        layers = llm.llm_engine.runner.state["layers"]
        quantized = not hasattr(layers["wqkv"], "shape") and "q" in layers["wqkv"]
        wqkv = (layers["wqkv"]["q"] if quantized else layers["wqkv"])[...]
        wo_scale = layers["wo"]["scale"][...] if quantized else None
        experts = layers["experts_gate_up"] if "experts_gate_up" in layers else None
        out[key] = {
            # what one device holds of the experts' gate/up stack [layers, experts, embed, 2F]
            "experts_shard": None if experts is None else list(experts[...].addressable_shards[0].data.shape),
            "tokens": [o.outputs[0].token_ids for o in res],
            "logprobs": [[e[t].logprob for t, e in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
                         for o in res],
            "prompt_logprobs": [[e[t].logprob for t, e in zip(o.prompt_token_ids[1:], o.prompt_logprobs[1:])]
                                for o in res],
            "kv_cache_spec": sorted(shards),
            "devices_per_weight": len(wqkv.sharding.device_set),
            # what one device holds of wqkv [layers, embed, heads * head_dim] (quantized:
            # its codes [layers, heads * head_dim, embed'])
            "wqkv_shard": list(wqkv.addressable_shards[0].data.shape),
            "wqkv_full": list(wqkv.shape),
            "wqkv_quantized": quantized,
            "wo_scale_shard": None if wo_scale is None else list(wo_scale.addressable_shards[0].data.shape),
            "wo_scale_full": None if wo_scale is None else list(wo_scale.shape),
        }
        del llm
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
