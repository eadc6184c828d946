"""`jaxllm bench vision`: time to first token of a prompt with one image, the first time
(decoded, preprocessed, encoded by the vision tower, prefilled) and again (the image's
features from the encoder cache, its tokens from the prefix cache), in the same run. A
LLaVA-shaped model with random weights (the flags; default: a ViT-B/16 tower at 224 pixels
before a SmolLM2-135M-shaped language model, a size a 2-core CPU runs), the image 448x448 as a
client would send it."""
from __future__ import annotations

import argparse
import io
import json
import os
import tempfile
import time

import numpy as np

from benchmarks.common import percentiles, write_result

IMAGE_TOKEN = 49152


def add_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model shape")
    g.add_argument("--vision-hidden", type=int, default=768)
    g.add_argument("--vision-layers", type=int, default=12)
    g.add_argument("--vision-heads", type=int, default=12)
    g.add_argument("--vision-intermediate", type=int, default=3072)
    g.add_argument("--image-size", type=int, default=224, help="the vision tower's input")
    g.add_argument("--patch-size", type=int, default=16)
    g.add_argument("--text-hidden", type=int, default=576)
    g.add_argument("--text-layers", type=int, default=30)
    g.add_argument("--text-heads", type=int, default=9)
    g.add_argument("--text-kv-heads", type=int, default=3)
    g.add_argument("--text-intermediate", type=int, default=1536)
    g.add_argument("--dtype", default="auto")
    w = p.add_argument_group("workload")
    w.add_argument("--input-image-size", type=int, default=448, help="the image as sent")
    w.add_argument("--prompt-tokens", type=int, default=64, help="text tokens around the image")
    w.add_argument("--iters", type=int, default=5)
    o = p.add_argument_group("output")
    o.add_argument("--results-dir", default=os.environ.get("OUT") or "benchmarks/results")
    o.add_argument("--tag", default=None)


def config(args) -> dict:
    return {
        "architectures": ["LlavaForConditionalGeneration"], "image_token_index": IMAGE_TOKEN,
        "vision_feature_layer": -2, "vision_feature_select_strategy": "default",
        "projector_hidden_act": "gelu",
        "vision_config": {"model_type": "clip_vision_model", "hidden_size": args.vision_hidden,
                          "intermediate_size": args.vision_intermediate,
                          "num_hidden_layers": args.vision_layers, "num_attention_heads": args.vision_heads,
                          "image_size": args.image_size, "patch_size": args.patch_size,
                          "hidden_act": "quick_gelu", "layer_norm_eps": 1e-5},
        "text_config": {"model_type": "llama", "vocab_size": IMAGE_TOKEN + 64,
                        "hidden_size": args.text_hidden, "intermediate_size": args.text_intermediate,
                        "num_hidden_layers": args.text_layers, "num_attention_heads": args.text_heads,
                        "num_key_value_heads": args.text_kv_heads, "rms_norm_eps": 1e-5,
                        "max_position_embeddings": 4096, "tie_word_embeddings": True,
                        "bos_token_id": 1, "eos_token_id": 2},
    }


def _png(rng, size: int) -> bytes:
    from PIL import Image
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def run(args) -> int:
    from jaxllm import LLM, SamplingParams

    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(config(args), f)
        t0 = time.perf_counter()
        # the step shapes the two requests use compile in the warm-up below, not all of them
        llm = LLM(tmp, load_format="dummy", skip_tokenizer_init=True, dtype=args.dtype,
                  max_model_len=2048, max_num_seqs=4, warmup=False)
        startup = time.perf_counter() - t0
    engine = llm.llm_engine
    per_image = engine.arch.vision["tokens_per_image"]
    params = SamplingParams(temperature=0, max_tokens=1)

    def ttft(prompt, png):
        t = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": prompt, "multi_modal_data": {"image": png}}], params,
                           use_tqdm=False)[0]
        return time.perf_counter() - t, out.num_cached_tokens

    half = args.prompt_tokens // 2
    first, cached, hits = [], [], []
    warm = (rng.integers(3, 40000, half).tolist() + [IMAGE_TOKEN] + rng.integers(3, 40000, half).tolist(),
            _png(rng, args.input_image_size))
    ttft(*warm)  # warm-up: the first time's shapes and the cached one's
    ttft(*warm)
    for _ in range(args.iters):
        prompt = (rng.integers(3, 40000, half).tolist() + [IMAGE_TOKEN]
                  + rng.integers(3, 40000, half).tolist())
        png = _png(rng, args.input_image_size)
        before = engine.encoder.images_encoded
        s, _ = ttft(prompt, png)
        assert engine.encoder.images_encoded == before + 1
        first.append(s)
        s, hit = ttft(prompt, png)
        assert engine.encoder.images_encoded == before + 1  # not encoded again
        cached.append(s)
        hits.append(hit)
    result = {"model": {"vision": {k: getattr(args, k) for k in ("vision_hidden", "vision_layers",
                                                                  "vision_heads", "image_size", "patch_size")},
                        "text": {k: getattr(args, k) for k in ("text_hidden", "text_layers", "text_heads",
                                                                "text_kv_heads", "text_intermediate")},
                        "tokens_per_image": per_image, "dtype": engine.policy.describe()},
              "workload": {"input_image": f"{args.input_image_size}x{args.input_image_size} PNG",
                           "prompt_tokens": args.prompt_tokens + per_image, "iters": args.iters},
              "startup_seconds": round(startup, 2),
              "ttft_first_s": percentiles(first), "ttft_cached_s": percentiles(cached),
              "cached_prompt_tokens": int(np.median(hits)),
              "first_over_cached": float(np.median(first) / np.median(cached))}
    print(f"TTFT with one {args.input_image_size}x{args.input_image_size} image "
          f"({args.prompt_tokens + per_image} prompt tokens): first {np.median(first) * 1e3:.1f} ms, "
          f"again {np.median(cached) * 1e3:.1f} ms ({int(np.median(hits))} tokens cached) = "
          f"{result['first_over_cached']:.2f}x faster")
    write_result(args, result, "vision")
    return 0
