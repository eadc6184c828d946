"""The chat page and the live dashboard in a real headless Chromium, against a real `jaxllm
serve` on loopback that requires an API key and serves a LoRA adapter: a message streams in
and equals the API's answer, a long reply is stopped and its request aborted, the model is
switched to the adapter, model output never becomes markup, and the dashboard's numbers move
while requests run. Prometheus itself scrapes the same server and answers every query of the
Grafana dashboard in docs/grafana. Screenshots of both pages are written to the test's folder
(and to --web-screenshots DIR when given). The module is named to sort early: the suite runs
modules in file-name order, and a long one last would leave the other worker idle."""
import json
import re
import shutil
import subprocess
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from browser_util import chromium, ensure_debian_packages
from lora_util import make_adapter
from server_util import free_port, metric, start_server, stop, wait_for as wait

pytestmark = pytest.mark.slow

MODEL, ADAPTER, KEY = "tiny", "ad0", "page-key"
# the engine of the LoRA server tests: its programs come from the shared compilation cache
ENGINE = ["--max-model-len", "256", "--max-num-seqs", "8", "--max-num-batched-tokens", "64",
          "--token-buckets", "16,64", "--seq-buckets", "4,8",
          "--enable-lora", "--max-loras", "3", "--max-lora-rank", "16"]
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    d = tmp_path_factory.mktemp("web_ui")
    make_adapter(d / ADAPTER, tiny_llama, seed=20, r=8, lora_alpha=16,
                 target_modules=["q_proj", "v_proj", "down_proj"])
    proc, base, _ = start_server([tiny_llama, "--served-model-name", MODEL, *ENGINE,
                                  "--lora-modules", f"{ADAPTER}={d / ADAPTER}",
                                  "--api-key", KEY], d / "server.log")
    yield base
    stop(proc)


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    driver = chromium(tmp_path_factory.getbasetemp().parent)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def shots(tmp_path_factory, request):
    """Where screenshots go: the test's folder, and --web-screenshots DIR when given."""
    dirs = [tmp_path_factory.mktemp("screenshots")]
    extra = request.config.getoption("--web-screenshots")
    if extra:
        Path(extra).mkdir(parents=True, exist_ok=True)
        dirs.append(Path(extra))
    return dirs


def screenshot(driver, dirs, name):
    png = driver.get_screenshot_as_png()
    for d in dirs:
        (Path(d) / name).write_bytes(png)
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000


def client(base):
    return openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0)


def test_pages_are_small_self_contained_and_public(server):
    """The pages and their files need no key, no build and nothing from elsewhere; the API
    behind them still needs the key."""
    total = 0
    for path in ("/", "/dashboard"):
        r = httpx.get(server + path)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
        assert "default-src 'self'" in r.headers["content-security-policy"]
        total += len(r.content)
        refs = re.findall(r'(?:src|href)="([^"]+)"', r.text)
        assert refs and all(ref.startswith("/") for ref in refs), refs
        for ref in refs:
            if ref.startswith("/web/"):
                asset = httpx.get(server + ref)
                assert asset.status_code == 200, ref
                total += len(asset.content)
    assert total < 64 * 1024
    assert httpx.get(server + "/v1/models").status_code == 401
    assert httpx.get(server + "/web/%2e%2e/app.py").status_code == 404  # no way out of serve/web


def page_state(driver) -> dict:
    return driver.execute_script("return JSON.parse(localStorage.getItem('jaxllm.chat') || '{}')")


def replies(driver):
    return driver.find_elements("css selector", ".msg.assistant")


def set_field(driver, field, value):
    el = driver.find_element("id", field)
    el.clear()
    el.send_keys(str(value))
    driver.execute_script("arguments[0].dispatchEvent(new Event('change'))", el)


def send(driver, text):
    box = driver.find_element("id", "input")
    box.send_keys(text)
    driver.find_element("id", "send").click()


