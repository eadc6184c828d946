import os

import tempfile  # noqa: E402

# tests run on the CPU; benchmarks/gpu_suite.sh runs the kernel tests on its GPU
if os.environ.get("JAXLLM_GPU_TESTS") != "1":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
# one compilation cache for the whole run, so engines of the same shapes compile once
os.environ.setdefault("JAXLLM_COMPILATION_CACHE_DIR", tempfile.mkdtemp(prefix="jaxllm-xla-"))
os.environ.setdefault("JAXLLM_TOKENIZER_CACHE_DIR", tempfile.mkdtemp(prefix="jaxllm-tok-"))
# two workers (pytest-xdist) share the cores: the HF reference models' OpenMP threads would
# otherwise spin against the other worker's (XLA's own pool yields)
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import gc  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402

import pytest  # noqa: E402

from jaxllm.loader.loader import default_model_path, get_tokenizer  # noqa: E402

# Small engine limits keep the number of compiled shapes (and CI time) low: compiling the
# step shapes is most of an engine's start, and the suite starts many engines. The tests of
# the default shape set itself (background compilation, bucket choice) use SMALL_LIMITS.
SMALL_LIMITS = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256)


def covering(*axes) -> list[tuple]:
    """Parameters for a kernel test over several axes: on the CPU (Pallas' interpreter, seconds
    per case) every value of every axis at least once, the i-th values together and shorter
    axes cycled; under the GPU suite (JAXLLM_GPU_TESTS=1), where a case takes milliseconds,
    every combination."""
    if os.environ.get("JAXLLM_GPU_TESTS") == "1":
        return list(itertools.product(*axes))
    n = max(len(a) for a in axes)
    return [tuple(a[i % len(a)] for a in axes) for i in range(n)]


