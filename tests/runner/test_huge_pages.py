"""Huge pages under the engine's weights and KV cache (jaxllm.runner.huge_pages)."""
import jax.numpy as jnp
import numpy as np

from jaxllm.runner import huge_pages as hp


def _anon_huge_kib(address: int) -> int:
    """AnonHugePages of the mapping of this process that holds `address`, from smaps."""
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and line.startswith("AnonHugePages:"):
                return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_advise_collapses_an_arrays_pages():
    """A 64 MiB array already written on 4 KiB pages: advise() asks for its whole 2 MiB pages,
    and where the kernel's THP mode allows it (always / madvise) and it collapsed them now,
    smaps then shows them as huge pages; with THP off it asks for nothing. The values are kept."""
    x = jnp.arange(16 << 20, dtype=jnp.float32)  # 64 MiB
    x.block_until_ready()
    p = x.unsafe_buffer_pointer()
    whole = (p + x.nbytes) // hp.HUGE * hp.HUGE - (-(-p // hp.HUGE) * hp.HUGE)
    collapsed, asked = hp.advise({"w": x, "small": jnp.ones(8)})
    if hp.thp_mode() in (None, "never"):
        assert collapsed == asked == 0
    else:
        assert collapsed + asked == whole >= x.nbytes - 2 * hp.HUGE
        if collapsed:  # (a kernel may decline a collapse: khugepaged's, later)
            assert _anon_huge_kib(p + hp.HUGE) * 1024 >= whole - hp.HUGE
    np.testing.assert_array_equal(np.asarray(x[::1 << 20]), np.arange(0, 16 << 20, 1 << 20))


def test_engine_asks_for_its_weights_and_kv_cache(default_llm):
    """The CPU engine asks, on a thread at start-up, for huge pages under its KV cache and
    every weight array of at least two huge pages; the KV cache keeps its buffer through steps
    (donation), so the pages stay."""
    from jaxllm import SamplingParams
    eng = default_llm.llm_engine
    cache = eng.runner.kv_cache
    p = cache.unsafe_buffer_pointer()
    if eng._huge_pages is None:  # THP off here: nothing asked
        assert hp.thp_mode() in (None, "never")
        return
    eng._huge_pages.join()
    collapsed, asked = eng.huge_page_bytes
    weights = sum(b - a for a, b in hp._ranges(eng.runner.state))
    assert weights > 0
    kv = sum(b - a for a, b in hp._ranges(cache))
    assert kv >= cache.nbytes - 2 * hp.HUGE
    assert collapsed + asked == weights + kv
    default_llm.generate(["Huge pages"], SamplingParams(max_tokens=4), use_tqdm=False)
    assert eng.runner.kv_cache.unsafe_buffer_pointer() == p
    if not asked:  # everything was collapsed at start-up
        assert _anon_huge_kib(p + hp.HUGE) * 1024 >= cache.nbytes - 2 * hp.HUGE


def test_huge_pages_off_asks_for_nothing(tmp_path):
    """EngineConfig.huge_pages=False (--no-huge-pages): the engine starts no advising thread."""
    from conftest import make_tiny_checkpoint
    from jaxllm import LLM
    make_tiny_checkpoint(tmp_path, "llama3", tokenizer_dir=None)
    eng = LLM(model=str(tmp_path), load_format="dummy", warmup=False, huge_pages=False,
              max_model_len=64, max_num_seqs=2, max_num_batched_tokens=16).llm_engine
    assert eng._huge_pages is None and eng.huge_page_bytes is None
