"""Multi-LoRA: PEFT adapters made here with PEFT on tiny random checkpoints of every family.

Logits with an adapter (in any device slot) against HF transformers + PEFT; the strict
refusals of item 3 on the host reader; the scheduler's adapter limit; an engine mixing base
requests and several adapters (more than its slots) against each request alone and against
HF + PEFT's greedy output, with no recompilation.
"""
import os

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import SMALL_ENGINE, TINY_VARIANTS, make_tiny_checkpoint
from jaxllm.lora import LoRARequest
from jaxllm.lora.peft import LoRALayout, load_adapter
from lora_util import hf_greedy, logits_fn, make_adapter

MAX_RANK = 16


def ref_logits(model, ids):
    import torch
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


# per family: two adapters of different ranks and targets (rank_pattern, alpha_pattern,
# rsLoRA, layers_to_transform, fused projections)
ADAPTERS = {
    "llama3": [dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], rank_pattern={"v_proj": 4}),
               dict(r=2, lora_alpha=4, target_modules="all-linear")],
    "mistral": [dict(r=4, lora_alpha=8, use_rslora=True,
                     target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
                dict(r=16, lora_alpha=8, target_modules=["k_proj", "down_proj"])],
    "qwen2": [dict(r=16, lora_alpha=32, target_modules=["k_proj", "o_proj", "up_proj"], alpha_pattern={"up_proj": 4}),
              dict(r=1, lora_alpha=2, target_modules=["v_proj"])],
    "qwen3": [dict(r=2, lora_alpha=2, target_modules=["gate_proj", "down_proj", "q_proj"]),
              dict(r=12, lora_alpha=6, target_modules=["o_proj", "up_proj"])],
    "llama_bias": [dict(r=6, lora_alpha=12, layers_to_transform=[1],
                        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
                   dict(r=3, lora_alpha=3, target_modules=["q_proj", "gate_proj"])],
    "phi3": [dict(r=8, lora_alpha=16, target_modules=["qkv_proj", "gate_up_proj", "o_proj", "down_proj"]),
             dict(r=5, lora_alpha=10, target_modules=["gate_up_proj"], use_rslora=True)],
    "phi3_longrope": [dict(r=3, lora_alpha=6, target_modules=["qkv_proj", "down_proj"]),
                      dict(r=16, lora_alpha=16, target_modules=["o_proj"])],
}


@pytest.mark.parametrize("variant", sorted(TINY_VARIANTS))
def test_logits_match_hf_peft(tmp_path, variant):
    """Every family, two adapters of different ranks and targets in slots 2 and 1 of 3 (rank
    zero-padded to max_lora_rank), and base tokens (no slot): logits within 1e-4 of HF + PEFT."""
    from jaxllm.loader import load_model
    from jaxllm.lora.registry import LoRARegistry
    from jaxllm.lora.slots import LoRASlots
    from jaxllm.models import get_model_class
    from jaxllm.parallel import make_mesh

    base_dir = str(tmp_path / "base")
    hf = make_tiny_checkpoint(base_dir, variant)
    refs = [make_adapter(tmp_path / f"a{i}", base_dir, seed=i, **kw)
            for i, kw in enumerate(ADAPTERS[variant])]
    loaded = load_model(base_dir, jnp.float32, load_tokenizer=False)
    layout = LoRALayout(get_model_class(loaded.arch.architecture), loaded.arch, 1, MAX_RANK)
    registry = LoRARegistry(layout, 4, [base_dir])
    slots = LoRASlots(layout, 3, jnp.float32, make_mesh(1), registry.adapter)
    keys = [registry.add(LoRARequest(f"a{i}", i + 1, str(tmp_path / f"a{i}"))) for i in range(2)]
    filler = registry.add(LoRARequest("filler", 9, str(tmp_path / "a1")))  # takes slot 0
    slots.activate([filler])
    ids = np.random.default_rng(0).integers(0, hf.config.vocab_size, size=29).tolist()
    scale = np.abs(ref_logits(hf, ids)).max()
    logits = logits_fn(loaded, 3, ids)
    for key, ref_model in zip(reversed(keys), reversed(refs)):
        token_slot, failed = slots.activate([key])
        assert not failed
        ours = logits(slots.weights, token_slot[key])
        ref = ref_logits(ref_model, ids)
        rel = np.abs(ours - ref).max() / scale
        assert rel < 1e-4, f"{variant} adapter {key}: max relative error {rel:.2e}"
        with ref_model.disable_adapter():
            assert np.abs(ref - ref_logits(ref_model, ids)).max() > 1e-2 * scale  # it does something
    assert sorted(slots.resident.values()) == [0, 1, 2]
    base = logits(slots.weights, 0)
    np.testing.assert_allclose(base, ref_logits(hf, ids), rtol=0, atol=1e-4 * scale)
    if variant == "llama3":  # the layers unrolled, as on a GPU: the slots indexed per layer
        unrolled = logits_fn(loaded, 3, ids, scan_layers=False)
        np.testing.assert_allclose(unrolled(slots.weights, token_slot[key]), ours, rtol=0,
                                   atol=1e-5 * scale)


ENGINE_ADAPTERS = [
    dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    dict(r=8, lora_alpha=8, target_modules=["o_proj", "down_proj", "k_proj"]),
    dict(r=16, lora_alpha=32, target_modules="all-linear", use_rslora=True),
    dict(r=2, lora_alpha=4, target_modules=["gate_proj", "up_proj"]),
    dict(r=12, lora_alpha=6, target_modules=["q_proj", "up_proj", "down_proj"]),
]


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory):
    """Five adapters over the tiny Llama: (LoRARequest, PEFT reference model)."""
    d = tmp_path_factory.mktemp("adapters")
    out = []
    for i, kw in enumerate(ENGINE_ADAPTERS):
        model = make_adapter(d / f"ad{i}", tiny_llama, seed=10 + i, **kw)
        out.append((LoRARequest(f"ad{i}", i + 1, str(d / f"ad{i}")), model))
    return out


