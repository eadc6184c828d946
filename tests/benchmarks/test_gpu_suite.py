"""benchmarks/gpu_suite.sh, the one script a GPU lease runs, dry-run on the CPU at small scale
so that it cannot rot unnoticed between leases. Its kernel stages are left out here (the
kernel tests and test_bench's kernels test run the same code in CI), and so is its start-up
stage (test_orbax runs bench startup): both are the heaviest on a CI machine that runs this
beside other tests."""
import glob
import os
import subprocess
import tarfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STAGES = ["latency", "host", "throughput", "serve"]


@pytest.mark.slow
def test_engine_stages_run_and_archive_their_reports(tmp_path):
    out, results = tmp_path / "out", tmp_path / "results"
    out.mkdir()
    env = dict(os.environ, SUITE_SCALE="small", SUITE_MODEL="benchmarks/configs/smollm2-135m",
               OUT=str(out), SUITE_RESULTS=str(results), JAX_PLATFORMS="cpu",
               JAXLLM_COMPILATION_CACHE_DIR=str(tmp_path / "xla"))
    r = subprocess.run(["bash", "benchmarks/gpu_suite.sh", *STAGES], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    (archive,) = glob.glob(str(out / "gpu_suite_*.tar.gz"))
    with tarfile.open(archive) as t:
        names = [os.path.basename(n) for n in t.getnames()]
        t.extractall(tmp_path / "x", filter="data")
    # a report per stage (the serving stage's also has its server's log and plots)
    for kind in ("latency_2", "latency_host_smollm2-135m_", "throughput_sharegpt_",
                 "serve_sharegpt_"):
        assert any(n.startswith(kind) and n.endswith(".json") for n in names), (kind, names)
    log = next(n for n in names if n.startswith("gpu_suite_") and n.endswith(".log"))
    text = open(tmp_path / "x" / log).read()
    assert text.count(": exit 0 after") == len(STAGES) and ": exit 1" not in text

