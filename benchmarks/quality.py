"""What quantization costs in quality, same run: perplexity on a fixed English text and greedy
agreement with the float32 model, for each weight format.

The text is CPython's own documentation of the language (`pydoc_data.topics`, in every Python
install: English prose about Python), concatenated in sorted topic order, the first
--num-tokens tokens, scored in independent chunks of --chunk tokens through prompt logprobs.
Greedy agreement: --num-prompts prompts of --prompt-len tokens cut from the same text, each
continued --output-len tokens greedily, compared token by token with float32's.

    jaxllm bench quality --hf-model DIR [--methods f32,bf16,int8,w8a8,int4,native]

DIR holds float weights (../shared/tools/default-model-as-hf.py writes the default model's);
`native` is --model as its checkpoint ships (the default model: its Q4_1 GGUF).
`w8a8-smooth` is w8a8 with SmoothQuant at --smoothquant-alpha; `w8a8-smooth@A` at alpha A
(several in one run). `int4` is int4 with the engine's defaults; `int4-gN` in groups of N
(32, 64, 128), `-awq` or `-rtn` after it (or alone) with or without AWQ's scaling: e.g.
`int4-g128-rtn,int4-g32-awq`. The calibration text of both is the end of the same
documentation, checked here to lie after the scored tokens.
"""
from __future__ import annotations

import argparse
import math
import time

import numpy as np

from benchmarks.common import write_result

METHODS = {
    # name: (model source, dtype, quantization, kv_cache_dtype); w8a8-smooth[@A] in method()
    "f32": ("hf", "float32", None, "auto"),
    "bf16": ("hf", "bfloat16", None, "auto"),
    "int8": ("hf", "float32", "int8", "auto"),
    "w8a8": ("hf", "float32", "w8a8", "auto"),
    "int4": ("hf", "float32", "int4", "auto"),
    "fp8": ("hf", "float32", "fp8", "auto"),
    "native": ("model", "float32", None, "auto"),
    "kv-int8": ("hf", "float32", None, "int8"),
    "kv-fp8": ("hf", "float32", None, "fp8"),
}


SMOOTH = "w8a8-smooth"
INT4 = "int4-g{32,64,128}[-awq|-rtn]"


def _int4_options(name: str) -> dict | None:
    """LLM arguments of an `int4-...` name (None: not one)."""
    parts = name.split("-")
    if parts[0] != "int4" or len(parts) == 1:
        return None
    options, rest = {}, parts[1:]
    if rest[0].startswith("g") and rest[0][1:].isdigit():
        options["quantization_group_size"] = int(rest.pop(0)[1:])
    if rest and rest[0] in ("awq", "rtn"):
        options["int4_calibration"] = "awq" if rest.pop(0) == "awq" else "none"
    return options if options and not rest else None


def method(name: str, default_alpha: float) -> tuple[tuple, dict]:
    """(METHODS entry, further LLM arguments) of a method name."""
    if name == SMOOTH or name.startswith(SMOOTH + "@"):
        alpha = float(name.split("@", 1)[1]) if "@" in name else default_alpha
        return ("hf", "float32", "w8a8", "auto"), {"smoothquant_alpha": alpha}
    if (options := _int4_options(name)) is not None:
        return METHODS["int4"], options
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; choose from {', '.join(METHODS)}, "
                         f"{SMOOTH}[@ALPHA], {INT4}")
    return METHODS[name], {}


def corpus_text() -> str:
    from jaxllm.quantization.smoothquant import corpus_text
    return corpus_text()


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="the checkpoint `native` runs (default: the default model)")
    p.add_argument("--hf-model", required=True, help="HF directory of float weights for the other methods")
    p.add_argument("--methods", default="f32,bf16,int8,w8a8,int4,native")
    p.add_argument("--num-tokens", type=int, default=20000)
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--smoothquant-alpha", type=float, default=0.5, help="alpha of w8a8-smooth")
    p.add_argument("--results-dir", default="benchmarks/results")
    p.add_argument("--tag", default=None)