@pytest.fixture(scope="module")
def lora_llm(tiny_llama):
    from jaxllm import LLM
    # float32: its tests compare a request's logprobs in a mixed batch with the same request
    # alone; under the CPU bf16 policy the two step shapes take kernels that sum in another
    # order (on AMX from 4 rows), and a bf16-rounded activation one step apart moves a logprob
    # by ~5e-4
    return LLM(tiny_llama, enable_lora=True, max_loras=3, max_lora_rank=MAX_RANK,
               max_cpu_loras=4, dtype="float32", **SMALL_ENGINE)


def record_step_adapters(engine):
    """Distinct adapters of every dispatched step."""
    seen = []
    dispatch = engine.runner.dispatch

    def spy(out, *args):
        seen.append({r.lora_id for r in out.scheduled_reqs.values() if r.lora_id})
        return dispatch(out, *args)
    engine.runner.dispatch = spy
    return seen, lambda: setattr(engine.runner, "dispatch", dispatch)


def test_mixed_batches_equal_each_alone_and_hf(lora_llm, adapters):
    """Base requests and three adapters in the same steps, then five adapters over three
    slots and a host cache of four (LRU churn, adapters read again from disk): every request's
    greedy tokens and logprobs equal the same request run alone, and HF + PEFT's greedy
    tokens; never more than max_loras adapters in a step; no compilation after warm-up."""
    from jaxllm import SamplingParams

    engine = lora_llm.llm_engine
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 49152, size=int(rng.integers(5, 40))).tolist() for _ in range(10)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)
    # base, ad0..ad2, base, ad0..ad2, then ad3 and ad4
    which = [None, 0, 1, 2, None, 0, 1, 2, 3, 4]
    loras = [None if w is None else adapters[w][0] for w in which]
    seen, restore = record_step_adapters(engine)
    try:
        mixed = lora_llm.generate([{"prompt_token_ids": p} for p in prompts[:8]], params,
                                  use_tqdm=False, lora_request=loras[:8])
        assert max(len(s) for s in seen) == 3
        churn = lora_llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                  use_tqdm=False, lora_request=loras)
        assert max(len(s) for s in seen) <= 3
    finally:
        restore()
    alone = [lora_llm.generate({"prompt_token_ids": p}, params, use_tqdm=False, lora_request=lr)[0]
             for p, lr in zip(prompts, loras)]
    for i, (p, w) in enumerate(zip(prompts, which)):
        ref = alone[i].outputs[0]
        for got in ([mixed[i]] if i < 8 else []) + [churn[i]]:
            assert got.outputs[0].token_ids == ref.token_ids, i
            np.testing.assert_allclose([lp[t].logprob for lp, t in zip(got.outputs[0].logprobs, ref.token_ids)],
                                       [lp[t].logprob for lp, t in zip(ref.logprobs, ref.token_ids)], atol=1e-4)
        if w is not None:
            assert ref.token_ids == hf_greedy(adapters[w][1], p, 8), f"request {i} (adapter {w})"
            base = lora_llm.generate({"prompt_token_ids": p}, params, use_tqdm=False)[0].outputs[0]
            assert base.token_ids != ref.token_ids, f"adapter {w} changed nothing"
    assert engine.runner.lora.num_loads > len(adapters)      # slots were reused
    assert engine.lora.registry.num_disk_loads > len(adapters)        # the host cache let some go
    assert engine.runner.num_compiles_after_warmup == 0


