"""Images in chat through a real server and the official `openai` client: a tiny LLaVA whose
tokenizer has an `<image>` token, images as data URLs (and as http URLs of an allowed host),
greedy output equal to HF's on the same pixels, the image's blocks cached on a repeat, and
the refusals as 400s."""
import base64
import functools
import http.server
import io
import os
import shutil
import threading

import numpy as np
import openai
import pytest

from server_util import SERVER_ENGINE, start_server, stop

VOCAB = 49216  # the tokenizer's 49152 tokens, <image>, and room


@pytest.fixture(scope="module")
def llava_server(tmp_path_factory, tokenizer_dir):
    import torch
    import transformers

    from models.test_llava import tiny_llava_config
    d = tmp_path_factory.mktemp("llava_chat")
    for name in os.listdir(tokenizer_dir):
        shutil.copy(os.path.join(tokenizer_dir, name), d / name)
    tok = transformers.AutoTokenizer.from_pretrained(str(d))
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    tok.save_pretrained(str(d))
    image_id = tok.convert_tokens_to_ids("<image>")
    cfg = tiny_llava_config()
    cfg.text_config.vocab_size = VOCAB
    cfg.image_token_index = image_id
    torch.manual_seed(0)
    hf = transformers.LlavaForConditionalGeneration(cfg).eval()
    hf.save_pretrained(str(d))
    # an http server on this machine for the allowed-host case
    pngs = tmp_path_factory.mktemp("pngs")
    (pngs / "cat.png").write_bytes(_png(3))

    class Files(http.server.SimpleHTTPRequestHandler):
        def do_GET(self):
            if self.path == "/elsewhere.png":  # an allowed host sending the server elsewhere
                self.send_response(302)
                self.send_header("Location", "http://169.254.169.254/latest/meta-data")
                self.end_headers()
                return
            super().do_GET()
    handler = functools.partial(Files, directory=str(pngs))
    files = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=files.serve_forever, daemon=True).start()
    proc, base, _ = start_server([str(d), "--dtype", "float32", *SERVER_ENGINE,
                                  "--allowed-media-domains", "127.0.0.1"],
                                 tmp_path_factory.mktemp("log") / "server.log")
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
    yield dict(client=client, hf=hf, tok=tok, path=str(d), image_id=image_id,
               model=client.models.list().data[0].id,
               files=f"http://127.0.0.1:{files.server_address[1]}")
    stop(proc)
    files.shutdown()


def _png(seed: int, size=(40, 30)) -> bytes:
    from PIL import Image
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 255, (*size, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def _url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


def _chat(s, url, text="What is in the picture?", **kw):
    content = [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": url}}]
    return s["client"].chat.completions.create(
        model=s["model"], messages=[{"role": "user", "content": content}], max_tokens=6,
        temperature=0, **kw)


def test_chat_with_an_image_equals_hf(llava_server):
    import torch

    from jaxllm.multimodal import ImageProcessor
    s = llava_server
    png = _png(1)
    r = _chat(s, _url(png))
    # HF on the template's text with the image's four tokens, and the same pixels
    text = s["tok"].apply_chat_template([{"role": "user", "content": "What is in the picture?<image>"}],
                                        tokenize=False, add_generation_prompt=True)
    ids = s["tok"].encode(text, add_special_tokens=False)
    at = ids.index(s["image_id"])
    ids = ids[:at] + [s["image_id"]] * 4 + ids[at + 1:]
    assert r.usage.prompt_tokens == len(ids)
    px = ImageProcessor.for_checkpoint(s["path"], {"image_size": 28})(png)
    with torch.no_grad():
        ref = s["hf"].generate(input_ids=torch.tensor([ids]), pixel_values=torch.tensor(px[None]),
                               max_new_tokens=6, do_sample=False, min_new_tokens=6)[0, len(ids):]
    assert r.choices[0].message.content == s["tok"].decode(ref, skip_special_tokens=True)
    # the same again: its blocks (image included) come from the prefix cache
    again = _chat(s, _url(png))
    assert again.usage.prompt_tokens_details.cached_tokens >= 16
    assert again.choices[0].message.content == r.choices[0].message.content


def test_an_allowed_host_is_fetched_and_may_not_redirect_elsewhere(llava_server):
    s = llava_server
    fetched = _chat(s, s["files"] + "/cat.png")
    inline = _chat(s, _url(_png(3)))
    assert fetched.choices[0].message.content == inline.choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="redirects to .*169.254.169.254"):
        _chat(s, s["files"] + "/elsewhere.png")


def test_without_max_tokens_the_image_tokens_count(llava_server):
    """The room left for output is counted with each image's four tokens, not its one
    placeholder."""
    s = llava_server
    content = [{"type": "text", "text": "Hi"}, {"type": "image_url", "image_url": {"url": _url(_png(4))}}]
    r = s["client"].chat.completions.create(model=s["model"], messages=[{"role": "user", "content": content}],
                                            temperature=0)
    assert r.usage.prompt_tokens + r.usage.completion_tokens <= 256


@pytest.mark.parametrize("url,match", [
    ("https://example.com/cat.png", "allowed-media-domains"),
    ("data:image/png;base64," + base64.b64encode(b"not a png").decode(), "does not decode"),
    ("ftp://example.com/cat.png", "data: URL or an http"),
    (_url(_png(0, (4, 300))), "too elongated"),
])
def test_bad_images_are_400s(llava_server, url, match):
    with pytest.raises(openai.BadRequestError, match=match):
        _chat(llava_server, url)


def test_image_detail_other_than_auto_is_a_400(llava_server):
    s = llava_server
    content = [{"type": "image_url", "image_url": {"url": _url(_png(1)), "detail": "high"}}]
    with pytest.raises(openai.BadRequestError, match="detail"):
        s["client"].chat.completions.create(model=s["model"], messages=[{"role": "user", "content": content}],
                                            max_tokens=2)


def test_too_many_images_is_a_400(llava_server):
    s = llava_server
    content = [{"type": "image_url", "image_url": {"url": _url(_png(i))}} for i in range(5)]
    with pytest.raises(openai.BadRequestError, match="at most 4 per prompt"):
        s["client"].chat.completions.create(model=s["model"], messages=[{"role": "user", "content": content}],
                                            max_tokens=2)


def test_bench_serve_image_workload(llava_server, tmp_path):
    """`jaxllm bench serve --dataset-name image`: chat requests with a 448x448 image each,
    two distinct images among four prompts (the repeats' image blocks are cache hits)."""
    import json

    from jaxllm.cli import main
    base = str(llava_server["client"].base_url).rstrip("/").removesuffix("/v1")
    assert main(["bench", "serve", "--base-url", base, "--dataset-name", "image", "--num-prompts", "4",
                 "--num-unique-images", "2", "--random-input-len", "5", "--random-output-len", "3",
                 "--max-concurrency", "1", "--save-result", "--results-dir", str(tmp_path),
                 "--tag", "img"]) == 0
    r = json.loads((tmp_path / "img.json").read_text())
    run = r["runs"][0]
    assert run["successful_requests"] == 4 and run["failed_requests"] == 0
    assert run["cached_token_fraction"] > 0
    assert r["workload"]["image_size"] == 448 and r["workload"]["num_unique_images"] == 2