def evaluate(llm, chunks: list[list[int]], prompts: list[list[int]], output_len: int) -> dict:
    from jaxllm import SamplingParams
    t0 = time.perf_counter()
    res = llm.generate([{"prompt_token_ids": c} for c in chunks],
                       SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0), use_tqdm=False)
    total, count = 0.0, 0
    for r, c in zip(res, chunks):
        for tok, entry in zip(c[1:], r.prompt_logprobs[1:]):
            total += entry[tok].logprob
            count += 1
    gen = llm.generate([{"prompt_token_ids": p} for p in prompts],
                       SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True),
                       use_tqdm=False)
    return {"perplexity": math.exp(-total / count), "scored_tokens": count,
            "greedy": [list(g.outputs[0].token_ids) for g in gen],
            "seconds": round(time.perf_counter() - t0, 1)}


def agreement(ref: list[list[int]], other: list[list[int]]) -> dict:
    first = [next((i for i, (x, y) in enumerate(zip(s, t)) if x != y), len(s)) for s, t in zip(ref, other)]
    return {"identical_sequences": sum(a == b for a, b in zip(ref, other)),
            "first_token_agreement": float(np.mean([s[:1] == t[:1] for s, t in zip(ref, other)])),
            "token_agreement": float(np.mean([x == y for s, t in zip(ref, other) for x, y in zip(s, t)])),
            "mean_first_divergence": float(np.mean(first))}


def run(args) -> None:
    from jaxllm import LLM
    from jaxllm.loader.loader import get_tokenizer
    from jaxllm.quantization import weight_bytes

    from jaxllm.quantization import smoothquant
    methods = [m for m in args.methods.split(",") if m]
    for m in methods:
        method(m, args.smoothquant_alpha)  # unknown names fail before any model loads
    tok = get_tokenizer(args.hf_model)
    ids = tok(corpus_text(), add_special_tokens=False)["input_ids"][:args.num_tokens]
    _, calibration_start = smoothquant.calibration_text(8 * smoothquant.CALIBRATION_TOKENS)
    calibrated = any(m.startswith(SMOOTH) or m.startswith("int4") for m in methods)
    if calibrated and len(tok.decode(ids)) >= calibration_start:
        raise ValueError(f"--num-tokens {args.num_tokens} reaches the calibration text "
                         f"(from character {calibration_start}); score fewer tokens")
    chunks = [ids[i:i + args.chunk] for i in range(0, len(ids) - 1, args.chunk)]
    rng = np.random.default_rng(0)
    starts = rng.integers(0, len(ids) - args.prompt_len, args.num_prompts)
    prompts = [ids[s:s + args.prompt_len] for s in starts]
    rows, ref = {}, None
    order = ["f32"] + [m for m in methods if m != "f32"]  # the reference first
    for name in order:
        (source, dtype, quant, kv), options = method(name, args.smoothquant_alpha)
        model = args.hf_model if source == "hf" else args.model
        llm = LLM(model, dtype=dtype, quantization=quant, kv_cache_dtype=kv, max_model_len=1024,
                  max_num_seqs=max(32, args.num_prompts), max_num_batched_tokens=1024, warmup=False,
                  **options)
        row = evaluate(llm, chunks, prompts, args.output_len)
        row["weight_mib"] = round(weight_bytes(llm.llm_engine.runner.state) / 2**20, 1)
        row.update(dtype=dtype, quantization=quant or ("as shipped" if source == "model" else None),
                   kv_cache_dtype=kv, model=model or "default")
        row.update(options)
        if llm.llm_engine.smoothquant is not None:  # how SmoothQuant's or AWQ's vectors were made
            row["awq" if quant == "int4" else "smoothquant"] = llm.llm_engine.smoothquant
        if ref is None:
            ref = row["greedy"]
        row["greedy_vs_f32"] = agreement(ref, row.pop("greedy"))
        rows[name] = row
        print(f"{name:14s} ppl {row['perplexity']:.3f}  weights {row['weight_mib']:.1f} MiB  "
              f"greedy vs f32 {row['greedy_vs_f32']['token_agreement']:.3f}  first token "
              f"{row['greedy_vs_f32']['first_token_agreement']:.3f}", flush=True)
        del llm
    write_result(args, {"text": "pydoc_data.topics (CPython's language documentation), sorted topics",
                        "num_tokens": len(ids), "chunk": args.chunk, "num_prompts": args.num_prompts,
                        "prompt_len": args.prompt_len, "output_len": args.output_len,
                        "methods": {m: rows[m] for m in order if m in methods or m == "f32"}}, "quality")
