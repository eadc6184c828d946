"""Restores Orbax checkpoints of one tiny model onto 2 and 4 fake CPU devices and prints, as
JSON, what each device holds next to what the safetensors path gives (test_orbax.py checks
it). argv: the HF checkpoint, a directory for new checkpoints, the checkpoint the CLI
converted for 4 devices."""
import json
import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"


def main():
    src, work, cli_tp4 = sys.argv[1:4]
    import jax.numpy as jnp
    import numpy as np
    from jaxllm.loader import load_model
    from jaxllm.loader.convert import convert
    from jaxllm.loader.orbax import flatten
    from jaxllm.parallel import make_mesh

    out = {}
    for tp, ckpt in ((2, os.path.join(work, "tp2")), (4, cli_tp4)):
        if tp == 2:
            convert(src, ckpt, tensor_parallel_size=2)
        mesh = make_mesh(tp)
        ref = load_model(src, jnp.float32, load_tokenizer=False, mesh=mesh)
        got = load_model(ckpt, jnp.float32, load_tokenizer=False, mesh=mesh)
        names, ref_leaves, _ = flatten(ref.state)
        _, got_leaves, _ = flatten(got.state)
        out[tp] = {"arch_equal": ref.arch == got.arch, "params": {}}
        for name, r, g in zip(names, ref_leaves, got_leaves):
            out[tp]["params"][name] = {
                "shape": list(g.shape),
                "spec": [a for a in g.sharding.spec],
                "devices": sorted(d.id for d in g.sharding.device_set),
                "shard_shapes": [list(s.data.shape) for s in g.addressable_shards],
                "ref_shard_shapes": [list(s.data.shape) for s in r.addressable_shards],
                "same_sharding": r.sharding == g.sharding,
                "equal": bool(np.array_equal(np.asarray(r), np.asarray(g))),
            }
    try:
        load_model(os.path.join(work, "tp2"), jnp.float32, load_tokenizer=False, mesh=make_mesh(4))
        out["mismatch"] = None
    except ValueError as e:
        out["mismatch"] = str(e)
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
