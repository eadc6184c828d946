"""Runs a tiny model with one LoRA adapter on 4 fake CPU devices and prints, as JSON, the
largest relative difference of its logits from the reference (test_lora.py made both) and
how the adapter slots are sharded."""
import json
import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
sys.path.insert(0, os.path.dirname(__file__))


def main():
    base, adapter, data = sys.argv[1:4]
    import jax.numpy as jnp
    import numpy as np
    from jaxllm.loader import load_model
    from jaxllm.lora import LoRARequest
    from jaxllm.lora.peft import LoRALayout
    from jaxllm.lora.registry import LoRARegistry
    from jaxllm.lora.slots import LoRASlots
    from jaxllm.models import get_model_class
    from jaxllm.parallel import make_mesh
    from lora_util import logits_fn

    ref = np.load(data)
    ids, ref = ref["ids"].tolist(), ref["logits"]
    mesh = make_mesh(4)
    loaded = load_model(base, jnp.float32, load_tokenizer=False, mesh=mesh)
    layout = LoRALayout(get_model_class(loaded.arch.architecture), loaded.checkpoint_arch, 4, 16)
    registry = LoRARegistry(layout, 2, [base])
    slots = LoRASlots(layout, 2, jnp.float32, mesh, registry.adapter)
    key = registry.add(LoRARequest("a", 1, adapter))
    slot, _ = slots.activate([key])
    ours = logits_fn(loaded, 2, ids)(slots.weights, slot[key])
    w = slots.weights

    def axes(x):
        spec = list(x.sharding.spec)
        return spec + [None] * (x.ndim - len(spec))
    print("RESULT " + json.dumps({
        "rel": float(np.abs(ours - ref).max() / np.abs(ref).max()),
        # column-parallel: B split on its output axis; row-parallel: A on its input axis
        "qkv_B": [axes(b) for b in w["wqkv"]["B"]],
        "qkv_A": axes(w["wqkv"]["A"]),
        "down_A": axes(w["w_down"]["A"]),
        "down_A_shard": list(w["w_down"]["A"].addressable_shards[0].data.shape),
        "down_A_shape": list(w["w_down"]["A"].shape),
    }))


if __name__ == "__main__":
    main()
