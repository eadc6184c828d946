"""`jaxllm bench detok`: the incremental detokenizer's cost per token along one long stream,
as a streamed request pays it (the step's tokens in, then the delta read out), timed in
windows at the stream's start, middle and end. Constant work per token reads as a flat line:
the report's `last_over_first` is the last window's cost over the first's. The text is the
English corpus the quality benchmark uses, repeated to the stream's length."""
from __future__ import annotations

import argparse
import os
import time

from benchmarks.common import write_result


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="whose tokenizer (default: the default model's)")
    p.add_argument("--num-tokens", type=int, default=64000)
    p.add_argument("--window", type=int, default=2000, help="tokens per timed window")
    p.add_argument("--tokens-per-step", type=int, default=1)
    p.add_argument("--stop", action="append", default=None,
                   help="a stop string that never occurs (searched at every token); repeatable")
    p.add_argument("--results-dir", default=os.environ.get("OUT") or "benchmarks/results")
    p.add_argument("--tag", default=None)


def run(args) -> int:
    from jaxllm.engine.detokenizer import IncrementalDetokenizer, piece_table
    from jaxllm.loader.loader import default_model_path, get_tokenizer
    from jaxllm.quantization.smoothquant import corpus_text

    if args.window * 3 > args.num_tokens:
        raise ValueError("--num-tokens must hold three windows (--window)")
    tok = get_tokenizer(args.model or default_model_path())
    text = corpus_text()
    ids = tok.encode(text, add_special_tokens=False)
    ids = (ids * (args.num_tokens // len(ids) + 1))[:args.num_tokens]
    prompt = ids[:8]
    # the engine's way: the table of tokens' texts built whole, shared by requests
    detok = IncrementalDetokenizer(tok, prompt, stop=args.stop, pieces=piece_table(tok, True))
    k, W, N = args.tokens_per_step, args.window, args.num_tokens
    starts = {0: "start", (N // 2 // k) * k: "middle", ((N - W) // k) * k: "end"}
    windows, sent, shown, t0, open_at = [], 0, [], 0.0, None
    for i in range(0, N, k):
        if i in starts:
            open_at, t0 = i, time.perf_counter()
        detok.update(ids[i:i + k])
        delta = detok.text_since(sent, False)
        sent += len(delta)
        shown.append(delta)
        if open_at is not None and i + k - open_at >= W:
            windows.append({"where": starts[open_at], "first_token": open_at, "tokens": i + k - open_at,
                            "us_per_token": (time.perf_counter() - t0) / (i + k - open_at) * 1e6})
            open_at = None
    shown.append(detok.text_since(sent, True))
    full = tok.decode(prompt + ids[:N])[len(tok.decode(prompt)):]
    result = {"num_tokens": N, "tokens_per_step": k, "stop": args.stop or [],
              "text_chars": len(detok.output_text), "windows": windows,
              "last_over_first": windows[-1]["us_per_token"] / windows[0]["us_per_token"],
              "deltas_join_to_the_full_decode": "".join(shown) == full}
    write_result(args, result, "detok")
    for w in windows:
        print(f"{w['where']:>6} (token {w['first_token']}): {w['us_per_token']:.3f} us per token")
    print(f"last over first: {result['last_over_first']:.2f}; deltas join to the full decode: "
          f"{result['deltas_join_to_the_full_decode']}")
    return 0
