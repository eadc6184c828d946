"""Orbax checkpoints: `jaxllm convert` then restore gives the same model (weights, architecture,
logits, tokenizer, generations) from HF and GGUF sources of each family; restoring onto 2 and
4 fake devices gives each device only its shard; corrupt or mismatched checkpoints are refused
with errors that say how to convert again."""
import glob
import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import SMALL_ENGINE, make_tiny_checkpoint
from jaxllm.cli import main
from jaxllm.loader import load_model
from jaxllm.loader.convert import convert
from jaxllm.loader import orbax as jo
from model_util import all_logits, assert_same_tokenizer

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/


def assert_same_model(ref, got):
    assert got.arch == ref.arch
    names, ref_leaves, ref_tree = jo.flatten(ref.state)
    got_names, got_leaves, got_tree = jo.flatten(got.state)
    assert got_names == names and got_tree == ref_tree
    for name, r, g in zip(names, ref_leaves, got_leaves):
        assert g.dtype == r.dtype and g.shape == r.shape and g.sharding == r.sharding, name
        assert np.array_equal(np.asarray(g), np.asarray(r)), name


@pytest.fixture(scope="module")
def tiny_ckpt(tiny_llama, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("ckpt") / "tiny")
    assert main(["convert", tiny_llama, out, "--dtype", "float32"]) == 0
    return out


@pytest.mark.parametrize("source", ["hf-phi3", "gguf-llama_bias"])
def test_round_trip_each_family_and_source(source, tmp_path, tokenizer_dir):
    kind, variant = source.split("-")
    hf = make_tiny_checkpoint(tmp_path / "hf", variant, tokenizer_dir)
    src, tok = str(tmp_path / "hf"), None
    if kind == "gguf":
        from gguf_util import write_gguf
        # the tokenizer comes from --tokenizer: parsing a 49k-token vocabulary out of GGUF
        # metadata takes seconds each time the file is opened
        src, tok = str(tmp_path / "tiny.gguf"), tokenizer_dir
        write_gguf(hf, src)
    out = convert(src, str(tmp_path / "ckpt"), dtype="float32", tokenizer=tok)
    ref = load_model(src, jnp.float32, tokenizer=tok)
    got = load_model(out, jnp.float32)
    assert_same_model(ref, got)
    ids = np.random.default_rng(0).integers(0, hf.config.vocab_size, size=19).tolist()
    np.testing.assert_array_equal(all_logits(got, ids), all_logits(ref, ids))
    assert_same_tokenizer(got.tokenizer, ref.tokenizer)
    assert got.eos_token_id == ref.eos_token_id
    meta = jo.read_metadata(out)
    assert meta["source"] == os.path.abspath(src) and meta["tensor_parallel_size"] == 1
    assert meta["dtype"] == "float32" and meta["quantization"] is None
    assert meta["architecture"]["architecture"] == hf.config.architectures[0]


