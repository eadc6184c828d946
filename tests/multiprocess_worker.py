"""One process of a 2-process tensor-parallel run (test_parallel.py starts two of these)."""
import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def main():
    model, coordinator, process_id, out_path = sys.argv[1:5]
    from jaxllm import LLM, SamplingParams

    prompts = json.loads(os.environ["JAXLLM_TEST_PROMPTS"])
    llm = LLM(model, tensor_parallel_size=2, distributed_coordinator=coordinator, num_processes=2,
              process_id=int(process_id), max_num_seqs=4, max_num_batched_tokens=64,
              max_model_len=256, warmup=False, token_buckets=[16, 64], seq_buckets=[2, 4])
    # only process 0 gets here; the follower exits inside LLM() once process 0 shuts down
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    with open(out_path, "w") as f:
        json.dump([o.outputs[0].token_ids for o in outs], f)


if __name__ == "__main__":
    main()