def test_multi_step_calls_apply_each_requests_adapter(lora_llm, adapters, tiny_llama):
    """Multi-step scheduling with adapters: base and three adapters decoding together in
    calls of 4 passes give the tokens and logprobs of the single-step engine."""
    from jaxllm import LLM, SamplingParams
    multi = LLM(tiny_llama, enable_lora=True, max_loras=3, max_lora_rank=MAX_RANK,
                max_cpu_loras=4, dtype="float32", num_scheduler_steps=4, **SMALL_ENGINE)
    rng = np.random.default_rng(4)
    prompts = [{"prompt_token_ids": rng.integers(3, 49152, size=int(rng.integers(5, 30))).tolist()}
               for _ in range(4)]
    loras = [None] + [a[0] for a in adapters[:3]]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=1)
    calls = []
    dispatch = multi.llm_engine.runner.dispatch
    multi.llm_engine.runner.dispatch = lambda out, *a: (calls.append(out.num_passes), dispatch(out, *a))[1]
    got = multi.generate(prompts, params, use_tqdm=False, lora_request=loras)
    ref = lora_llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    assert calls.count(4) >= 2
    for g, r in zip(got, ref):
        assert g.outputs[0].token_ids == r.outputs[0].token_ids
        np.testing.assert_allclose([lp[t].logprob for lp, t in zip(g.outputs[0].logprobs, r.outputs[0].token_ids)],
                                   [lp[t].logprob for lp, t in zip(r.outputs[0].logprobs, r.outputs[0].token_ids)],
                                   atol=1e-4)
    assert len({tuple(r.outputs[0].token_ids) for r in ref}) == 4  # the adapters differ
    assert multi.llm_engine.runner.num_compiles_after_warmup == 0


# strict validation (item 3): the host reader, no engine


@pytest.fixture(scope="module")
def tiny_layout(tiny_llama):
    from jaxllm.lora.peft import base_model_names
    from jaxllm.models import get_model_class
    from jaxllm.models.registry import arch_from_hf
    import json
    with open(os.path.join(tiny_llama, "config.json")) as f:
        arch = arch_from_hf(json.load(f))
    return LoRALayout(get_model_class(arch.architecture), arch, 1, MAX_RANK), base_model_names(tiny_llama, tiny_llama)


@pytest.fixture(scope="module")
def good_adapter(tiny_llama, tmp_path_factory):
    d = tmp_path_factory.mktemp("good") / "ad"
    make_adapter(d, tiny_llama, seed=3, r=8, lora_alpha=8, target_modules=["q_proj", "down_proj"])
    return d


def edited_copy(src, dst, config=None, tensors=None):
    """A copy of an adapter with its config updated and its tensors passed through `tensors`."""
    import json
    import shutil
    from safetensors.numpy import load_file, save_file
    shutil.copytree(src, dst)
    if config:
        cfg = json.loads((dst / "adapter_config.json").read_text())
        cfg.update(config)
        (dst / "adapter_config.json").write_text(json.dumps(cfg))
    if tensors:
        path = dst / "adapter_model.safetensors"
        save_file(tensors(dict(load_file(path))), path)
    return LoRARequest("edited", 7, str(dst))


def test_rank_above_max_lora_rank_is_refused(tiny_llama, tiny_layout, tmp_path):
    layout, names = tiny_layout
    make_adapter(tmp_path / "big", tiny_llama, r=32, lora_alpha=32, target_modules=["v_proj"])
    req = LoRARequest("big-one", 3, str(tmp_path / "big"))
    with pytest.raises(ValueError, match=r"'big-one'.*v_proj has rank 32, above max_lora_rank=16"):
        load_adapter(req, layout, names)
    # one module of a larger rank than the others (rank_pattern) is found as well
    make_adapter(tmp_path / "mixed", tiny_llama, r=8, lora_alpha=8, target_modules=["q_proj", "o_proj"],
                 rank_pattern={"o_proj": 24})
    with pytest.raises(ValueError, match=r"'mixed'.*o_proj has rank 24, above max_lora_rank=16"):
        load_adapter(LoRARequest("mixed", 4, str(tmp_path / "mixed")), layout, names)


