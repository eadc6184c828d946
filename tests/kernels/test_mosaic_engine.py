"""The Mosaic GPU attention kernels through the whole engine, in their interpreter on the CPU
(the kernels on their own: test_mosaic_kernels.py)."""
import numpy as np
import pytest


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_engine_runs_the_mosaic_kernels_in_interpret_mode(peaked_model, kv_cache_dtype):
    """bf16 through the whole engine (chunked prefill, decode, prefix hits): "pallas" picks
    the Mosaic kernels, whose greedy tokens equal XLA's attention's, with a bf16 cache and
    with an int8 one (dequantised in the kernels). The peaked model keeps its top tokens
    apart (a random tiny model's near-ties flip between any two kernels)."""
    from conftest import SMALL_ENGINE
    from jaxllm import LLM, SamplingParams

    # the interpreter copies every input into its simulated memory at each call: a KV cache
    # of 64 blocks rather than the CPU default keeps a step at a fraction of a second
    rng = np.random.default_rng(3)
    shared = rng.integers(10, 40000, size=40).tolist()
    prompts = [shared + rng.integers(10, 40000, size=n).tolist() for n in (3, 90)]
    prompts += [rng.integers(10, 40000, size=n).tolist() for n in (1, 150)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outs = {}
    for backend in ("pallas", "xla"):
        llm = LLM(peaked_model, dtype="bfloat16", attention_backend=backend,
                  kv_cache_dtype=kv_cache_dtype, num_gpu_blocks_override=64, **SMALL_ENGINE)
        outs[llm.llm_engine.config.attention_backend] = [
            o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        del llm
    assert sorted(outs) == ["pallas-mosaic", "xla"]
    assert outs["pallas-mosaic"] == outs["xla"]
