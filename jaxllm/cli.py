"""`jaxllm generate | chat | serve | convert | bench ...`"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import logging
import os
import sys

from jaxllm.config import EngineConfig


def _quant_methods():
    from jaxllm.quantization import METHODS
    return METHODS


def _smoothquant_args(g) -> None:
    g.add_argument("--smoothquant", action="store_true", default=None,
                   help="with -q w8a8: SmoothQuant, calibrated on the float weights at load "
                        "(alpha 0.5 unless --smoothquant-alpha says)")
    g.add_argument("--smoothquant-alpha", type=float, default=None, metavar="ALPHA",
                   help="SmoothQuant's migration strength in [0, 1] (implies --smoothquant)")


def _int4_args(g) -> None:
    g.add_argument("--quantization-group-size", type=int, default=None, choices=[32, 64, 128],
                   help="with -q int4: weights per scale and offset along the input (default 32)")
    g.add_argument("--int4-calibration", default=None, choices=["awq", "none"],
                   help="with -q int4: awq (AWQ's activation-aware scaling, searched on the "
                        "float weights at load) or none (round to nearest, the default)")


def _smoothquant_alpha(args) -> float | None:
    if args.smoothquant_alpha is not None:
        return args.smoothquant_alpha
    from jaxllm.quantization.smoothquant import DEFAULT_ALPHA
    return DEFAULT_ALPHA if args.smoothquant else None


def _auto_int(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number or 'auto', got {text!r}") from None


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers separated by commas, got {text!r}")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None, help="HF directory or GGUF file (default: SmolLM2-135M-Instruct)")
    g.add_argument("--tokenizer", default=None)
    g.add_argument("--skip-tokenizer-init", action="store_true", default=None,
                   help="load no tokenizer: prompts are token ids, outputs token ids without text")
    g.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    g.add_argument("--quantization", "-q", default=None, choices=list(_quant_methods()),
                   help="weight quantization (default: as the checkpoint ships it)")
    _smoothquant_args(g)
    _int4_args(g)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--kv-cache-dtype", default=None, choices=["auto", "bfloat16", "int8", "fp8", "fp8_e4m3"],
                   help="KV cache storage: auto (the activation dtype), bfloat16, or int8 / fp8 with "
                        "a scale per token and head (about twice the tokens of bf16)")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    g.add_argument("--num-gpu-blocks-override", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=None)
    g.add_argument("--max-num-batched-tokens", type=int, default=None)
    g.add_argument("--max-num-batched-tokens-while-decoding", type=_auto_int, default=None, metavar="N|auto",
                   help="the tokens of a step in which requests decode (or 4 per decode if "
                        "more), prompt chunks getting what the decodes leave (0: "
                        "max-num-batched-tokens; auto: 64 on a CPU, no cap on a GPU; `serve` "
                        "defaults to auto)")
    g.add_argument("--attention-backend", default=None,
                   choices=["auto", "pallas", "pallas-mosaic", "pallas-triton", "cpu", "xla"],
                   help="paged attention: the Pallas kernels (default on GPU: Mosaic GPU on "
                        "Hopper and later, else Triton; or either by name), the CPU kernels "
                        "(default on CPU) or XLA's ops")
    g.add_argument("--matmul-backend", default=None,
                   choices=["auto", "cpu", "xla", "pallas", "pallas_interpret"],
                   help="where matmuls run (default auto: the CPU kernels on one CPU device, "
                        "the Pallas kernel for group-quantized weights on one GPU, else XLA)")
    g.add_argument("--cpu-kernels", action=argparse.BooleanOptionalAction, default=None,
                   help="the C++ kernels for matmuls and attention on a CPU (default on)")
    g.add_argument("--cpu-amx", action=argparse.BooleanOptionalAction, default=None,
                   help="let the CPU kernels use AMX tiles where the CPU has them (default on)")
    g.add_argument("--int4-activations", default=None, choices=["float", "int8"],
                   help="4-bit weights in the CPU kernels: float activations (default, exact) "
                        "or int8 per block of 32 (faster at few rows; batch-dependent)")
    g.add_argument("--huge-pages", action=argparse.BooleanOptionalAction, default=None,
                   help="transparent huge pages under a CPU engine's weights and KV cache "
                        "(default on)")
    g.add_argument("--freeze-gc-heap", action=argparse.BooleanOptionalAction, default=True,
                   help="collect and freeze the Python heap once the engine is ready, so that "
                        "garbage collections between steps skip the model's objects (default on)")
    g.add_argument("--gc-young-threshold", type=int, default=10000, metavar="N",
                   help="once the engine is ready, Python's youngest-generation GC threshold "
                        "(default 10000; 0 keeps Python's 700, under which the collector runs "
                        "several times in every large decode step)")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=None)
    g.add_argument("--limit-mm-per-prompt", default=None, metavar="JSON",
                   help="a vision-language model: the most images per prompt, e.g. "
                        "'{\"image\": 2}' (default 4)")
    g.add_argument("--enable-expert-parallel", action="store_true", default=None,
                   help="a mixture-of-experts model's experts split whole over the "
                        "tensor-parallel devices (default: each expert's hidden columns)")
    g.add_argument("--distributed-coordinator", default=None, help="host:port of process 0")
    g.add_argument("--num-processes", type=int, default=None)
    g.add_argument("--process-id", type=int, default=None)
    g.add_argument("--data-parallel-size", "-dp", type=int, default=None,
                   help="engines (replicas) behind one front end, each on its own devices: a "
                        "GPU each, or a share of the CPU cores (default 1)")
    g.add_argument("--data-parallel-backend", default=None, choices=["ray"],
                   help="what runs the replicas: Ray actors (the only backend)")
    g.add_argument("--data-parallel-address", default=None, metavar="auto|HOST:PORT",
                   help="join this running Ray cluster (\"auto\": the one on this machine) "
                        "instead of starting one here")
    g.add_argument("--kv-transfer-config", default=None, metavar="JSON",
                   help="disaggregated prefill/decode over the replicas, e.g. "
                        "'{\"kv_connector\": \"RayObjectStoreConnector\", \"kv_role\": \"kv_both\", "
                        "\"kv_connector_extra_config\": {\"prefill_replicas\": 1}}': the first "
                        "replicas prefill, the others fetch the prompt's KV blocks and decode")
    g.add_argument("--routing-policy", default=None, choices=["prefix", "round_robin", "least_loaded"],
                   help="how replicas are chosen: prefix (default: the replica holding the "
                        "longest cached prefix, balanced by load), round_robin, least_loaded")
    g.add_argument("--routing-cache-threshold", type=float, default=None,
                   help="prefix routing: the least part of a prompt's blocks a replica must hold "
                        "for its cached prefix to count; below it the least loaded replica takes "
                        "the request (default 0.3)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="automatic prefix caching (default on)")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="schedule the next step while the device runs this one (default on)")
    g.add_argument("--num-scheduler-steps", type=int, default=None,
                   help="decode passes per device call while every request decodes (multi-step "
                        "scheduling; default 1: off)")
    g.add_argument("--scheduling-policy", default=None, choices=["fcfs", "priority"])
    g.add_argument("--preemption-mode", default=None, choices=["recompute", "swap"])
    g.add_argument("--swap-space", type=float, default=None, help="GiB of host memory for swap")
    g.add_argument("--enable-lora", action="store_true", default=None,
                   help="serve LoRA adapters over the base model (jaxllm.lora)")
    g.add_argument("--max-loras", type=int, default=None,
                   help="distinct adapters in one step: device slots (default 1)")
    g.add_argument("--max-lora-rank", type=int, default=None,
                   help="largest adapter rank; a larger one is refused (default 16)")
    g.add_argument("--max-cpu-loras", type=int, default=None,
                   help="adapters kept loaded in host memory (default max-loras)")
    g.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'')
    g.add_argument("--structured-outputs-allow-additional-properties", action="store_true",
                   default=None,
                   help="JSON schemas' objects that do not set additionalProperties may carry "
                        "keys they do not name (JSON Schema's reading); default: only the keys "
                        "a schema describes are generated")
    g.add_argument("--compile-in-background", action=argparse.BooleanOptionalAction, default=None,
                   help="be ready once the shapes holding any step are compiled and compile the "
                        "rest while serving (default: on for serve, off otherwise)")
    g.add_argument("--token-buckets", type=_int_list, default=None, metavar="T1,T2,...",
                   help="the padded token counts of the compiled step shapes (default: powers "
                        "of two up to max-num-batched-tokens, and small decode shapes on a CPU)")
    g.add_argument("--seq-buckets", type=_int_list, default=None, metavar="S1,S2,...",
                   help="the padded sequence counts of the compiled step shapes (default: powers "
                        "of two up to max-num-seqs)")
    g.add_argument("--compilation-cache-dir", default=None,
                   help="persistent XLA compilation cache (default ~/.cache/jaxllm/xla, or "
                        "$JAXLLM_COMPILATION_CACHE_DIR)")
    g.add_argument("--executable-cache", action=argparse.BooleanOptionalAction, default=None,
                   help="keep compiled step executables in the compilation cache directory "
                        "(default on)")
    g.add_argument("--max-step-failures", type=int, default=None, metavar="N",
                   help="a step that raises fails only its requests; N failed steps within "
                        "--step-failure-window seconds stop the engine (default 5; 1: the first)")
    g.add_argument("--step-failure-window", type=float, default=None, metavar="SECONDS",
                   help="the window of --max-step-failures (default 60)")
    g.add_argument("--inject-step-faults", type=int, default=None, metavar="N",
                   help="testing: about one step in N fails on purpose, every second such "
                        "fault losing the KV cache (default 0: never)")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    kwargs = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)
              if hasattr(args, f.name) and getattr(args, f.name) is not None}
    if kwargs.get("max_num_batched_tokens_while_decoding") == "auto":
        kwargs["max_num_batched_tokens_while_decoding"] = None  # resolved for the platform
    if hasattr(args, "smoothquant"):
        kwargs["smoothquant_alpha"] = _smoothquant_alpha(args)
    return EngineConfig(**kwargs)


def _sampling_args(p: argparse.ArgumentParser, max_tokens: int, temperature: float) -> None:
    p.add_argument("--max-tokens", type=int, default=max_tokens)
    p.add_argument("--temperature", type=float, default=temperature)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")


def _sampling_params(args):
    from jaxllm.sampling_params import SamplingParams
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                          top_p=args.top_p, top_k=args.top_k, seed=args.sampling_seed)


def _make_llm(args):
    from jaxllm.llm import LLM
    llm = LLM(config=engine_config_from_args(args))
    print(f"ready in {llm.llm_engine.startup_seconds:.1f} s", file=sys.stderr)
    return llm


def cmd_generate(args) -> int:
    llm = _make_llm(args)
    prompts = args.prompt or ["The capital of France is"]
    for out in llm.generate(prompts, _sampling_params(args), use_tqdm=False):
        print(f"--- {out.prompt!r}")
        print(out.outputs[0].text)
    return 0


def cmd_chat(args) -> int:
    llm = _make_llm(args)
    params = _sampling_params(args)
    history = [{"role": "system", "content": args.system}] if args.system else []
    interactive = sys.stdin.isatty() and not args.message
    lines = args.message or sys.stdin
    if interactive:
        print("chat with the model; an empty line or Ctrl-D quits", file=sys.stderr)
    while True:
        if args.message:
            line = lines.pop(0) if lines else None
        elif not interactive:
            line = next(lines, None)
        else:
            try:
                line = input("> ")
            except EOFError:
                line = None
        if line is None or not line.strip():
            return 0
        history.append({"role": "user", "content": line.strip()})
        reply = llm.chat(history, params, use_tqdm=False)[0].outputs[0].text
        history.append({"role": "assistant", "content": reply})
        print(reply, flush=True)


def cmd_serve(args) -> int:
    from serve.server import run_server
    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise SystemExit("give the model once: as MODEL or as --model")
        args.model = args.model_tag
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise SystemExit("--enable-auto-tool-choice needs --tool-call-parser")
    if args.compile_in_background is None:  # a server is ready sooner; its batching varies anyway
        args.compile_in_background = True
    if args.max_num_batched_tokens_while_decoding is None:  # streams keep their pace
        args.max_num_batched_tokens_while_decoding = "auto"
    return run_server(engine_config_from_args(args), args.host, args.port, args.served_model_name,
                      args.api_key, args.max_queue_len, args.shutdown_timeout, args.log_interval,
                      args.tool_call_parser if args.enable_auto_tool_choice else None,
                      args.lora_modules, args.enable_runtime_lora_updating,
                      max_prompt_tokens=args.max_prompt_tokens,
                      chat_context_policy=args.chat_context_policy,
                      chat_trim_step=args.chat_trim_step,
                      web_ui=not args.disable_web_ui,
                      allowed_media_domains=args.allowed_media_domains)


def cmd_convert(args) -> int:
    """Write MODEL as an Orbax checkpoint of the engine's layout for --tensor-parallel-size
    devices. The layout is made on that many CPU devices, so no accelerator (or one with
    fewer devices) is needed."""
    from jax._src import xla_bridge
    import jax
    tp = args.tensor_parallel_size or 1
    if not xla_bridge.backends_are_initialized():
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", tp)
    kwargs = dict(model=None if args.model == "default" and not os.path.exists(args.model) else args.model, tokenizer=args.tokenizer,
                  dtype=args.dtype, load_format=args.load_format, tensor_parallel_size=tp,
                  seed=args.seed)
    kwargs["quantization"] = args.quantization
    kwargs["smoothquant_alpha"] = _smoothquant_alpha(args)
    kwargs.update(quantization_group_size=args.quantization_group_size,
                  int4_calibration=args.int4_calibration)
    config = EngineConfig(**kwargs)  # validates the values as the engine would
    from jaxllm.loader.convert import convert
    out = convert(config.model, args.output, dtype=config.dtype,
                  quantization=config.quantization, smoothquant_alpha=config.smoothquant_alpha,
                  quantization_group_size=config.quantization_group_size,
                  int4_calibration=config.int4_calibration,
                  tensor_parallel_size=config.tensor_parallel_size, load_format=config.load_format,
                  tokenizer=config.tokenizer, seed=config.seed)
    print(f"wrote {out}; run it with: jaxllm serve {out}"
          + (f" --tensor-parallel-size {tp}" if tp > 1 else ""), file=sys.stderr)
    return 0


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(prog="jaxllm")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("generate", help="complete prompts offline")
    p.add_argument("prompt", nargs="*")
    add_engine_args(p)
    _sampling_args(p, max_tokens=64, temperature=0.0)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="chat with the model through its chat template")
    p.add_argument("--system", default=None)
    p.add_argument("--message", action="append", help="send this message (repeatable) instead of reading stdin")
    add_engine_args(p)
    _sampling_args(p, max_tokens=256, temperature=0.0)
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("serve", help="the OpenAI-compatible server")
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="HF directory or GGUF file (default: SmolLM2-135M-Instruct)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--api-key", default=None, help="require this bearer key on /v1 (or JAXLLM_API_KEY)")
    p.add_argument("--enable-runtime-lora-updating", action="store_true",
                   help="allow POST /v1/load_lora_adapter and /v1/unload_lora_adapter (or "
                        "JAXLLM_ALLOW_RUNTIME_LORA_UPDATING=1)")
    p.add_argument("--max-queue-len", type=int, default=None,
                   help="answer 429 while this many requests wait")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish on SIGTERM")
    p.add_argument("--log-interval", type=float, default=10.0, help="seconds between stats lines")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='let the model decide when to call tools (tool_choice "auto")')
    p.add_argument("--tool-call-parser", default=None, choices=["hermes", "llama3_json"],
                   help="how the model writes tool calls: hermes (<tool_call> JSON: Qwen, "
                        "Hermes, SmolLM3 templates) or llama3_json (Llama 3.x)")
    p.add_argument("--max-prompt-tokens", type=int, default=None, metavar="N",
                   help="a chat's prompt budget in tokens: over it, a 400 (or with "
                        "--chat-context-policy trim, the oldest turns dropped)")
    p.add_argument("--chat-context-policy", default="reject", choices=["reject", "trim"],
                   help="a conversation longer than its budget (or than the model's length "
                        "less max_tokens): refused with a 400, or trimmed oldest turn first, "
                        "keeping system messages, the latest user turn and the last tool calls")
    p.add_argument("--allowed-media-domains", nargs="+", default=None, metavar="HOST",
                   help="image URLs of these hosts are fetched by the server (default: none; "
                        "data: URLs always work)")
    p.add_argument("--disable-web-ui", action="store_true",
                   help="serve no chat page at / and no dashboard at /dashboard")
    p.add_argument("--chat-trim-step", type=float, default=0.25, metavar="FRACTION",
                   help="where a trimmed chat may be cut: this fraction of its budget "
                        "(context_budget or --max-prompt-tokens, else the model's length) "
                        "between allowed cuts, fixed by the turns before them, so the cut stays "
                        "put while a chat grows and its prefix stays cached; 0 drops the fewest "
                        "turns but moves the cut at every turn")
    p.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help="LoRA adapters served under these model names (with --enable-lora); "
                        "JSON {\"name\", \"path\", \"base_model_name\"} also works")
    add_engine_args(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("convert", help="write a model as an Orbax checkpoint that starts fast")
    p.add_argument("model", metavar="MODEL",
                   help="HF directory, GGUF file, or `default` (SmolLM2-135M-Instruct)")
    p.add_argument("output", metavar="OUT", help="new directory for the checkpoint")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                   help="weights' dtype (auto: what the engine's auto runs here, bf16 on a GPU and "
                        "on a one-device CPU with the kernels, else float32; restoring casts to "
                        "the engine's dtype when it differs)")
    p.add_argument("--quantization", "-q", default=None, choices=list(_quant_methods()),
                   help="weight quantization, as the engine's (default: as the checkpoint ships it)")
    _smoothquant_args(p)
    _int4_args(p)
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="devices the checkpoint's layout is for (restoring needs the same)")
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                   help="dummy: random weights of the model's shapes")
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--seed", type=int, default=0, help="seed of dummy weights")
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("bench", help="benchmarks")
    bench = p.add_subparsers(dest="bench_command", required=True)
    for name, module, help_, engine in (
            ("throughput", "throughput", "offline throughput against HF transformers", True),
            ("latency", "latency", "TTFT and decode step time at batch 1 and N", True),
            ("spec", "spec_decode", "speculative decoding's speed-up against batch size", True),
            ("structured", "structured", "JSON-schema requests against free ones; grammar TTFT; "
             "--adherence: schema adherence, objects strict and permissive",
             True),
            ("lora", "lora", "multi-LoRA serving against the base model alone", True),
            ("serve", "serve", "online load against an OpenAI-compatible server", False),
            ("serve-peer", "serve_peer", "jaxllm serve against vLLM's server through vLLM's "
             "bench serve client", False),
            ("replicas", "replicas", "data-parallel replicas: prefix-aware routing against round "
             "robin, 2 replicas against 1, prefill/decode split against colocated", False),
            ("kv-transport", "kv_transport", "moving KV blocks between processes: Ray's object "
             "store, Mooncake's transfer engine, NIXL", False),
            ("soak", "soak", "minutes of mixed traffic and injected faults against a real "
             "server: lost requests, leaks, RSS, latency over time", False),
            ("web", "web_ui", "the chat page and dashboard in headless Chromium: page weight, "
             "the TTFT the page adds, API throughput with the dashboard open", False),
            ("kernels", "kernels", "paged-attention kernels against measured peaks", False),
            ("moe", "moe", "a mixture-of-experts decode step: grouped experts against every "
             "expert on every token and a dense model of the same active parameters", False),
            ("vision", "vision", "time to first token with an image: first time against cached",
             False),
            ("dots", "dots", "the dtype forms of a projection's dot on this machine", False),
            ("detok", "detok", "the detokenizer's cost per token along a long stream", False),
            ("quality", "quality", "perplexity and greedy agreement per weight format", False),
            ("aot", "gpu_aot", "compile kernels and engine step for a GPU without one", False),
            ("startup", "startup", "start-to-ready and weight loading: source vs Orbax, cold and warm", True),
            ("revisions", "revisions", "one benchmark at two revisions of this repository, alternated",
             False)):
        mod = importlib.import_module(f"benchmarks.{module}")
        b = bench.add_parser(name, help=help_)
        if engine:
            add_engine_args(b)
        mod.add_args(b)
        b.set_defaults(func=mod.run)

    args = parser.parse_args(argv)
    args.argv = list(argv) if argv is not None else sys.argv[1:]  # reports record the command
    try:
        return args.func(args) or 0
    except ValueError as e:  # a refused argument or model: say why in one line, no traceback
        print(f"jaxllm {args.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
