"""How far a dtype policy moves the model from f32: greedy agreement on N prompts x M tokens
and the logits' max-abs difference over the prompts' positions, same weights, same run.
usage: python -m benchmarks.dtype_agreement [--model PATH] [--dtype bfloat16] [--num-prompts 32]"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np


def prompt_logits(loaded, ids: list[int]) -> np.ndarray:
    """Logits at every position of one prompt, one step, no engine."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jaxllm.layers.attention_metadata import attention_metadata
    from jaxllm.layers.attention_metadata import kv_cache_shape, table_width

    T, bs = len(ids), 16
    width = table_width(T, bs)
    table = np.zeros((1, width), np.int32)
    n = -(-T // bs)
    table[0, :n] = np.arange(1, n + 1)
    md = jax.tree.map(jnp.asarray, attention_metadata(np.zeros(1, np.int32), np.array([T], np.int32),
                                                      table, T, 1, bs))
    model = nnx.merge(loaded.graphdef, loaded.state)
    kv = jnp.zeros(kv_cache_shape(loaded.arch, width + 1, bs), model.policy.activation)
    hidden, _ = model(kv, jnp.asarray(ids, jnp.int32), md)
    return np.asarray(model.compute_logits(hidden))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--out", default=None, help="JSON file for the result")
    args = p.parse_args()
    import jax
    from benchmarks import datasets
    from benchmarks.common import machine
    from jaxllm import LLM, SamplingParams
    from jaxllm.kernels import matmul_backend
    from jaxllm.layers.dtype_policy import resolve_policy
    from jaxllm.loader import load_model

    policy = resolve_policy(args.dtype, jax.default_backend(),
                            matmul_backend(jax.default_backend(), 1))
    ref = load_model(args.model, "float32", load_tokenizer=False)
    other = load_model(args.model, policy, load_tokenizer=False)
    src = datasets.TokenSource(ref.arch.vocab_size, set(), 0)
    prompts = [src.tokens(args.prompt_len) for _ in range(args.num_prompts)]
    diff = max(float(np.abs(prompt_logits(ref, q) - prompt_logits(other, q)).max()) for q in prompts[:8])
    del ref, other
    outs = {}
    for dtype in ("float32", args.dtype):
        llm = LLM(model=args.model, dtype=dtype, max_model_len=512, warmup=False)
        res = llm.generate([{"prompt_token_ids": q} for q in prompts],
                           SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True),
                           use_tqdm=False)
        outs[dtype] = [list(r.outputs[0].token_ids) for r in res]
        del llm
    a, b = outs["float32"], outs[args.dtype]
    first = [next((i for i, (x, y) in enumerate(zip(s, t)) if x != y), len(s)) for s, t in zip(a, b)]
    result = {"command": "python -m benchmarks.dtype_agreement " + " ".join(sys.argv[1:]),
              "machine": machine(), "model": args.model or "default GGUF", "policy": policy.describe(),
              "num_prompts": args.num_prompts, "prompt_len": args.prompt_len,
              "output_len": args.output_len,
              "identical_sequences": sum(x == y for x, y in zip(a, b)),
              "token_agreement": float(np.mean([x == y for s, t in zip(a, b) for x, y in zip(s, t)])),
              "mean_first_divergence": float(np.mean(first)),
              "logits_max_abs_diff_first_8_prompts": diff}
    print(json.dumps(result, indent=1))
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