def test_chat_streams_stops_and_switches_model(server, browser, shots):
    api = client(server)
    browser.get(server + "/")
    browser.execute_script("localStorage.clear()")
    browser.get(server + "/")
    # without the key the page says so and opens its settings
    notice = wait(lambda: browser.find_element("id", "notice").text, what="the key notice")
    assert "API key" in notice
    set_field(browser, "api_key", KEY)
    options = wait(lambda: [o.get_attribute("value") for o in
                            browser.find_elements("css selector", "#model option")],
                   what="the models")
    assert options == [MODEL, ADAPTER]
    system = "You are terse."
    set_field(browser, "system", system)
    set_field(browser, "temperature", 0)
    set_field(browser, "max_tokens", 12)
    set_field(browser, "seed", 7)

    # one message: the reply streams in and is exactly the API's answer to the same request
    send(browser, "Hello there")
    reply = wait(lambda: [r for r in replies(browser) if r.get_attribute("data-done")],
                 what="the first reply")[0]
    stored = page_state(browser)["messages"]
    asked = [{"role": "system", "content": system}, {"role": "user", "content": "Hello there"}]
    want = api.chat.completions.create(model=MODEL, messages=asked, temperature=0, max_tokens=12, seed=7)
    assert stored[-1]["content"] == want.choices[0].message.content
    assert float(reply.get_attribute("data-ttft-ms")) > 0
    assert f"{want.usage.completion_tokens} tokens" in reply.find_element("css selector", ".stats").text
    assert "TTFT" in reply.text

    # a long reply: text is seen arriving before it ends, then stop aborts it on the server
    set_field(browser, "max_tokens", 200)
    ran_out = metric(server, "request_success_total", model_name=MODEL, finished_reason="length")
    send(browser, "Tell me a long story")
    streaming = wait(lambda: [r for r in replies(browser)[1:]
                              if "streaming" in r.get_attribute("class") and r.text.strip()],
                     every=0.01, what="streamed text")
    assert streaming
    browser.find_element("id", "stop").click()
    stopped = wait(lambda: [r for r in replies(browser)[1:] if r.get_attribute("data-done")],
                   what="the stopped reply")[0]
    assert "stopped" in stopped.find_element("css selector", ".stats").text
    wait(lambda: metric(server, "num_requests_running") == 0, what="the abort")
    # aborted, not run to its 200 tokens
    assert metric(server, "request_success_total", model_name=MODEL, finished_reason="length") == ran_out
    partial = page_state(browser)["messages"][-1]["content"]
    assert 0 < len(partial)

    # the adapter answers the conversation so far, as the API says it would
    from selenium.webdriver.support.ui import Select
    Select(browser.find_element("id", "model")).select_by_value(ADAPTER)
    set_field(browser, "max_tokens", 10)
    before = metric(server, "request_success_total", model_name=ADAPTER)
    send(browser, "And now?")
    wait(lambda: len([r for r in replies(browser) if r.get_attribute("data-done")]) == 3,
         what="the adapter's reply")
    stored = page_state(browser)["messages"]
    assert stored[-2]["content"] == "And now?"
    history = [{"role": "system", "content": system}] + [
        {"role": m["role"], "content": m["content"]} for m in stored[:-1]]
    want = api.chat.completions.create(model=ADAPTER, messages=history, temperature=0,
                                       max_tokens=10, seed=7)
    assert stored[-1]["content"] == want.choices[0].message.content
    assert metric(server, "request_success_total", model_name=ADAPTER) == before + 2
    # the conversation outlives a reload: it is kept in the browser
    browser.refresh()
    wait(lambda: len(replies(browser)) == 3, what="the kept conversation")
    screenshot(browser, shots, "chat.png")


def test_model_output_never_becomes_markup(server, browser):
    browser.get(server + "/")
    # the page's own scripts are deferred: the renderer exists once they have run
    wait(lambda: browser.execute_script("return typeof Markdown !== 'undefined'"),
         timeout=30, what="the page's markdown.js")
    got = browser.execute_script("""
        const text = "# Title\\nSome **bold** and `code` <img src=x onerror=alert(1)> and"
          + " <script>alert(2)</script>\\n[bad](javascript:alert(3)) [good](https://example.org)"
          + "\\n```html\\n<b>not bold</b>\\n```\\n- one\\n- two";
        const box = document.createElement("div");
        box.append(Markdown.render(text));
        return {
          tags: [...box.querySelectorAll("*")].map((e) => e.tagName.toLowerCase()),
          hrefs: [...box.querySelectorAll("a")].map((a) => a.getAttribute("href")),
          text: box.textContent,
          code: box.querySelector("pre code").textContent,
        };""")
    assert not {"img", "script", "b"} & set(got["tags"])
    assert {"h3", "strong", "code", "pre", "ul", "li", "a"} <= set(got["tags"])
    assert got["hrefs"] == ["https://example.org"]
    assert "<img src=x onerror=alert(1)>" in got["text"] and "<script>alert(2)</script>" in got["text"]
    assert "[bad](javascript:alert(3))" in got["text"]
    assert got["code"] == "<b>not bold</b>"


def load(base, stop_event, streams=8):
    """Streams at once until told to stop (the dashboard's load)."""
    api = client(base)

    def one(i):
        while not stop_event.is_set():
            for _ in api.chat.completions.create(
                    model=MODEL if i % 2 else ADAPTER, stream=True, max_tokens=48, temperature=0.8,
                    messages=[{"role": "user", "content": f"request {i}"}]):
                pass
    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(streams)]
    for t in threads:
        t.start()
    return threads