def test_engine_runs_a_converted_checkpoint_as_its_source(tiny_llm, tiny_ckpt):
    """LLM(model=checkpoint): the same greedy tokens and logprobs as from safetensors, the
    tokenizer and chat template from the checkpoint directory, no compilation after warm-up."""
    from jaxllm import LLM, SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
    prompts = ["The capital of France is", [5, 77, 900, 12]]
    msgs = [{"role": "user", "content": "hi"}]
    outs = []
    for llm in (tiny_llm, LLM(tiny_ckpt, dtype="float32", **SMALL_ENGINE)):
        res = llm.generate(prompts, params, use_tqdm=False)
        chat = llm.chat(msgs, SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False)
        outs.append(([o.outputs[0].token_ids for o in res],
                     [[lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
                      for o in res], chat[0].prompt_token_ids, chat[0].outputs[0].token_ids))
    ref, got = outs
    assert got[0] == ref[0] and got[2] == ref[2] and got[3] == ref[3]
    np.testing.assert_array_equal(np.concatenate(got[1]), np.concatenate(ref[1]))
    engine = llm.llm_engine
    assert engine.runner.num_compiles_after_warmup == 0
    assert engine.load_seconds > 0 and engine.compile_seconds > 0


def test_dtype_cast_on_restore_and_dummy(tiny_llama, tmp_path):
    """A bf16 checkpoint restored under a float32 policy is cast on the way in; integer data
    never is; load_format="dummy" makes random weights of the checkpoint's shapes."""
    out = str(tmp_path / "bf16")
    assert main(["convert", tiny_llama, out, "--dtype", "bfloat16"]) == 0
    meta = jo.read_metadata(out)
    assert meta["dtype"] == "bfloat16" and meta["params"]["layers.wqkv"]["dtype"] == "bfloat16"
    ref = load_model(tiny_llama, jnp.bfloat16, load_tokenizer=False)
    got = load_model(out, jnp.float32, load_tokenizer=False)
    for name, r, g in zip(*jo.flatten(ref.state)[:2], jo.flatten(got.state)[1]):
        assert g.dtype == jnp.float32, name
        np.testing.assert_array_equal(np.asarray(g), np.asarray(r).astype(np.float32))
    dummy = load_model(out, jnp.float32, load_format="dummy", load_tokenizer=False)
    assert dummy.arch == got.arch
    assert [x.shape for x in jax.tree.leaves(dummy.state)] == [x.shape for x in jax.tree.leaves(got.state)]
    assert not np.array_equal(np.asarray(dummy.state["layers"]["wo"][...]),
                              np.asarray(got.state["layers"]["wo"][...]))
    stored = {"format": jo.FORMAT, "params": {"q": {"shape": [2], "dtype": "int8"}}}
    with pytest.raises(ValueError, match="q is stored as int8 but the model expects float32"):
        jo._check_params(stored, "ckpt", ["q"], [jax.ShapeDtypeStruct((2,), jnp.float32)])


@pytest.mark.parametrize("tied", [False, True])
def test_cpu_panels_are_packed_at_load_and_saved_unpacked(tmp_path, tokenizer_dir, tied):
    """On a CPU with the kernels the bf16 policy keeps panel-sized layer stacks and the head (the
    LM head, or the embedding table where it is tied; an untied table, read only by row, stays)
    as packed panels, and computes what the per-call packing does; a checkpoint converted from
    it holds the plain bf16 arrays, and restoring it packs them again: the same logits."""
    import dataclasses

    from jaxllm.layers.dtype_policy import CPU_BF16_POLICY
    from jaxllm.kernels.cpu import panels as cpu_panels
    from model_util import PANEL_SHAPES
    src, out = str(tmp_path / "src"), str(tmp_path / "ckpt")
    make_tiny_checkpoint(src, "llama3", tokenizer_dir, tie_word_embeddings=tied, **PANEL_SHAPES)
    plain = load_model(src, jnp.bfloat16, load_tokenizer=False)   # XLA's bf16: no kernel
    packed = load_model(src, CPU_BF16_POLICY, load_tokenizer=False)
    w = packed.state["layers"]["w_gate_up"][...]
    assert w.dtype == jnp.uint32 and w.shape == (2, 192 // cpu_panels.PANEL, 96 // 2, cpu_panels.PANEL)
    np.testing.assert_array_equal(np.asarray(cpu_panels.from_panels(w)),
                                  np.asarray(plain.state["layers"]["w_gate_up"][...]))
    name = "embed_tokens" if tied else "lm_head"
    head = packed.state[name][...]
    assert head.dtype == jnp.uint32 and head.shape == (1, 49152 // cpu_panels.PANEL, 96 // 2, cpu_panels.PANEL)
    np.testing.assert_array_equal(np.asarray(cpu_panels.from_head_panels(head, tied)),
                                  np.asarray(plain.state[name][...]))
    if not tied:
        assert packed.state["embed_tokens"][...].dtype == jnp.bfloat16
    ids = list(range(3, 20)) + [49151, 48, 47]
    unpacked = dataclasses.replace(packed, state=cpu_panels.pack_state(packed.state, pack=False))
    assert unpacked.state[name][...].dtype == jnp.bfloat16
    np.testing.assert_array_equal(all_logits(unpacked, ids), all_logits(packed, ids))
    assert main(["convert", src, out, "--dtype", "bfloat16"]) == 0
    params = jo.read_metadata(out)["params"]
    assert params["layers.wqkv"] == {"shape": [2, 96, 192], "dtype": "bfloat16"}
    assert params[name] == {"shape": [49152, 96] if tied else [96, 49152], "dtype": "bfloat16"}
    restored = load_model(out, jnp.bfloat16, load_tokenizer=False)
    for name, r, g in zip(*jo.flatten(plain.state)[:2], jo.flatten(restored.state)[1]):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(r), err_msg=name)
    again = load_model(out, CPU_BF16_POLICY, load_tokenizer=False)
    np.testing.assert_array_equal(all_logits(again, ids), all_logits(packed, ids))


def test_a_quantized_head_leaves_the_embedding_table_unpacked():
    """A model whose LM head is quantized (its parts lm_head.q, lm_head.scale) and whose
    embedding table is bf16 is untied: the table, read only by row, is not packed as a head;
    without an LM head the same table is the head and is packed."""
    from jaxllm.kernels.cpu import build, panels as cpu_panels
    if not build.available():
        pytest.skip("no C++ compiler for the CPU kernels")
    table = jnp.asarray(np.random.default_rng(0).normal(size=(96, 64)), jnp.bfloat16)
    head = {"q": jnp.zeros((64, 96), jnp.int8), "scale": jnp.ones((96,), jnp.float32)}
    untied = cpu_panels.pack_state({"embed_tokens": table, "lm_head": head}, pack=True)
    assert untied["embed_tokens"] is table
    assert untied["lm_head"]["q"] is head["q"]
    tied = cpu_panels.pack_state({"embed_tokens": table}, pack=True)
    assert tied["embed_tokens"].dtype == jnp.uint32


def test_cpu_w8a8_codes_are_packed_at_load_and_saved_unpacked(tmp_path, tokenizer_dir):
    """w8a8 in the CPU kernels keeps panel-sized layer stacks' int8 codes as packed panels
    followed by their columns' sums; the packed model computes exactly what its unpacked codes
    do through the per-call packing (the same integer sums); a checkpoint converted from it
    holds the plain int8 codes, and restoring packs them again."""
    import dataclasses
    from jaxllm.kernels.cpu import panels as cpu_panels
    from model_util import PANEL_SHAPES
    src, out = str(tmp_path / "src"), str(tmp_path / "ckpt")
    make_tiny_checkpoint(src, "llama3", tokenizer_dir, **PANEL_SHAPES)
    packed = load_model(src, jnp.float32, load_tokenizer=False, quantization="w8a8")
    assert packed.quant.backend == "cpu"
    q = packed.state["layers"]["w_gate_up"]["q"][...]
    assert q.dtype == jnp.int32 and q.shape == (2, 192 // cpu_panels.PANEL, 96 // 4 + 1, cpu_panels.PANEL)
    plain = cpu_panels.pack_state(packed.state, pack=False)
    codes = np.asarray(plain["layers"]["w_gate_up"]["q"][...])
    assert codes.dtype == np.int8 and codes.shape == (2, 192, 96)
    np.testing.assert_array_equal(np.asarray(q[:, :, -1]),
                                  codes.astype(np.int32).sum(-1).reshape(2, 192 // cpu_panels.PANEL, cpu_panels.PANEL))
    ids = list(range(3, 20))
    np.testing.assert_array_equal(all_logits(dataclasses.replace(packed, state=plain), ids),
                                  all_logits(packed, ids))
    assert main(["convert", src, out, "--dtype", "float32", "-q", "w8a8"]) == 0
    assert jo.read_metadata(out)["params"]["layers.w_gate_up.q"] == {"shape": [2, 192, 96], "dtype": "int8"}
    again = load_model(out, jnp.float32, load_tokenizer=False, quantization="w8a8")
    assert again.state["layers"]["w_gate_up"]["q"][...].dtype == jnp.int32
    np.testing.assert_array_equal(all_logits(again, ids), all_logits(packed, ids))


def test_restore_onto_2_and_4_devices_reads_only_each_shard(tmp_path, tokenizer_dir):
    """Checkpoints converted for 2 devices (in Python) and 4 (by the CLI, which makes its own
    CPU devices) restore with each device holding only its shard, equal to the safetensors
    path's; the vocabulary and MLP are padded for 4; 2's checkpoint is refused on 4."""
    src = tmp_path / "hf"
    make_tiny_checkpoint(src, "llama3", tokenizer_dir, vocab_size=49154, intermediate_size=102)
    tp4 = str(tmp_path / "tp4")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    cli = subprocess.run([sys.executable, "-m", "jaxllm.cli", "convert", str(src), tp4, "-tp", "4"],
                         capture_output=True, text=True, timeout=600, env=env,
                         cwd=os.path.dirname(HERE))
    assert cli.returncode == 0, cli.stderr[-3000:]
    proc = subprocess.run([sys.executable, os.path.join(HERE, "orbax_tp_worker.py"), str(src),
                           str(tmp_path), tp4], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))
    res = json.loads(line[len("RESULT "):])
    for tp in ("2", "4"):
        assert res[tp]["arch_equal"]
        params = res[tp]["params"]
        for name, p in params.items():
            assert p["equal"] and p["same_sharding"], (tp, name)
            assert p["devices"] == list(range(int(tp))), (tp, name)
            assert p["shard_shapes"] == p["ref_shard_shapes"], (tp, name)
            # a sharded axis holds 1/tp of the array on each device, nothing else does
            want = [n // int(tp) if ax == "tp" else n for n, ax in zip(p["shape"], p["spec"] + [None] * 3)]
            assert p["shard_shapes"] == [want] * int(tp), (tp, name)
        assert params["embed_tokens"]["spec"][0] == "tp" and params["layers.wqkv"]["spec"][-1] == "tp"
    assert res["4"]["params"]["embed_tokens"]["shape"][0] == 49156  # 49154 padded to 4 devices
    assert res["4"]["params"]["layers.w_down"]["shape"][1] == 104
    assert "tensor_parallel_size=2" in res["mismatch"]
    assert "--tensor-parallel-size 4" in res["mismatch"]
    assert f"jaxllm convert {src}" in res["mismatch"]


def _copy(src, dst, edit=None):
    shutil.copytree(src, dst)
    if edit is not None:
        path = os.path.join(dst, jo.METADATA_FILE)
        with open(path) as f:
            meta = json.load(f)
        edit(meta)
        with open(path, "w") as f:
            json.dump(meta, f)
    return str(dst)


def _largest_data_file(ckpt):
    files = [f for f in glob.glob(os.path.join(ckpt, jo.PARAMS_DIR, "**", "*"), recursive=True)
             if os.path.isfile(f)]
    return max(files, key=os.path.getsize)


@pytest.mark.parametrize("case, match", [
    ("truncated", r"cannot restore .* OUT_OF_RANGE.*convert it again: jaxllm convert"),
    ("no_params", r"cannot restore .* not found.*convert it again"),
    ("no_metadata", r"has no config.json and no single .gguf"),
    ("garbage_metadata", r"cannot read the checkpoint metadata"),
    ("not_ours", r"is not jaxllm checkpoint metadata"),
    ("old_layout", r"parameter layout 0; jaxllm .* reads layout 1. Convert it again: jaxllm convert"),
    ("other_tp", r"converted for tensor_parallel_size=2 .* engine runs tensor_parallel_size=1.*"
                 r"--tensor-parallel-size 1"),
    ("arch_mismatch", r"parameter embed_tokens has shape \(49152, 64\) but the model expects "
                      r"\(49152, 32\); convert it again"),
    ("missing_param", r"missing: lm_head"),
    ("quantized", r"names quantization 'int8' but not how its matrices are stored.*convert it again"),
])
def test_corrupt_or_mismatched_checkpoint_is_refused(case, match, tiny_ckpt, tmp_path):
    dst = tmp_path / "bad"
    if case == "truncated":
        bad = _copy(tiny_ckpt, dst)
        f = _largest_data_file(bad)
        with open(f, "r+b") as fh:
            fh.truncate(os.path.getsize(f) // 2)
    elif case == "no_params":
        bad = _copy(tiny_ckpt, dst)
        shutil.rmtree(os.path.join(bad, jo.PARAMS_DIR))
    elif case == "no_metadata":  # an interrupted convert writes the metadata last
        bad = _copy(tiny_ckpt, dst)
        os.remove(os.path.join(bad, jo.METADATA_FILE))
    elif case == "garbage_metadata":
        bad = _copy(tiny_ckpt, dst)
        with open(os.path.join(bad, jo.METADATA_FILE), "w") as f:
            f.write("{not json")
    else:
        edits = {
            "not_ours": lambda m: m.pop("format"),
            "old_layout": lambda m: m.update(layout_version=0),
            "other_tp": lambda m: m.update(tensor_parallel_size=2),
            "arch_mismatch": lambda m: m["architecture"].update(hidden_size=32),
            "missing_param": lambda m: m["params"].pop("lm_head"),
            "quantized": lambda m: m.update(quantization="int8"),
        }
        bad = _copy(tiny_ckpt, dst, edits[case])
    with pytest.raises(ValueError, match=match):
        load_model(bad, jnp.float32, load_tokenizer=False)


def test_quantization_asked_of_a_checkpoint_must_match_it():
    meta = {"layout_version": jo.LAYOUT_VERSION, "tensor_parallel_size": 1, "quantization": None,
            "source": "/m", "dtype": "float32"}
    jo.check_compatible(meta, "/c", 1)  # unset: the checkpoint's own
    with pytest.raises(ValueError, match=r"holds unquantized weights but quantization='int8'.*"
                                         r"jaxllm convert /m /c --dtype float32 --quantization int8"):
        jo.check_compatible(meta, "/c", 1, quantization="int8")


@pytest.mark.parametrize("source", ["int4", "gguf-q4_0"])
def test_quantized_round_trip(source, tiny_llama, tokenizer_dir, tmp_path):
    """Quantized weights are written as their codes and scales (online int4, or a GGUF's
    Q4_0 as shipped) and restored as the same quantized model; asking the restore for
    other weights is refused with the convert command."""
    from conftest import make_tiny_checkpoint
    src, quant, tok = tiny_llama, "int4", None
    if source.startswith("gguf"):
        import gguf
        from gguf_util import write_gguf
        hf = make_tiny_checkpoint(tmp_path / "hf", "llama3", tokenizer_dir)
        src, quant, tok = str(tmp_path / "q.gguf"), None, tokenizer_dir
        write_gguf(hf, src, qtype=gguf.GGMLQuantizationType.Q4_0)
    out = convert(src, str(tmp_path / "ckpt"), dtype="float32", quantization=quant, tokenizer=tok)
    meta = jo.read_metadata(out)
    ref = load_model(src, jnp.float32, tokenizer=tok, quantization=quant)
    assert meta["quantization"] == ref.quant.method == ("int4" if quant else "gguf")
    got = load_model(out, jnp.float32)
    assert got.quant == ref.quant
    assert_same_model(ref, got)
    assert any(np.dtype(d["dtype"]).kind in "iu" for d in meta["params"].values())
    ids = np.random.default_rng(1).integers(0, ref.arch.vocab_size, size=11).tolist()
    np.testing.assert_array_equal(all_logits(got, ids), all_logits(ref, ids))
    with pytest.raises(ValueError, match=r"quantization='none' was asked.*--quantization none"):
        load_model(out, jnp.float32, quantization="none", load_tokenizer=False)


def test_convert_cli_refuses_what_it_cannot_do(tiny_llama, tiny_ckpt, tmp_path, capsys):
    assert main(["convert", tiny_llama, tiny_ckpt]) == 1
    assert "already exists and is not empty" in capsys.readouterr().err
    # a checkpoint method asked of float weights
    assert main(["convert", tiny_llama, str(tmp_path / "q"), "--quantization", "awq"]) == 1
    assert "needs a checkpoint quantized with it" in capsys.readouterr().err
    assert not (tmp_path / "q").exists()
    with pytest.raises(SystemExit):
        main(["convert", tiny_llama, str(tmp_path / "x"), "--dtype", "int3"])


def test_random_checkpoint_loads_as_its_config(tmp_path, tiny_llama):
    """bench startup's random safetensors carry every tensor the config's family reads."""
    from benchmarks.startup import write_random_checkpoint
    cfg = tmp_path / "cfg"
    cfg.mkdir()
    shutil.copy(os.path.join(tiny_llama, "config.json"), cfg / "config.json")
    src = write_random_checkpoint(str(cfg), str(tmp_path / "random"), "bfloat16")
    ref = load_model(tiny_llama, jnp.bfloat16, load_tokenizer=False)
    got = load_model(src, jnp.bfloat16)
    assert got.arch == ref.arch and got.tokenizer is not None
    assert [x.shape for x in jax.tree.leaves(got.state)] == [x.shape for x in jax.tree.leaves(ref.state)]
    assert float(jnp.std(got.state["layers"]["w_down"][...].astype(jnp.float32))) > 0.01


@pytest.mark.slow
def test_bench_startup_reports_source_and_orbax(tiny_llama, tmp_path):
    assert main(["bench", "startup", "--model", tiny_llama, "--max-num-seqs", "2",
                 "--max-num-batched-tokens", "16", "--max-model-len", "64", "--warm-runs", "1",
                 "--load-runs", "1", "--results-dir", str(tmp_path), "--tag", "s"]) == 0
    with open(tmp_path / "s.json") as f:
        r = json.load(f)
    assert "jaxllm bench startup" in r["command"] and r["convert_s"] > 0
    shapes = {r["starts"][fmt][kind]["step_shapes"] if kind == "cold" else
              r["starts"][fmt][kind][0]["step_shapes"] for fmt in ("source", "orbax") for kind in ("cold", "warm")}
    assert len(shapes) == 1 and shapes.pop() >= 1  # the same engine from either checkpoint
    for fmt in ("source", "orbax"):
        cold, warm = r["starts"][fmt]["cold"], r["starts"][fmt]["warm"][0]
        for run in (cold, warm):
            assert run["ready_s"] >= run["engine_s"] >= run["load_s"] + run["compile_s"] > 0
            assert run["compiles_after_warmup"] == 0
        assert r["weight_load_s"][fmt]["n"] == 1
    ratio = r["ratio_orbax_vs_source"]
    assert ratio["weight_load"] == pytest.approx(r["weight_load_s"]["orbax"]["median"]
                                                 / r["weight_load_s"]["source"]["median"])
    assert ratio["cold_ready"] > 0 and ratio["warm_ready"] > 0
