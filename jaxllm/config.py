"""Engine configuration: plain dataclasses validated in __post_init__."""
from __future__ import annotations

from dataclasses import dataclass, field

from jaxllm import envs
from jaxllm.kernels import MATMUL_BACKENDS
from jaxllm.quantization import (validate_int4_activations, validate_int4_options, validate_method,
                                 validate_smoothquant)
from jaxllm.quantization.kv import validate_kv_dtype
from jaxllm.kv_transfer_config import KVTransferConfig
from jaxllm.spec_decode.config import SpeculativeConfig

DTYPES = ("auto", "bfloat16", "float16", "float32")
LOAD_FORMATS = ("auto", "dummy")
ATTENTION_BACKENDS = ("auto", "pallas", "pallas-mosaic", "pallas-triton", "cpu", "xla")
ROUTING_POLICIES = ("prefix", "round_robin", "least_loaded")  # jaxllm.distributed.router


def _positive(name: str, value) -> None:
    if value is not None and (not isinstance(value, int) or value < 1):
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _buckets(name: str, value) -> None:
    if value is None:
        return
    if (not isinstance(value, (list, tuple)) or not value
            or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in value)
            or list(value) != sorted(set(value))):
        raise ValueError(f"{name} must be a non-empty ascending list of positive integers, "
                         f"got {value!r}")


DEFAULT_IMAGES_PER_PROMPT = 4


def parse_mm_limit(value) -> dict:
    """limit_mm_per_prompt: {"image": n} (a dict or its JSON), n >= 0."""
    if value is None:
        return {"image": DEFAULT_IMAGES_PER_PROMPT}
    if isinstance(value, str):
        import json
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"limit_mm_per_prompt is not valid JSON: {e}") from None
    if (not isinstance(value, dict) or set(value) - {"image"} or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value.values())):
        raise ValueError(f"limit_mm_per_prompt must be like {{\"image\": 2}} (images only, a "
                         f"count >= 0), got {value!r}")
    return {"image": value.get("image", DEFAULT_IMAGES_PER_PROMPT)}


