"""Input processing: a prompt and its SamplingParams become an EngineRequest, validated and
tokenized once. LLM.generate does it before anything runs (bad input is refused up front);
the server does it in a thread pool, off the event loop; LLMEngine.add_request takes either
raw prompts or an EngineRequest, which it never tokenizes again."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jaxllm.lora.request import LoRARequest
from jaxllm.sampling_params import MAX_LOGPROBS, RequestOutputKind, SamplingParams, check_truncation


@dataclass
class EngineRequest:
    prompt: str | None            # the text, when the prompt was text
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None = None
    bad_word_ids: list[list[int]] | None = None  # SamplingParams.bad_words, tokenized
    grammar: object | None = None  # SamplingParams.structured_outputs, validated (a GrammarSpec)
    lora_request: "LoRARequest | None" = None
    # images: (offset, length, hash, pixels [C, H, W]) of each, in prompt order
    mm: list | None = None


@dataclass(frozen=True)
class MultiModalInputs:
    """What a vision-language model takes images with: its placeholder token, the tokens an
    image becomes, its preprocessing, and the most images one prompt may have."""
    image_token_id: int
    tokens_per_image: int
    processor: object  # jaxllm.multimodal.ImageProcessor
    limit: int


class InputProcessor:
    def __init__(self, tokenizer, vocab_size: int, max_model_len: int, structured=None,
                 speculative: bool = False, mm: MultiModalInputs | None = None):
        self.tokenizer = tokenizer
        self.mm = mm  # None: a text-only model
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.structured = structured  # StructuredOutputManager: validates constraints
        # speculative decoding verifies proposals without a grammar's token masks
        self.speculative = speculative

    def tokenize(self, prompt) -> tuple[str | None, list[int], str | None]:
        """(text, token ids, cache_salt) of a string, a list of token ids, or a dict with
        "prompt" or "prompt_token_ids" (and optionally "cache_salt")."""
        salt = None
        if isinstance(prompt, dict):
            salt = prompt.get("cache_salt")
            if salt is not None and not isinstance(salt, str):
                raise ValueError("cache_salt must be a string")
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if not isinstance(ids, (list, tuple)) or not all(
                        isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in ids):
                    raise ValueError("prompt_token_ids must be a list of integers")
                return prompt.get("prompt"), [int(t) for t in ids], salt
            if "prompt" not in prompt:
                raise ValueError("prompt dict needs 'prompt' or 'prompt_token_ids'")
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt is text, but this engine has no tokenizer (skip_tokenizer_init, "
                                 "or a checkpoint without one): send token ids, e.g. "
                                 "{'prompt_token_ids': [...]}")
            try:
                return prompt, self.tokenizer.encode(prompt, add_special_tokens=True), salt
            except (TypeError, UnicodeEncodeError) as e:  # e.g. a lone surrogate
                raise ValueError(f"prompt is not valid text: {e}") from None
        if isinstance(prompt, (list, tuple)) and all(
                isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in prompt):
            return None, [int(t) for t in prompt], salt
        raise ValueError(f"prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")

    def process(self, prompt, params: SamplingParams | None = None,
                lora_request: "LoRARequest | None" = None) -> EngineRequest:
        if isinstance(prompt, EngineRequest):
            return prompt
        if lora_request is not None and not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}")
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        text, ids, salt = self.tokenize(prompt)
        images = self._images(prompt)
        if params.truncate_prompt_tokens is not None:
            if images:
                raise ValueError("truncate_prompt_tokens cannot cut a prompt with images")
            ids = ids[-check_truncation(params.truncate_prompt_tokens, self.max_model_len):]
        ids, mm = self._place_images(ids, images)
        self.check(ids, params)
        if self.tokenizer is None and params.stop_strings:
            # stop strings are matched in the detokenized text, which there is none of
            raise ValueError("stop strings need a tokenizer, which this engine has none of: use "
                             "stop_token_ids")
        bad = self._tokenize_bad_words(params.bad_words) if params.bad_words else None
        grammar = None
        if params.structured_outputs is not None:
            if self.structured is None:
                raise ValueError("structured_outputs is not available here")
            if self.speculative:
                raise ValueError(f"{params.structured_outputs.field_name} is not supported with "
                                 "speculative_config: this engine speculates, and verified "
                                 "proposals are not masked by a grammar")
            grammar = self.structured.prepare(params.structured_outputs)
        return EngineRequest(text, ids, params, salt, bad, grammar, lora_request, mm)

    def _images(self, prompt) -> list:
        """The prompt's images (vLLM's {"multi_modal_data": {"image": one or a list}})."""
        data = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
        if not data:
            return []
        if not isinstance(data, dict) or set(data) - {"image"}:
            raise ValueError(f"multi_modal_data takes 'image' only, got {sorted(data) if isinstance(data, dict) else type(data).__name__}")
        if self.mm is None:
            raise ValueError("multi_modal_data: this model is text-only; it takes no images")
        images = data["image"]
        images = list(images) if isinstance(images, (list, tuple)) else [images]
        self.check_image_count(len(images))
        return images

    def check_image_count(self, n: int) -> None:
        if self.mm is not None and n > self.mm.limit:
            raise ValueError(f"the prompt has {n} images; at most {self.mm.limit} per prompt "
                             "(limit_mm_per_prompt)")

    def widen_images(self, ids: list[int]) -> list[int]:
        """Each image placeholder token as the tokens its image becomes (what the engine
        counts against max_model_len)."""
        tok, per = self.mm.image_token_id, self.mm.tokens_per_image
        out = []
        for t in ids:
            out.extend([t] * per if t == tok else (t,))
        return out

    def _place_images(self, ids: list[int], images: list) -> tuple[list[int], list | None]:
        """Each image's placeholder token widened to the image's tokens (or, in token ids
        given already widened, each run of them taken as one image), and its pixels."""
        from jaxllm.multimodal import image_hash
        if self.mm is None:
            return ids, None
        tok, per = self.mm.image_token_id, self.mm.tokens_per_image
        at = [i for i, t in enumerate(ids) if t == tok]
        if not images and not at:
            return ids, None
        n = len(images)
        if len(at) == n:
            out, offsets = [], []
            for i, t in enumerate(ids):
                if t == tok:
                    offsets.append(len(out))
                    out.extend([tok] * per)
                else:
                    out.append(t)
        elif len(at) == n * per and all(at[j * per + per - 1] - at[j * per] == per - 1 for j in range(n)):
            out, offsets = ids, [at[j * per] for j in range(n)]
        else:
            raise ValueError(f"the prompt has {len(at)} image placeholder tokens (id {tok}) for {n} "
                             f"image(s): one per image (or {per} per image, already widened)")
        mm = []
        for off, image in zip(offsets, images):
            pixels = self.mm.processor(image)
            mm.append((off, per, image_hash(pixels), pixels))
        return out, mm

    def check(self, ids: list[int], params: SamplingParams) -> None:
        if not ids:
            raise ValueError("prompt is empty: it must contain at least one token")
        vocab = self.vocab_size
        if any(t < 0 or t >= vocab for t in ids):
            raise ValueError(f"prompt contains token ids outside the vocabulary [0, {vocab})")
        limit = self.max_model_len
        if len(ids) >= limit:
            raise ValueError(f"prompt is {len(ids)} tokens, but max_model_len is {limit}: "
                             "no room to generate")
        params.check_vocab(vocab)
        if params.output_kind is RequestOutputKind.DELTA and (params.best_of or params.n) > params.n:
            raise ValueError("best_of > n cannot be streamed (DELTA outputs): the best n are "
                             "known only at the end")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and k > MAX_LOGPROBS:
                raise ValueError(f"{name} must be at most {MAX_LOGPROBS}, got {k}")
        if params.max_tokens is not None and len(ids) + params.max_tokens > limit:
            raise ValueError(f"prompt ({len(ids)} tokens) plus max_tokens ({params.max_tokens}) "
                             f"exceeds max_model_len ({limit})")

    def _tokenize_bad_words(self, words: list[str]) -> list[list[int]]:
        """Each bad word as token ids, alone and after a space (as it appears mid-text)."""
        if self.tokenizer is None:
            raise ValueError("bad_words needs a tokenizer, which this engine has none of")
        out = []
        for word in words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                if ids and ids not in out:
                    out.append(ids)
        return out
