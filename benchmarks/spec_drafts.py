"""Draft models made from a target checkpoint, for tests and benchmarks: its first layers with
its own embedding, final norm and head (an early exit), written as an HF directory that shares
the target's tokenizer."""
from __future__ import annotations

import json
import os
import re
import shutil

import numpy as np

from jaxllm.loader.safetensors_io import checkpoint_files, read_safetensors

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "generation_config.json", "chat_template.jinja")


def truncated_draft(src: str, dst: str, num_layers: int) -> str:
    """Write the first `num_layers` decoder layers of the HF checkpoint `src` (plus embedding,
    final norm and head) to `dst`."""
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    if not 1 <= num_layers <= cfg["num_hidden_layers"]:
        raise ValueError(f"num_layers must be in [1, {cfg['num_hidden_layers']}], got {num_layers}")
    from safetensors.numpy import save_file
    keep = {}
    layer = re.compile(r"model\.layers\.(\d+)\.")
    for file in checkpoint_files(src):
        for name, t in read_safetensors(file).items():
            m = layer.match(name)
            if m is None or int(m.group(1)) < num_layers:
                keep[name] = np.ascontiguousarray(t)
    os.makedirs(dst, exist_ok=True)
    save_file(keep, os.path.join(dst, "model.safetensors"))
    cfg["num_hidden_layers"] = num_layers
    for key in ("layer_types", "max_window_layers"):
        if isinstance(cfg.get(key), list):
            cfg[key] = cfg[key][:num_layers]
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    for name in TOKENIZER_FILES:
        if os.path.exists(os.path.join(src, name)):
            shutil.copy(os.path.join(src, name), os.path.join(dst, name))
    return dst
