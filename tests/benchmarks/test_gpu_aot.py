"""`bench aot`'s readings of XLA's dumps (no CUDA compiler needed: the dumps are written
here in XLA's formats): how a step's launches reach the GPU, and the optimized step's
recomputations and weight-sized copies."""
import subprocess
import sys
import textwrap

import jax
import pytest

from benchmarks import gpu_aot

# XLA's thunk sequence after its thunk passes, cut down: a command buffer, a custom call and
# a kernel outside it, and a conditional whose branches hold a nested conditional and a
# command buffer of their own
THUNKS = textwrap.dedent("""\
    000: kCommandBuffer [source       | next=012 (1)] 
        001: kCustomKernel [source       | next=006 (5)] loop_convert_fusion grid: [1, 1, 1] threads: [64, 1, 1]  shared_memory: 0 bytes
        002: kCustomKernel [source       | next=003 (1)] input_reduce_fusion_70 grid: [1, 1, 1] threads: [256, 1, 1]  shared_memory: 0 bytes
        011: kCopy         [source       | sink        ] kCopy
    012: kCustomCall    [prev=000 (1) | next=000 (1)] kCustomCall
    013: kCustomKernel [source       | sink        ] wrapped_slice grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
    029: kConditional   [prev=000 (1) | next=000 (1)]   
      false_branch:
        023: kCustomKernel [source       | next=025 (2)] input_concatenate_fusion grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
        025: kCustomCall   [prev=024 (1) | next=026 (1)] kCustomCall
        027: kConditional   [source       | next=030 (1)]       
          false_branch:
            028: kCustomKernel [source | sink] loop_select_fusion grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
          true_branch:
            031: kCopy [source | sink] kCopy
      true_branch:
        000: kCommandBuffer [source | sink] 
            850: kCustomKernel [source        | next=851 (1)] gemm_fusion_dot_130 grid: [8016, 1, 1] threads: [64, 1, 1]  shared_memory: 768 bytes
    """)


def test_launch_report_counts_command_buffers_and_what_runs_outside(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_aot, "DUMP", str(tmp_path))
    assert gpu_aot._launch_report("jit_forward") is None  # not compiled: no report
    (tmp_path / "module_0007.jit_forward.thunk_sequence_after_thunk_passes.txt").write_text(THUNKS)
    (tmp_path / "module_0008.jit_sample_step.thunk_sequence.txt").write_text(THUNKS)
    rep = gpu_aot._launch_report("jit_forward")
    assert rep["top_level"] == {"kCommandBuffer": 1, "kConditional": 1, "kCustomCall": 1,
                                "kCustomKernel": 1}
    assert rep["launches_in_command_buffers"] == 4  # 001, 002, 011; 850 in a branch's buffer
    assert rep["launches_outside_command_buffers"] == 6  # 012, 013, 023, 025, 028, 031
    assert rep["launches"] == 10 and rep["command_buffers"] == 1
    assert rep["top_level_conditionals"] == 1 and rep["conditionals_outside_command_buffers"] == 2
    assert gpu_aot._launch_report("jit_sample_step") is None  # only the final sequence counts


def test_hlo_report_reads_the_forward_programs_optimized_module(tmp_path, monkeypatch):
    """Recomputed instructions and dynamic slices copied out at 16 MiB or more, in the step's
    forward program (jit_forward) and no other."""
    monkeypatch.setattr(gpu_aot, "DUMP", str(tmp_path))
    hlo = textwrap.dedent("""\
        %fused_dynamic_slice.3 (param_0: bf16[32,4096,4096], param_1: s32[]) -> bf16[4096,4096] {
        }
        %fused_dynamic_slice.4 (param_0: bf16[32,64], param_1: s32[]) -> bf16[64] {
        }
        ENTRY %main.1 () -> f32[] {
          %fusion.1.remat = f32[8]{0} fusion(), kind=kLoop
          ROOT %fusion.2.remat2 = f32[] fusion(), kind=kLoop
        }
        """)
    name = "module_0001.{}.sm_9.0a_gpu_after_optimizations.txt"
    (tmp_path / name.format("jit_sample_step")).write_text(hlo)
    assert gpu_aot._hlo_report() == dict(rematerialized_instructions=0,
                                         large_dynamic_slice_copies=0)
    (tmp_path / name.format("jit_forward")).write_text(hlo)
    assert gpu_aot._hlo_report() == dict(rematerialized_instructions=2,
                                         large_dynamic_slice_copies=1)


def test_on_device_needs_a_gpu_here():
    """`bench aot --on-device` compiles for this machine's GPUs (their driver decides what
    command buffers capture); without one it says so."""
    if jax.default_backend() == "gpu":
        pytest.skip("a GPU is here")
    res = subprocess.run([sys.executable, "-m", "jaxllm.cli", "bench", "aot", "--on-device",
                          "--skip-kernels"], capture_output=True, text=True, timeout=120)
    assert res.returncode != 0
    assert "--on-device compiles for the GPUs here" in res.stderr