def test_missing_module_wrong_shape_other_base_are_refused(good_adapter, tiny_layout, tmp_path):
    layout, names = tiny_layout
    assert load_adapter(LoRARequest("good", 1, str(good_adapter)), layout, names).modules == ("down_proj", "q_proj")

    def rename(t):  # a module this model does not have
        return {k.replace("mlp.down_proj", "mlp.fc1"): v for k, v in t.items()}
    req = edited_copy(good_adapter, tmp_path / "fc1", tensors=rename)
    with pytest.raises(ValueError, match=r"'edited'.*targets module 'model.layers.0.mlp.fc1'.*"
                                         r"LlamaForCausalLM does not have.*q_proj"):
        load_adapter(req, layout, names)
    req = edited_copy(good_adapter, tmp_path / "lm_head", config={"target_modules": ["q_proj", "lm_head"]})
    with pytest.raises(ValueError, match=r"'edited'.*target module 'lm_head' is not a projection"):
        load_adapter(req, layout, names)

    def widen(t):  # lora_B one row too many for the 64-wide q_proj
        k = "base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight"
        return {**t, k: np.zeros((65, 8), np.float32)}
    req = edited_copy(good_adapter, tmp_path / "shape", tensors=widen)
    with pytest.raises(ValueError, match=r"'edited'.*layers.1.self_attn.q_proj has lora_A \(8, 64\) "
                                         r"and lora_B \(65, 8\); .*needs lora_A \(r, 64\) and lora_B \(64, r\)"):
        load_adapter(req, layout, names)
    req = edited_copy(good_adapter, tmp_path / "other", config={"base_model_name_or_path": "someorg/Other-7B"})
    with pytest.raises(ValueError, match=r"'edited'.*base model is 'someorg/Other-7B'.*serves '/"):
        load_adapter(req, layout, names)
    req = edited_copy(good_adapter, tmp_path / "dora", config={"use_dora": True})
    with pytest.raises(ValueError, match=r"'edited'.*use_dora=True is not supported"):
        load_adapter(req, layout, names)
    with pytest.raises(ValueError, match=r"'nowhere'.*no adapter_config.json"):
        load_adapter(LoRARequest("nowhere", 1, str(tmp_path / "nope")), layout, names)


def test_base_model_names_match_hub_ids_and_paths():
    from jaxllm.lora.peft import same_model
    assert same_model("HuggingFaceTB/SmolLM2-135M-Instruct", ["/x/y.gguf", "SmolLM2-135M-Instruct"])
    assert same_model("/models/llama/", ["/models/llama"])
    assert not same_model("meta-llama/Llama-3-8B", ["/models/llama-3-8b-instruct"])


def test_engine_refuses_bad_adapters_and_keeps_serving(lora_llm, adapters, tiny_llama, tmp_path):
    """A refused adapter stops generate() before anything runs; ids and names stay unique;
    the engine serves on, nothing left behind. An engine without LoRA refuses lora_request."""
    from jaxllm import SamplingParams
    engine = lora_llm.llm_engine
    make_adapter(tmp_path / "big", tiny_llama, r=32, lora_alpha=32, target_modules=["v_proj"])
    params = SamplingParams(max_tokens=3)
    with pytest.raises(ValueError, match="'big'.*rank 32, above max_lora_rank=16"):
        lora_llm.generate(["a", "b"], params, use_tqdm=False,
                          lora_request=[None, LoRARequest("big", 40, str(tmp_path / "big"))])
    ad0 = adapters[0][0]
    assert engine.add_lora(ad0) and ad0.lora_int_id in engine.list_loras()
    with pytest.raises(ValueError, match="lora_int_id 1 is registered for adapter 'ad0'"):
        lora_llm.generate("a", params, use_tqdm=False,
                          lora_request=LoRARequest("other", ad0.lora_int_id, ad0.lora_path))
    with pytest.raises(ValueError, match="lora_name 'ad0' is registered with lora_int_id 1"):
        lora_llm.generate("a", params, use_tqdm=False, lora_request=LoRARequest("ad0", 41, ad0.lora_path))
    assert 40 not in engine.list_loras() and not engine.has_unfinished_requests()
    out = lora_llm.generate("a", params, use_tqdm=False, lora_request=ad0)
    assert len(out[0].outputs[0].token_ids) == 3


