"""Benchmark workloads, generated from a seed (or read from a ShareGPT-format JSON file).

Prompts are token ids drawn from the model's vocabulary (special tokens avoided), so any model
can run any workload without a dataset download; requests run with ignore_eos and their own
output length, as vLLM's benchmarks do.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

DATASETS = ("random", "sharegpt", "prefix-chat", "copy", "image")


@dataclass
class Sample:
    prompt_token_ids: list[int]
    output_len: int
    stop_at_eos: bool = False  # the request ends at its EOS (else it runs output_len tokens)
    # a chat request with an image (the "image" dataset): its text and the image's data URL
    text: str | None = None
    image: str | None = None


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
    """Conversations that share a system prompt (one per tenant: conversation c belongs to
    tenant c % tenants); turn t's prompt is the whole conversation so far, so each turn
    extends the previous one (the runner appends model replies)."""
    systems: list[list[int]]  # one per tenant
    user_turns: list[list[list[int]]]  # [conversation][turn] -> user message tokens
    output_len: int

    @property
    def num_turns(self) -> int:
        return len(self.user_turns[0])

    @property
    def system(self) -> list[int]:
        return self.systems[0]

    def system_of(self, conversation: int) -> list[int]:
        return self.systems[conversation % len(self.systems)]


def prefix_chat(src: TokenSource, num_conversations: int, turns: int, system_len: int,
                user_len: int, output_len: int, tenants: int = 1) -> ChatWorkload:
    systems = [src.tokens(system_len) for _ in range(tenants)]
    users = [[src.tokens(user_len) for _ in range(turns)] for _ in range(num_conversations)]
    return ChatWorkload(systems, users, output_len)


# Copy-heavy requests: the answer repeats long spans of the prompt (an edit that returns the
# whole text). Paragraphs written for this benchmark; one word of each gets a typo.
PARAGRAPHS = [
    "The old lighthouse stood at the edge of the cliff for more than a hundred years. Every "
    "night its keeper climbed the narrow stairs, trimmed the wick and wound the clockwork that "
    "turned the great lens. Ships passing in the dark counted the flashes and knew exactly "
    "where they were, even when the fog rolled in from the sea and hid the rocks below.",
    "Bread is one of the oldest prepared foods. A simple dough of flour, water and salt is "
    "left to rise with yeast, then shaped and baked until the crust turns golden brown. The "
    "long, slow rise gives the yeast time to develop flavour, which is why many bakers prefer "
    "to leave their dough in a cool place overnight before baking it in the morning.",
    "The committee met on Tuesday to review the budget for the coming year. After a long "
    "discussion, the members agreed to increase the funding for the public library and to "
    "delay the repairs to the town hall until the spring. The final report will be published "
    "next month, and residents are invited to send their comments before the end of May.",
    "Rivers shape the land they flow through. Over thousands of years, moving water carries "
    "sand and stones downstream, cutting deep valleys into the hills and building wide, flat "
    "plains near the coast. When a river floods, it spreads fresh soil across its banks, which "
    "is why so many farming villages have been built close to the water.",
    "To reset your password, open the settings page and choose the security tab. Enter your "
    "current password, then type the new one twice to confirm it. A strong password is at "
    "least twelve characters long and mixes letters, numbers and symbols. If you have "
    "forgotten your current password, use the link on the sign-in page to receive a reset email.",
    "The museum's new exhibition brings together paintings from three centuries. Visitors "
    "begin in a small room of early portraits, walk through a long gallery of landscapes and "
    "finish in a bright hall filled with modern work. Guided tours run every hour, and the "
    "museum stays open late on Fridays so that people can visit after work.",
    "A good night's sleep helps the body recover and the mind stay sharp. Most adults need "
    "between seven and nine hours each night. Going to bed at the same time every day, keeping "
    "the bedroom dark and quiet, and avoiding screens for an hour before sleep can all make it "
    "easier to fall asleep and to wake up feeling rested.",
    "The train left the station just after six in the morning. As it climbed into the "
    "mountains, the passengers watched the villages grow smaller and the snow grow deeper. By "
    "noon they had crossed the highest pass, and the long descent towards the lakes began, "
    "with the afternoon sun shining on the water far below.",
]
COPY_INSTRUCTIONS = [
    "Fix the typo in this paragraph and write out the whole corrected paragraph:",
    "Correct the spelling mistake in the following text. Reply with the full corrected text only:",
]


def _typo(rng, text: str) -> str:
    """Swap two letters inside one longer word."""
    words = text.split(" ")
    candidates = [i for i, w in enumerate(words) if len(w) > 5 and w.isalpha()]
    i = candidates[int(rng.integers(len(candidates)))]
    w = words[i]
    j = int(rng.integers(1, len(w) - 2))
    words[i] = w[:j] + w[j + 1] + w[j] + w[j + 2:]
    return " ".join(words)


def copy_dataset(src: TokenSource, tokenizer, num: int, output_len: int | None = None) -> list[Sample]:
    """"Fix the typo in this paragraph" chat requests: the answer repeats the paragraph, so
    proposals looked up in the prompt (n-gram) are often right. Each request may generate up
    to 1.5x its paragraph's length (or output_len); it ends at its EOS."""
    if tokenizer is None:
        raise ValueError("the copy dataset needs the model's tokenizer (it writes chat prompts)")
    out = []
    for i in range(num):
        para = PARAGRAPHS[i % len(PARAGRAPHS)]
        text = f"{COPY_INSTRUCTIONS[i % len(COPY_INSTRUCTIONS)]}\n\n{_typo(src.rng, para)}"
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                            add_generation_prompt=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        n_out = output_len or int(1.5 * len(tokenizer.encode(para)))
        out.append(Sample(list(ids), n_out, stop_at_eos=True))
    return out


_WORDS = ("the a picture shows what where which colour shape object left right top bottom "
          "describe count tell me about this image scene detail small large near far").split()


def image_dataset(num: int, words: int, output_len: int, image_size: int, unique: int,
                  seed: int) -> list[Sample]:
    """Chat requests of `words` words of text and one PNG of image_size x image_size, drawn
    from `unique` distinct images (repeats are encoder-cache and prefix-cache hits)."""
    import base64
    import io

    from PIL import Image
    rng = np.random.default_rng(seed)
    urls = []
    for _ in range(max(1, unique)):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 255, (image_size, image_size, 3), dtype=np.uint8)).save(buf, "PNG")
        urls.append("data:image/png;base64," + base64.b64encode(buf.getvalue()).decode())
    return [Sample([], output_len, text=" ".join(rng.choice(_WORDS, words)), image=urls[i % len(urls)])
            for i in range(num)]