def few_shapes(max_num_seqs: int, max_num_batched_tokens: int) -> dict:
    """Two token buckets and two sequence buckets: three step shapes where the derived set
    of the same limits has about ten."""
    return dict(token_buckets=sorted({min(16, max_num_batched_tokens), max_num_batched_tokens}),
                seq_buckets=sorted({max(1, max_num_seqs // 2), max_num_seqs}))


FEW_SHAPES = few_shapes(SMALL_LIMITS["max_num_seqs"], SMALL_LIMITS["max_num_batched_tokens"])
SMALL_ENGINE = {**SMALL_LIMITS, **FEW_SHAPES}


def pytest_addoption(parser):
    parser.addoption("--web-screenshots", default=None, metavar="DIR",
                     help="also write the web UI tests' screenshots (chat.png, dashboard.png) to DIR")


def pytest_collection_modifyitems(items):
    """Modules run in the order of their file names, whatever folder holds them (a stable
    sort: a module's tests stay together and in order). The modules that build the most
    engines (async scheduling and speculation) then run first, while the process holds few
    compiled executables: each maps memory regions, and past vm.max_map_count XLA:CPU cannot
    map more compiled code and aborts."""
    items.sort(key=lambda item: os.path.basename(str(item.fspath)))


@pytest.fixture(autouse=True)
def _unfreeze_after_test():
    """A CLI engine run in-process froze the heap (freeze_gc_heap): after the test its
    engine's cycles become collectable again, or they would stay until the next freezing
    engine starts. It also raised the collector's threshold (gc_young_threshold), which the
    next test gets back as it was."""
    threshold = gc.get_threshold()
    yield
    if gc.get_threshold() != threshold:
        gc.set_threshold(*threshold)
    if gc.get_freeze_count():
        gc.unfreeze()
        gc.collect()


@pytest.fixture(scope="module", autouse=True)
def _collect_module_engines():
    """The engines a finished module's fixtures held are collected before the next module
    builds its own. Each compiled XLA:CPU executable maps ~60 memory regions; past the
    process's limit (vm.max_map_count, 65,530 by default) XLA cannot map compiled code, and
    the failed compile crashes the process. A frozen heap (freeze_gc_heap, on for the CLI's
    engines) is unfrozen first, or its engines' cycles would never be collected."""
    yield
    gc.unfreeze()
    gc.collect()
    _return_freed_memory()


def _return_freed_memory() -> None:
    """glibc keeps the heap a module's engines freed for reuse; the two workers' kept heaps
    add up to gigabytes late in the suite, where it runs close to the machine's memory.
    malloc_trim gives them back to the system."""
    import ctypes
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


@pytest.fixture
def cpu_amx():
    """Switch the CPU kernels between AMX and AVX-512 within a test (EngineConfig.cpu_amx is
    process-wide); AMX is allowed again afterwards."""
    from jaxllm.kernels.cpu import build
    yield build.set_amx
    build.set_amx(True)


@pytest.fixture(scope="session")
def default_gguf() -> str:
    return default_model_path()


@pytest.fixture(scope="session")
def default_hf_dir(tmp_path_factory, default_gguf) -> str:
    """The default model as HF transformers reads its GGUF file, saved as an HF float32
    directory once per run and shared by the test workers: transformers' GGUF reader takes
    tens of seconds, the saved copy loads in one."""
    import torch
    from filelock import FileLock
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the directory the workers share
    d = root / "default-model-hf"
    with FileLock(str(d) + ".lock"):
        if not (d / "config.json").exists():
            model = AutoModelForCausalLM.from_pretrained(
                os.path.dirname(default_gguf), gguf_file=os.path.basename(default_gguf),
                dtype=torch.float32)
            # its weights are dequantized already; transformers will not save a model it
            # loaded from GGUF, so the weights and config are written as a plain checkpoint
            d.mkdir()
            save_model(model, str(d / "model.safetensors"))
            del model.config.quantization_config
            model.config.save_pretrained(d)
    return str(d)


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory, default_gguf):
    """The default model's tokenizer saved as HF files, for tiny checkpoints to share."""
    d = tmp_path_factory.mktemp("tokenizer")
    get_tokenizer(default_gguf).save_pretrained(d)
    return str(d)


def _tiny_config(arch: str, **over):
    import transformers
    common = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    common.update(over)
    cls = {"LlamaForCausalLM": transformers.LlamaConfig, "MistralForCausalLM": transformers.MistralConfig,
           "Qwen2ForCausalLM": transformers.Qwen2Config, "Qwen3ForCausalLM": transformers.Qwen3Config,
           "Phi3ForCausalLM": transformers.Phi3Config, "MixtralForCausalLM": transformers.MixtralConfig,
           "Qwen3MoeForCausalLM": transformers.Qwen3MoeConfig, "OlmoeForCausalLM": transformers.OlmoeConfig}[arch]
    return cls(**common)


TINY_VARIANTS = {
    # llama3 rope scaling, grouped-query attention
    "llama3": ("LlamaForCausalLM", dict(rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}, rope_theta=500000.0)),
    "mistral": ("MistralForCausalLM", dict(sliding_window=None, head_dim=16)),
    "qwen2": ("Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3ForCausalLM", dict(head_dim=32)),
    # every projection with a bias
    "llama_bias": ("LlamaForCausalLM", dict(attention_bias=True, mlp_bias=True)),
    # q/k/v and gate/up fused in the checkpoint
    "phi3": ("Phi3ForCausalLM", dict()),
    # LongRoPE (within the original context: short factors and the attention factor) over
    # half of head_dim, as Phi-4-mini has it
    "phi3_longrope": ("Phi3ForCausalLM", dict(
        partial_rotary_factor=0.5, original_max_position_embeddings=64, rope_scaling={
            "rope_type": "longrope", "short_factor": [1.0, 1.3, 2.1, 3.7],
            "long_factor": [1.5, 4.0, 9.0, 20.0]})),
}


# mixture-of-experts families: six experts of width 32, two per token
_MOE = dict(num_experts_per_tok=2, intermediate_size=32)
MOE_VARIANTS = {
    "mixtral": ("MixtralForCausalLM", dict(_MOE, num_local_experts=6, sliding_window=None)),
    "qwen3_moe": ("Qwen3MoeForCausalLM", dict(_MOE, num_experts=6, moe_intermediate_size=32,
                                              norm_topk_prob=True, head_dim=32)),
    "olmoe": ("OlmoeForCausalLM", dict(_MOE, num_experts=6, clip_qkv=0.5)),
}


def make_tiny_checkpoint(path, variant: str, tokenizer_dir: str | None = None,
                         max_shard_size: str | None = None, seed: int = 0, **config_over):
    import torch
    import transformers

    arch, over = {**TINY_VARIANTS, **MOE_VARIANTS}[variant]
    config = _tiny_config(arch, **{**over, **config_over})
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(config).to(torch.float32).eval()
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, safe_serialization=True, **kwargs)
    if tokenizer_dir:
        for name in os.listdir(tokenizer_dir):
            with open(os.path.join(tokenizer_dir, name), "rb") as src, \
                    open(os.path.join(path, name), "wb") as dst:
                dst.write(src.read())
    return model


def noisy_copy(src, dst, scale: float, seed: int = 0) -> str:
    """The checkpoint at src with Gaussian noise (scale x each tensor's std) on its decoder
    layers: a draft model that agrees with src only part of the time."""
    import shutil

    import numpy as np
    from safetensors.numpy import save_file

    from jaxllm.loader.safetensors_io import read_safetensors
    rng = np.random.default_rng(seed)
    shutil.copytree(src, dst, dirs_exist_ok=True)
    path = os.path.join(dst, "model.safetensors")
    weights = {k: np.array(v) for k, v in read_safetensors(os.path.join(src, "model.safetensors")).items()}
    for k, v in weights.items():
        if ".layers." in k:
            v += (scale * v.std() * rng.standard_normal(v.shape)).astype(v.dtype)
    save_file(weights, path)
    return str(dst)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory, tokenizer_dir):
    d = tmp_path_factory.mktemp("tiny_llama")
    make_tiny_checkpoint(d, "llama3", tokenizer_dir)
    return str(d)


@pytest.fixture(scope="session")
def peaked_model(tmp_path_factory, tokenizer_dir):
    """A tiny model with peaked logits: loops that batch requests differently (async
    scheduling, speculative decoding) compute a sequence's logits in different step shapes,
    and with a random model's near-even logits that float noise could flip a greedy choice;
    with larger weights the top tokens are far apart and comparisons are exact."""
    d = tmp_path_factory.mktemp("peaked")
    make_tiny_checkpoint(d, "llama3", tokenizer_dir, initializer_range=0.5)
    return str(d)


@pytest.fixture(scope="session")
def tiny_llm(tiny_llama):
    from jaxllm import LLM
    # float32: its tests compare logprobs with HF's (auto on a CPU stores bf16 weights)
    return LLM(tiny_llama, dtype="float32", **SMALL_ENGINE)


@pytest.fixture(scope="session")
def default_llm():
    from jaxllm import LLM
    return LLM(max_num_seqs=16, max_num_batched_tokens=128, max_model_len=512,
               token_buckets=[16, 128], seq_buckets=[4, 16])


def read_json(path):
    with open(path) as f:
        return json.load(f)
