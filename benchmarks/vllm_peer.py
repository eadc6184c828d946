"""Runs vLLM's offline engine on a workload written by `jaxllm bench throughput --baseline
vllm`, in vLLM's own python (it does not import jaxllm). Token-id prompts, greedy,
ignore_eos, one warm-up run, then the best of `iters` timed runs; prints one JSON line.
usage: python vllm_peer.py WORKLOAD.json"""
import json
import sys
import time


def main() -> None:
    with open(sys.argv[1]) as f:
        w = json.load(f)
    from vllm import LLM, SamplingParams, __version__
    from vllm.inputs import TokensPrompt

    llm = LLM(model=w["model"], max_model_len=w["max_model_len"], seed=0,
              max_num_seqs=w["max_num_seqs"], **w.get("engine_kwargs", {}))
    prompts = [TokensPrompt(prompt_token_ids=p) for p in w["prompts"]]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in w["output_lens"]]
    llm.generate(prompts, params, use_tqdm=False)  # warm-up
    best = None
    for _ in range(w["iters"]):
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        secs = time.perf_counter() - t
        best = secs if best is None else min(best, secs)
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    n_in = sum(len(p) for p in w["prompts"])
    dtype = str(llm.llm_engine.model_config.dtype).replace("torch.", "")
    print("RESULT " + json.dumps({
        "vllm_version": __version__, "dtype": dtype, "seconds": best, "requests": len(outs),
        "requests_per_s": len(outs) / best, "output_tokens": n_out,
        "output_tokens_per_s": n_out / best, "total_tokens_per_s": (n_in + n_out) / best,
        "tokens": [list(o.outputs[0].token_ids) for o in outs]}), flush=True)


if __name__ == "__main__":  # vLLM spawns its engine process
    main()
