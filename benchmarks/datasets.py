"""Benchmark workloads, generated from a seed (or read from a ShareGPT-format JSON file).

Prompts are token ids drawn from the model's vocabulary (special tokens avoided), so any model
can run any workload without a dataset download; requests run with ignore_eos and their own
output length, as vLLM's benchmarks do.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

DATASETS = ("random", "sharegpt", "prefix-chat")


@dataclass
class Sample:
    prompt_token_ids: list[int]
    output_len: int


class TokenSource:
    def __init__(self, vocab_size: int, avoid: set[int], seed: int):
        self.rng = np.random.default_rng(seed)
        self.vocab = vocab_size
        self.avoid = avoid

    def tokens(self, n: int) -> list[int]:
        ids = self.rng.integers(100, self.vocab, size=n).tolist()
        return [100 if t in self.avoid else t for t in ids]


def random_dataset(src: TokenSource, num: int, input_len: int, output_len: int,
                   range_ratio: float = 0.0) -> list[Sample]:
    """Fixed lengths, or uniform within +-range_ratio of them (vLLM's --random-range-ratio)."""
    def length(mean):
        lo, hi = max(1, int(mean * (1 - range_ratio))), max(1, int(mean * (1 + range_ratio)))
        return int(src.rng.integers(lo, hi + 1))
    return [Sample(src.tokens(length(input_len)), length(output_len)) for _ in range(num)]


def sharegpt_like(src: TokenSource, num: int, max_len: int, mean_input: int = 200,
                  mean_output: int = 180) -> list[Sample]:
    """A ShareGPT-like length mix: log-normal prompt and output lengths (means near 200 and
    180 tokens, long right tails), clipped so that prompt + output fits max_len."""
    out = []
    sigma_in, sigma_out = 1.0, 0.9
    mu_in = np.log(mean_input) - sigma_in ** 2 / 2
    mu_out = np.log(mean_output) - sigma_out ** 2 / 2
    while len(out) < num:
        n_in = int(np.clip(src.rng.lognormal(mu_in, sigma_in), 4, max_len // 2))
        n_out = int(np.clip(src.rng.lognormal(mu_out, sigma_out), 4, max_len - n_in))
        out.append(Sample(src.tokens(n_in), n_out))
    return out


def sharegpt_file(path: str, tokenizer, num: int, max_len: int, seed: int) -> list[Sample]:
    """The first human turn and the reply's length from a ShareGPT-format JSON file."""
    with open(path) as f:
        data = json.load(f)
    rng = np.random.default_rng(seed)
    rng.shuffle(data)
    out = []
    for item in data:
        conv = item.get("conversations") or item.get("conversation") or []
        if len(conv) < 2:
            continue
        prompt = tokenizer.encode(conv[0]["value"])
        n_out = len(tokenizer.encode(conv[1]["value"]))
        if len(prompt) < 4 or n_out < 4 or len(prompt) + n_out > max_len:
            continue
        out.append(Sample(prompt, n_out))
        if len(out) == num:
            break
    return out


@dataclass
class ChatWorkload:
    """Conversations that share a system prompt; turn t's prompt is the whole conversation
    so far, so each turn extends the previous one (the runner appends model replies)."""
    system: list[int]
    user_turns: list[list[list[int]]]  # [conversation][turn] -> user message tokens
    output_len: int

    @property
    def num_turns(self) -> int:
        return len(self.user_turns[0])


def prefix_chat(src: TokenSource, num_conversations: int, turns: int, system_len: int,
                user_len: int, output_len: int) -> ChatWorkload:
    system = src.tokens(system_len)
    users = [[src.tokens(user_len) for _ in range(turns)] for _ in range(num_conversations)]
    return ChatWorkload(system, users, output_len)
