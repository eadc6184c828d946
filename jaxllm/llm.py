"""LLM: the offline API (generate, chat), as in vLLM."""
from __future__ import annotations

import atexit
import copy
import itertools
from typing import Sequence

import jax
from tqdm.auto import tqdm

from jaxllm.config import EngineConfig
from jaxllm.engine.llm_engine import LLMEngine
from jaxllm.engine.outputs import RequestOutput
from jaxllm.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams
from jaxllm.sampling_params import MAX_LOGPROBS, RequestOutputKind, SamplingParams


def _is_token_list(x) -> bool:
    return isinstance(x, (list, tuple)) and len(x) > 0 and all(isinstance(t, int) for t in x)


def _final_only(params: list[SamplingParams]) -> list[SamplingParams]:
    """Copies that ask the engine for each request's output once, at the end (only the final
    outputs are returned here); the caller's objects stay as they were."""
    copies: dict[int, SamplingParams] = {}
    for p in params:
        if id(p) not in copies:
            copies[id(p)] = c = copy.copy(p)
            c.output_kind = RequestOutputKind.FINAL_ONLY
    return [copies[id(p)] for p in params]


class LLM:
    def __init__(self, model: str | None = None, *, config: EngineConfig | None = None,
                 **engine_args):
        if config is None:
            config = EngineConfig(model=model, **engine_args)
        elif model is not None or engine_args:
            raise ValueError("pass either config or model/engine arguments, not both")
        if config.kv_transfer_config is not None:
            raise ValueError("kv_transfer_config: disaggregated prefill/decode is served by "
                             "`jaxllm serve`; offline, use data_parallel_size alone")
        if config.data_parallel_size > 1:  # replicas on Ray (jaxllm.distributed)
            from jaxllm.distributed.offline import DataParallelLLMEngine
            self.llm_engine = DataParallelLLMEngine(config)
            atexit.register(self.llm_engine.shutdown)
        else:
            self.llm_engine = LLMEngine(config)
        self._counter = itertools.count()
        if self.llm_engine.is_follower:
            # multi-process: the same script runs everywhere; only process 0 generates, the
            # others run its steps here until it shuts down, then exit
            self.llm_engine.follow()
            raise SystemExit(0)
        if jax.process_count() > 1:
            atexit.register(self.llm_engine.shutdown)

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, lora_request=None) -> list[RequestOutput]:
        """`lora_request`: a jaxllm.lora.LoRARequest for every prompt, or a list with one (or
        None) per prompt; each adapter is read and checked before anything runs."""
        if isinstance(prompts, (str, dict)) or _is_token_list(prompts):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts")
        if isinstance(lora_request, (list, tuple)):
            loras = list(lora_request)
            if len(loras) != len(prompts):
                raise ValueError(f"got {len(loras)} lora_request for {len(prompts)} prompts")
        else:
            loras = [lora_request] * len(prompts)
        engine = self.llm_engine
        # validated and tokenized once, before anything runs: bad input is refused up front
        requests = [engine.process_inputs(prompt, p, lr) for prompt, p, lr in zip(prompts, params, loras)]
        for lr in dict.fromkeys(lr for lr in loras if lr is not None):
            engine.add_lora(lr)
        for r, p in zip(requests, _final_only(params)):
            r.params = p
        ids = [str(next(self._counter)) for _ in prompts]
        for rid, r in zip(ids, requests):
            engine.add_request(rid, r)
        return self._run(ids, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        pending = set(ids)
        final: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generating", disable=not use_tqdm, unit="req")
        try:
            while pending:
                for out in engine.step():
                    if out.finished and out.request_id in pending:
                        final[out.request_id] = out
                        pending.discard(out.request_id)
                        bar.update(1)
        except BaseException:
            engine.abort_request(list(pending))
            raise
        finally:
            bar.close()
        return [final[i] for i in ids]

    def beam_search(self, prompts, params: BeamSearchParams, use_tqdm: bool = False,
                    lora_request=None) -> list[BeamSearchOutput]:
        """Beam search over each prompt (a string, token ids or a prompt dict), with one
        adapter (jaxllm.lora.LoRARequest) for all of them if given."""
        if isinstance(prompts, (str, dict)) or _is_token_list(prompts):
            prompts = [prompts]
        engine = self.llm_engine
        if 2 * params.beam_width > MAX_LOGPROBS:
            raise ValueError(f"beam_width must be at most {MAX_LOGPROBS // 2}, got {params.beam_width}")
        ids = [engine.process_inputs(p, SamplingParams(max_tokens=params.max_tokens)).prompt_token_ids
               for p in prompts]
        search = BeamSearch(ids, params, engine.eos_token_id)
        bar = tqdm(total=params.max_tokens, desc="beam search", disable=not use_tqdm)
        while pending := search.pending():
            outs = self.generate([{"prompt_token_ids": t} for t in pending], search.step_params(),
                                 use_tqdm=False, lora_request=lora_request)
            search.advance([o.outputs[0].logprobs[0] for o in outs])
            bar.update(1)
        bar.close()
        return search.results(self.get_tokenizer())

    def chat(self, messages, sampling_params=None, use_tqdm: bool = True,
             add_generation_prompt: bool = True, chat_template: str | None = None,
             tools: list[dict] | None = None, lora_request=None) -> list[RequestOutput]:
        """`tools`: OpenAI-style function definitions, for chat templates that render them."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tok = self.get_tokenizer()
        if tok is None:
            raise ValueError("messages: chat needs a tokenizer (its chat template), and this "
                             "engine has none (skip_tokenizer_init): use generate with "
                             "{'prompt_token_ids': [...]}")
        prompts = []
        for conv in conversations:
            ids = tok.apply_chat_template(conv, tokenize=True, add_generation_prompt=add_generation_prompt,
                                          chat_template=chat_template, tools=tools)
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            text = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=add_generation_prompt,
                                           chat_template=chat_template, tools=tools)
            prompts.append({"prompt": text, "prompt_token_ids": list(ids)})
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)