def test_prefix_cache_is_keyed_by_adapter(lora_llm, adapters):
    """The same prompt with another adapter (or none) never hits blocks computed with a
    different one; with the same adapter it does, and gives the same tokens."""
    from jaxllm import SamplingParams
    prompt = {"prompt_token_ids": list(range(100, 160))}
    params = SamplingParams(temperature=0.0, max_tokens=4)

    def run(lr):
        return lora_llm.generate(prompt, params, use_tqdm=False, lora_request=lr)[0]
    first = run(adapters[1][0])
    assert first.num_cached_tokens == 0
    assert run(adapters[2][0]).num_cached_tokens == 0
    assert run(None).num_cached_tokens == 0
    again = run(adapters[1][0])
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == first.outputs[0].token_ids


@pytest.mark.parametrize("variant", ["llama3", "phi3"])
def test_tensor_parallel_adapters_sharded_and_exact(tmp_path, variant):
    """On 4 fake devices (KV heads repeated, the MLP padded, fused columns device-major) the
    adapter is sharded along the base weights' axes and the logits still match HF + PEFT."""
    import json
    import subprocess
    import sys
    base_dir = str(tmp_path / "base")
    make_tiny_checkpoint(base_dir, variant, intermediate_size=126)
    ref_model = make_adapter(tmp_path / "ad", base_dir, seed=5, r=8, lora_alpha=16,
                             target_modules="all-linear")
    ids = np.random.default_rng(2).integers(0, 49152, size=21)
    np.savez(tmp_path / "ref.npz", ids=ids, logits=ref_logits(ref_model, ids.tolist()))
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, os.path.join(tests, "lora_tp_worker.py"),
                           base_dir, str(tmp_path / "ad"), str(tmp_path / "ref.npz")],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))[7:])
    assert res["rel"] < 1e-4, res
    assert res["qkv_B"] == [[None, None, "tp"]] * 3 and res["qkv_A"] == [None, None, None]
    assert res["down_A"] == [None, "tp", None]
    assert res["down_A_shape"][1] == 128 and res["down_A_shard"][1] == 32  # 126 padded to 128


def test_adapter_gone_from_disk_aborts_only_its_requests(lora_llm, adapters, tmp_path):
    """An adapter the host cache let go whose files have since disappeared: its requests end
    aborted, the others in the same steps finish; it is unregistered, and naming it again is
    refused with the reason."""
    import shutil
    from jaxllm import SamplingParams
    engine = lora_llm.llm_engine
    shutil.copytree(adapters[0][0].lora_path, tmp_path / "doomed")
    doomed = LoRARequest("doomed", 50, str(tmp_path / "doomed"))
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    lora_llm.generate("x", params, use_tqdm=False, lora_request=doomed)
    # four adapters new to the engine pass through: the host cache (4) and the slots (3) let it go
    for i, (lr, _) in enumerate(adapters[1:]):
        lora_llm.generate("y", params, use_tqdm=False,
                          lora_request=LoRARequest(f"fresh{i}", 60 + i, lr.lora_path))
    assert engine.lora.key_of(doomed) not in engine.lora.registry.cached_keys
    shutil.rmtree(tmp_path / "doomed")
    outs = lora_llm.generate(["base", "doomed", "other"], params, use_tqdm=False,
                             lora_request=[None, doomed, adapters[1][0]])
    assert [o.outputs[0].finish_reason for o in outs] == ["length", "abort", "length"]
    assert doomed.lora_int_id not in engine.list_loras() and not engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="'doomed'.*no adapter_config.json"):
        lora_llm.generate("x", params, use_tqdm=False, lora_request=doomed)


def test_engine_without_lora_refuses_lora_request(tiny_llm, good_adapter):
    with pytest.raises(ValueError, match="enable_lora=True"):
        tiny_llm.generate("x", use_tqdm=False, lora_request=LoRARequest("a", 1, str(good_adapter)))
    assert not tiny_llm.llm_engine.has_unfinished_requests()