@dataclass
class EngineConfig:
    """Everything `LLM(**kwargs)` and `jaxllm serve --flags` accept, with vLLM's names."""

    model: str | None = None
    tokenizer: str | None = None
    # no tokenizer at all: prompts are token ids, outputs token ids without text; what needs
    # text (text prompts, stop strings, chat, structured outputs) is refused
    skip_tokenizer_init: bool = False
    dtype: str = "auto"
    max_model_len: int | None = None
    load_format: str = "auto"
    # weight quantization (jaxllm.quantization); None: as the checkpoint ships
    quantization: str | None = None
    # SmoothQuant for w8a8 (jaxllm.quantization.smoothquant): its migration strength alpha,
    # calibrated at load; None: off
    smoothquant_alpha: float | None = None
    # int4 made at load (jaxllm.quantization): its group along the input (32, 64 or 128;
    # None: DEFAULT_INT4_GROUP) and its calibration: "awq" (AWQ's activation-aware scaling,
    # jaxllm.quantization.awq) or "none" (round to nearest; None: DEFAULT_INT4_CALIBRATION)
    quantization_group_size: int | None = None
    int4_calibration: str | None = None
    seed: int = 0
    # KV cache
    kv_cache_dtype: str = "auto"         # or "int8" / "fp8": a scale per token and head
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    num_gpu_blocks_override: int | None = None
    # scheduler; None picks a default for the platform in resolve()
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    # the tokens of a step in which requests decode (or 4 per decode, if more): prompt chunks
    # get what the decodes leave, so streams keep near a decode step's inter-token latency while
    # prompts arrive; steps without decodes still take max_num_batched_tokens. 0: no cap (best
    # offline throughput); None: 64 on a CPU (where a step costs in proportion to its
    # tokens), no cap on a GPU. `jaxllm serve` defaults to None
    max_num_batched_tokens_while_decoding: int | None = 0
    # paged attention: "pallas-mosaic" (the Mosaic GPU kernels, Hopper on), "pallas-triton"
    # (the Triton ones), "pallas" (the better of the two for the device and cache; auto on a
    # GPU), "cpu" (the CPU kernels; auto on a CPU where cpu_kernels) or "xla" (XLA's ops).
    # Off a GPU the Pallas kernels run in their interpreters (tests).
    attention_backend: str = "auto"
    # where matmuls run: "auto" (the CPU kernels on one CPU device, the Pallas kernel for
    # group-quantized weights on one GPU, XLA's dots elsewhere), or one of them forced:
    # "cpu", "xla", "pallas", "pallas_interpret" (the Pallas kernel in its interpreter)
    matmul_backend: str = "auto"
    # the C++ kernels on a CPU (matmuls and attention); off: XLA's paths
    cpu_kernels: bool = True
    # the CPU kernels multiply on AMX's tiles where the CPU has them; off: AVX-512
    cpu_amx: bool = True
    # 4-bit weights in the CPU kernels: "float" activations (exact to the dequantized weights)
    # or "int8" per block of 32 (faster at few rows; outputs then depend on the batch)
    int4_activations: str = "float"
    # transparent huge pages under a CPU engine's weights and KV cache
    huge_pages: bool = True
    # once started, the engine collects garbage and freezes the heap (gc.freeze): Python's
    # full collections then skip the millions of objects of the loaded model and compiled
    # steps, which otherwise make them long pauses between steps. A dropped engine's frozen
    # cycles are collected only when the next such engine starts (or at gc.unfreeze), so it
    # is off by default in Python, where a process may build engines one after another; on
    # for `jaxllm serve` and `jaxllm bench`
    freeze_gc_heap: bool = False
    # once started, the threshold of Python's youngest GC generation (gc.set_threshold's
    # first; 0 leaves CPython's 700). A decode step makes a few objects per request that live
    # into the next step (outputs, token lists): at 700 the collector runs several times a
    # step and walks them all. Process-wide, so off by default in Python; 10,000 for the CLI
    gc_young_threshold: int = 0
    tensor_parallel_size: int = 1
    # a mixture-of-experts model's experts split whole over the tensor-parallel devices
    # (expert parallelism) instead of each expert's hidden columns
    enable_expert_parallel: bool = False
    # a vision-language model: the most images one prompt may carry, vLLM's dict (or its
    # JSON), e.g. {"image": 2}; None: DEFAULT_IMAGES_PER_PROMPT
    limit_mm_per_prompt: dict | str | None = None
    # multi-process (multi-host) runs: jax.distributed.initialize's coordinator and ranks
    distributed_coordinator: str | None = None
    num_processes: int = 1
    process_id: int = 0
    # data-parallel replicas (jaxllm.distributed): this many engines, each on its own devices
    # (a GPU each, or a share of the CPU cores), started as Ray actors behind one front end
    # that routes each request by `routing_policy`; `data_parallel_address` joins a running
    # Ray cluster ("auto" or host:port) instead of starting one on this machine
    data_parallel_size: int = 1
    data_parallel_backend: str = "ray"
    data_parallel_address: str | None = None
    routing_policy: str = "prefix"
    # prefix routing: a cached prefix counts when it covers this much of the prompt
    routing_cache_threshold: float = 0.3
    # disaggregated prefill/decode (jaxllm.distributed): vLLM's dict (or its JSON), e.g.
    # {"kv_connector": "RayObjectStoreConnector", "kv_role": "kv_both",
    #  "kv_connector_extra_config": {"prefill_replicas": 1}}: some replicas prefill, the
    # others import the prompt's KV blocks and decode (served by `jaxllm serve`)
    kv_transfer_config: KVTransferConfig | dict | str | None = None
    enable_prefix_caching: bool = True
    # the host schedules step N+1 while the device runs step N (outputs are identical)
    async_scheduling: bool = True
    # decode passes per dispatch (vLLM V0's multi-step scheduling): while every running
    # request decodes, one device call runs this many passes, each sampling the next pass's
    # tokens on the device, and the host's per-step work is shared over them. Outputs are
    # the same; a request arriving meanwhile waits for the call to end. 1: off
    num_scheduler_steps: int = 1
    scheduling_policy: str = "fcfs"      # or "priority": lower `priority` values first
    preemption_mode: str = "recompute"   # or "swap": blocks go to host memory and back
    swap_space: float = 4.0              # GiB of host memory for swapped blocks
    # LoRA adapters (jaxllm.lora): device slots for distinct adapters in one step, the
    # largest rank they may have, and the host cache of loaded adapters (default max_loras)
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # speculative decoding: vLLM's dict (or its JSON), e.g. {"method": "ngram",
    # "num_speculative_tokens": 4}; jaxllm.spec_decode.config.SpeculativeConfig
    speculative_config: SpeculativeConfig | dict | str | None = None
    # compilation
    compilation_cache_dir: str | None = field(default_factory=envs.compilation_cache_dir)
    # keep compiled step executables under compilation_cache_dir (a second start skips
    # tracing too); off: JAX's persistent cache only
    executable_cache: bool = True
    warmup: bool = True
    # ready once the shapes that hold any step are compiled (StepShapes.essential); the rest
    # compile on a thread while steps pad to compiled shapes. Off by default: a step's padded
    # shape (and so its last float bits) would then depend on timing; `jaxllm serve` turns it
    # on, where batching already does
    compile_in_background: bool = False
    # the padded step shapes compiled (jaxllm.runner.buckets): token counts T and sequence
    # counts S, each ascending, the maxima added if missing. None: powers of two up to
    # max_num_batched_tokens and max_num_seqs (and, on a CPU, square decode shapes below 16
    # tokens). Fewer buckets compile faster; a step then pads to a larger shape
    token_buckets: list[int] | None = None
    seq_buckets: list[int] | None = None
    # JSON schemas read as JSON Schema has it: an object that does not set
    # additionalProperties may carry keys it never names. Off (vLLM's default backend and
    # OpenAI's strict mode): only the keys a schema describes are generated
    structured_outputs_allow_additional_properties: bool = False
    # a step that raises (a device error, out of memory) fails only the requests it ran; this
    # many failed steps within step_failure_window seconds stop the engine (1: the first
    # does; across processes the first always does)
    max_step_failures: int = 5
    step_failure_window: float = 60.0
    # for testing fault handling (jaxllm bench soak): about one step in N raises before it
    # runs, every second such fault dropping the KV cache as a failed donated call can (0: none)
    inject_step_faults: int = 0

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        validate_method(self.quantization)
        validate_smoothquant(self.smoothquant_alpha, self.quantization)
        validate_int4_options(self.quantization_group_size, self.int4_calibration, self.quantization)
        validate_kv_dtype(self.kv_cache_dtype)
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        for name in ("tensor_parallel_size", "num_processes", "data_parallel_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if not 0 <= self.process_id < self.num_processes:
            raise ValueError(f"process_id must be in [0, num_processes={self.num_processes}), "
                             f"got {self.process_id}")
        if self.num_processes > 1 and not self.distributed_coordinator:
            raise ValueError("num_processes > 1 needs distributed_coordinator (host:port)")
        if self.num_processes > 1 and self.preemption_mode == "swap":
            raise ValueError("preemption_mode='swap' is not supported across processes; "
                             "use 'recompute'")
        if self.data_parallel_backend != "ray":
            raise ValueError(f"data_parallel_backend must be 'ray' (replicas run as Ray actors), "
                             f"got {self.data_parallel_backend!r}")
        if self.routing_policy not in ROUTING_POLICIES:
            raise ValueError(f"routing_policy must be one of {ROUTING_POLICIES}, "
                             f"got {self.routing_policy!r}")
        if not 0.0 <= self.routing_cache_threshold <= 1.0:
            raise ValueError(f"routing_cache_threshold must be within [0, 1], "
                             f"got {self.routing_cache_threshold}")
        self.limit_mm_per_prompt = parse_mm_limit(self.limit_mm_per_prompt)
        self.kv_transfer_config = KVTransferConfig.parse(self.kv_transfer_config)
        if self.kv_transfer_config is not None:
            if self.data_parallel_size < 2:
                raise ValueError("kv_transfer_config needs data_parallel_size >= 2 (prefill "
                                 "replicas and decode replicas)")
            self.kv_transfer_config.num_prefill(self.data_parallel_size)
            if not self.enable_prefix_caching:
                raise ValueError("kv_transfer_config needs enable_prefix_caching: the decode "
                                 "replicas find the moved blocks as prefix-cache hits")
            if self.speculative_config is not None:
                raise ValueError("kv_transfer_config does not combine with speculative_config "
                                 "yet (the draft model's cache would have to move too)")
        if self.data_parallel_size > 1 and self.num_processes > 1:
            raise ValueError("data_parallel_size > 1 does not combine with num_processes > 1: "
                             "each replica is one process (use tensor_parallel_size inside it)")
        for name in ("token_buckets", "seq_buckets"):
            _buckets(name, getattr(self, name))
        for name in ("max_model_len", "block_size", "num_gpu_blocks_override",
                     "max_num_seqs", "max_num_batched_tokens", "kv_cache_memory_bytes"):
            _positive(name, getattr(self, name))
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, "
                             f"got {self.attention_backend!r}")
        if self.matmul_backend not in MATMUL_BACKENDS:
            raise ValueError(f"matmul_backend must be one of {MATMUL_BACKENDS}, "
                             f"got {self.matmul_backend!r}")
        validate_int4_activations(self.int4_activations)
        for name in ("cpu_kernels", "cpu_amx", "huge_pages", "freeze_gc_heap", "executable_cache",
                     "enable_prefix_caching", "async_scheduling", "enable_lora", "warmup",
                     "compile_in_background", "skip_tokenizer_init",
                     "structured_outputs_allow_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if (not isinstance(self.gc_young_threshold, int) or isinstance(self.gc_young_threshold, bool)
                or self.gc_young_threshold < 0):
            raise ValueError(f"gc_young_threshold must be a non-negative int (0: Python's "
                             f"default), got {self.gc_young_threshold!r}")
        if self.skip_tokenizer_init and self.tokenizer is not None:
            raise ValueError("tokenizer and skip_tokenizer_init=True contradict each other")
        if not self.cpu_kernels and "cpu" in (self.attention_backend, self.matmul_backend):
            raise ValueError("attention_backend / matmul_backend 'cpu' need cpu_kernels=True")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}")
        if not self.swap_space >= 0:
            raise ValueError(f"swap_space must be non-negative (GiB), got {self.swap_space}")
        for name in ("max_loras", "max_lora_rank", "max_cpu_loras"):
            _positive(name, getattr(self, name))
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras "
                             f"({self.max_loras})")
        if self.enable_lora and self.num_processes > 1:
            raise ValueError("enable_lora is not supported across processes yet")
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        if self.speculative_config is not None and self.num_processes > 1:
            raise ValueError("speculative_config is not supported across processes yet")
        if self.enable_lora and self.speculative_config is not None:
            raise ValueError("speculative_config is not supported with enable_lora yet (proposals "
                             "and their verification would need the request's adapter)")
        _positive("num_scheduler_steps", self.num_scheduler_steps)
        _positive("max_step_failures", self.max_step_failures)
        if not (isinstance(self.step_failure_window, (int, float)) and self.step_failure_window > 0):
            raise ValueError(f"step_failure_window must be a positive number of seconds, got "
                             f"{self.step_failure_window!r}")
        if not isinstance(self.inject_step_faults, int) or self.inject_step_faults < 0:
            raise ValueError(f"inject_step_faults must be a non-negative integer, got "
                             f"{self.inject_step_faults!r}")
        if self.num_scheduler_steps > 1 and self.speculative_config is not None:
            raise ValueError("num_scheduler_steps > 1 does not combine with speculative_config "
                             "(both make a step emit several tokens; choose one)")
        if self.num_scheduler_steps > 1 and self.num_processes > 1:
            raise ValueError("num_scheduler_steps > 1 is not supported across processes yet")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 2:
            raise ValueError("num_gpu_blocks_override must be at least 2 (one is the null block)")

    def resolve(self, platform: str, model_max_len: int) -> None:
        """Fill the platform-dependent defaults once the model and device are known."""
        on_gpu = platform == "gpu"
        if self.max_model_len is None:
            self.max_model_len = model_max_len
        if self.max_num_seqs is None:
            self.max_num_seqs = 256 if on_gpu else 64
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = 8192 if on_gpu else 512
        if self.max_num_batched_tokens_while_decoding is None:
            self.max_num_batched_tokens_while_decoding = 0 if on_gpu else 64
        if self.max_num_batched_tokens_while_decoding < 0:
            raise ValueError("max_num_batched_tokens_while_decoding must be at least 0 (0: no cap), "
                             f"got {self.max_num_batched_tokens_while_decoding}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
                f"max_num_seqs ({self.max_num_seqs})")
        for name, limit in (("token_buckets", "max_num_batched_tokens"), ("seq_buckets", "max_num_seqs")):
            buckets, top = getattr(self, name), getattr(self, limit)
            if buckets is not None:
                if buckets[-1] > top:
                    raise ValueError(f"{name}: {buckets[-1]} exceeds {limit} ({top})")
                setattr(self, name, list(buckets) + ([top] if buckets[-1] < top else []))
        if self.token_buckets is not None and self.seq_buckets is not None \
                and self.token_buckets[0] < self.seq_buckets[0]:
            raise ValueError(f"token_buckets: {self.token_buckets[0]} tokens cannot hold the "
                             f"smallest seq bucket ({self.seq_buckets[0]} sequences)")
