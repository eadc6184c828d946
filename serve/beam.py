"""Beam search on the server: the search state is jaxllm.beam_search.BeamSearch (shared with
LLM.beam_search); each step's one-token requests run in the continuous batch beside
everything else."""
from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse

from jaxllm.beam_search import BeamSearch, BeamSearchParams
from jaxllm.sampling_params import MAX_LOGPROBS, RequestOutputKind, SamplingParams
from serve.errors import bad_request
from serve.streaming import DONE, add_usage, collect, new_usage, sse


async def check_prompt(server, ids: list[int], body, max_tokens: int | None = None):
    """(ids, BeamSearchParams) for one prompt; n is the beam width."""
    given = body.max_tokens if max_tokens is None else max_tokens
    try:
        n = server.max_tokens(len(ids), given)
        await server.engine.process({"prompt_token_ids": ids}, SamplingParams(max_tokens=n))
        if 2 * body.n > MAX_LOGPROBS:
            raise ValueError(f"n (the beam width) must be at most {MAX_LOGPROBS // 2} with use_beam_search")
        return ids, BeamSearchParams(beam_width=body.n, max_tokens=n, ignore_eos=body.ignore_eos,
                                     temperature=body.temperature or 0.0,
                                     length_penalty=body.length_penalty)
    except ValueError as e:
        raise bad_request(e) from None


async def _search(server, request: Request, base: str, ids: list[int], params: BeamSearchParams,
                  body):
    engine = server.engine
    search = BeamSearch([ids], params, engine.eos_token_id)
    step_params = search.step_params()
    step_params.output_kind = RequestOutputKind.FINAL_ONLY
    salt = {"cache_salt": body.cache_salt} if body.cache_salt else {}
    step = 0
    while pending := search.pending():
        reqs = [await engine.process({"prompt_token_ids": t, **salt}, step_params,
                                     server.lora_of(body.model)) for t in pending]
        gens = [server.run(f"{base}-beam{step}-{j}", r, body.priority) for j, r in enumerate(reqs)]
        outs = await collect(request, gens)
        search.advance([o.outputs[0].logprobs[0] for o in outs])
        step += 1
    seqs = search.results()[0].sequences
    for s in seqs:
        s.text = await engine.decode(s.tokens[len(ids):], True) if engine.tokenizer else ""
    return seqs


async def respond(server, request: Request, base: str, prompts, body, chat: bool):
    choices, usage = [], new_usage()
    for k, (ids, params) in enumerate(prompts):
        seqs = await _search(server, request, f"{base}-{k}", ids, params, body)
        for i, s in enumerate(seqs):
            c = {"index": k * params.beam_width + i, "finish_reason": s.finish_reason,
                 "stop_reason": None, "logprobs": None}
            if chat:
                c["message"] = {"role": "assistant", "content": s.text}
            else:
                c["text"] = s.text
            choices.append(c)
        add_usage(usage, len(ids), sum(len(s.tokens) - len(ids) for s in seqs), 0)
    obj = "chat.completion" if chat else "text_completion"
    out = {"id": base, "object": obj, "created": int(time.time()),
           "model": server.model_name(body), "choices": choices, "usage": usage}
    if not body.stream:
        return JSONResponse(out)

    async def events():  # beams are only final at the end: one chunk per choice
        for c in choices:
            if chat:
                c = {"index": c["index"], "finish_reason": c["finish_reason"], "logprobs": None,
                     "delta": {"role": "assistant", "content": c["message"]["content"]}}
            yield sse({**out, "object": obj + (".chunk" if chat else ""), "choices": [c],
                       "usage": None})
        yield DONE
    return StreamingResponse(events(), media_type="text/event-stream")