def shown(driver, key):
    el = driver.find_element("css selector", f'[data-key="{key}"]')
    assert el.is_displayed(), f"the {key} panel is hidden"
    return el.text


def test_dashboard_moves_under_load(server, browser, shots):
    browser.get(server + "/dashboard")
    wait(lambda: browser.find_element("id", "status").get_attribute("data-updated"),
         what="the first update")
    assert browser.find_element("id", "model").text.startswith(MODEL)
    stop_event = threading.Event()
    threads = load(server, stop_event)
    try:
        wait(lambda: shown(browser, "generation_tps") not in ("–", "0.0"), what="tokens per second")
        wait(lambda: shown(browser, "running") not in ("–", "0"), what="running requests")
        wait(lambda: shown(browser, "ttft_p50") != "–", what="a TTFT percentile")
        wait(lambda: shown(browser, "kv_usage") not in ("–", "0%"), what="KV usage")
        wait(lambda: shown(browser, "itl_p99") != "–", what="an inter-token latency percentile")
        wait(lambda: shown(browser, "lora_total") not in ("–", "0"), what="adapter requests")
        # some seconds of history on the charts before the picture
        wait(lambda: sum(p["generation_tps"] > 0 for p in
                         httpx.get(server + "/dashboard/data").json()["points"]) >= 15,
             every=1, what="fifteen seconds of load")
        screenshot(browser, shots, "dashboard.png")
    finally:
        stop_event.set()
        for t in threads:
            t.join(timeout=60)
    # the feed is the server's Prometheus counters, not its own bookkeeping
    data = httpx.get(server + "/dashboard/data").json()
    assert data["info"]["model"] == MODEL and data["info"]["adapters"] == [ADAPTER]
    assert data["info"]["max_lora"] == 3
    assert max(p["generation_tps"] for p in data["points"]) > 0
    assert any(p["lora_running"].get(ADAPTER, 0) > 0 for p in data["points"] if "lora_running" in p)
    # the points after a given one, as the page asks for them
    since = data["points"][-3]["t"]
    after = [p["t"] for p in httpx.get(server + f"/dashboard/data?since={since}").json()["points"]]
    assert after[:2] == [p["t"] for p in data["points"][-2:]]
    assert httpx.get(server + "/dashboard/data?since=soon").status_code == 400


def test_prometheus_answers_every_grafana_query(server, tmp_path_factory):
    """The README's scrape config on a real Prometheus: each query of the Grafana dashboard
    is valid PromQL on what the server exposes, and the main panels have data."""
    paths = ensure_debian_packages(["prometheus"], ["prometheus"], tmp_path_factory.getbasetemp().parent)
    d = tmp_path_factory.mktemp("prometheus")
    port = free_port()
    host = server.removeprefix("http://")
    (d / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s}\n"
        "scrape_configs:\n"
        f"  - {{job_name: jaxllm, static_configs: [{{targets: ['{host}']}}]}}\n")
    prom = subprocess.Popen([paths["prometheus"], f"--config.file={d / 'prometheus.yml'}",
                             f"--storage.tsdb.path={d / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=open(d / "prometheus.log", "w"), stderr=subprocess.STDOUT)
    api = f"http://127.0.0.1:{port}/api/v1/query"
    stop_event = threading.Event()
    threads = []
    try:
        def up():
            try:
                r = httpx.get(api, params={"query": "up"}).json()
                return r["data"]["result"] and r["data"]["result"][0]["value"][1] == "1"
            except (httpx.HTTPError, ValueError, KeyError):
                return False
        wait(up, timeout=60, every=0.5, what="Prometheus scraping the server")
        threads = load(server, stop_event, streams=4)
        time.sleep(6)  # a few scrapes while requests run
        dashboard = json.loads((REPO / "docs/grafana/jaxllm.json").read_text())
        answered = {}
        for panel in dashboard["panels"]:
            for target in panel["targets"]:
                expr = target["expr"].replace("$__rate_interval", "5s").replace("$model_name", ".*")
                r = httpx.get(api, params={"query": expr}).json()
                assert r["status"] == "success", (panel["title"], expr, r)
                answered[panel["title"]] = answered.get(panel["title"], 0) + len(r["data"]["result"])
        for title in ("Requests running and waiting", "KV cache: used and wasted",
                      "Tokens per second", "Time to first token", "Inter-token latency",
                      "LoRA adapters: running requests"):
            assert answered[title] > 0, (title, answered)
    finally:
        stop_event.set()
        for t in threads:
            t.join(timeout=60)
        prom.terminate()
        prom.wait(timeout=30)
    shutil.rmtree(d / "data", ignore_errors=True)
