"""/dashboard in a real headless browser (Debian's chromium driven by Playwright): it loads without
console errors, its panels move while a load runs, prompts with markup stay text, its block map
counts equal /v1/internals, and it asks for the API key when it has none."""

from __future__ import annotations

import shutil
import threading
import time

import httpx
import pytest

from servescope.engine.async_engine import AsyncEngine
from servescope.engine.llm_engine import LLMEngine
from servescope.server.app import build_app
from .conftest import API_KEY, TINY_KEY
from .server_utils import LiveServer
from .test_internals_stream import _load

try:
    from playwright.sync_api import Error as PlaywrightError
    from playwright.sync_api import sync_playwright
except ImportError:  # optional: the tests say how to install it
    sync_playwright = PlaywrightError = None

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None or sync_playwright is None,
    reason="the browser tests need Chromium and Playwright: `apt-get install -y chromium` and "
           "`pip install playwright` (make test installs both where apt is available)")

EVIL = "<script>window.__pwned = 1</script><img src=x onerror=\"window.__pwned = 2\"> tell me"


@pytest.fixture(scope="module")
def browser():
    with sync_playwright() as pw:
        # --no-sandbox: CI runs as root, where Chromium's sandbox refuses to start
        b = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield b
        b.close()


def _open(browser, url: str, key=None, credentials=None):
    """key: given to the page in its URL (#key=, sent as Bearer on its feed); credentials: the key as
    the browser's HTTP Basic password, which the page itself needs (every route but /health does)."""
    credentials = credentials if credentials is not None else key
    page = browser.new_page(viewport={"width": 1400, "height": 1300},
                            http_credentials={"username": "viewer", "password": credentials} if credentials else None)
    errors = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(f"{url}/dashboard" + (f"#key={key}" if key else ""))
    return page, errors


def _wait(page, js: str, timeout_s: float = 60.0) -> None:
    """Poll a JS expression until it is true. (Playwright's wait_for_function evaluates its predicate
    with eval, which the page's Content-Security-Policy forbids, as it should.)"""
    deadline = time.monotonic() + timeout_s
    while not page.evaluate(js):
        assert time.monotonic() < deadline, f"the page never got to: {js}"
        page.wait_for_timeout(50)


def _last_step(page) -> int:
    return int(page.evaluate("Number(document.body.dataset.lastStep || 0)"))


def _painted(page, canvas_id: str) -> int:
    """How many pixels of a canvas are not blank."""
    return page.evaluate("""id => { const c = document.getElementById(id);
        const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data; let n = 0;
        for (let i = 3; i < d.length; i += 4) if (d[i] > 0) n++; return n; }""", canvas_id)


def test_panels_follow_a_load_and_prompts_stay_text(browser, tiny_server):
    page, errors = _open(browser, tiny_server.url, TINY_KEY)
    _wait(page, "document.getElementById('conn-text').textContent === 'live'")
    _wait(page, "document.body.dataset.lastStep !== undefined")
    results, seen, shown, done = [], [], False, threading.Event()

    def waves():  # waves of 8 requests until the page has been watched redrawing (it throttles its draws)
        while not done.is_set():
            results.extend(_load(tiny_server.url, 8, 96, prompt=EVIL))

    load = threading.Thread(target=waves)
    load.start()
    deadline = time.monotonic() + 60
    while (len(set(seen)) < 3 or not shown) and time.monotonic() < deadline:
        seen.append(_last_step(page))
        # a running request's prompt is shown, as the characters it holds
        shown = shown or page.evaluate("[...document.querySelectorAll('#q-running .prompt')]"
                                       ".some(e => e.textContent.includes('<script>'))")
        page.wait_for_timeout(100)
    done.set()
    load.join()
    assert results and results == [200] * len(results) and shown
    assert len(set(seen)) >= 3, f"the page drew {sorted(set(seen))} while the load ran"
    assert page.evaluate("window.__pwned") is None
    assert page.locator("script").count() == 1 and page.locator("main img").count() == 0
    # idle: the page's block map counts are the engine's
    snap = httpx.get(tiny_server.url + "/v1/internals?n=1", headers={"Authorization": f"Bearer {TINY_KEY}"}).json()
    _wait(page, f"Number(document.body.dataset.lastStep) >= {snap['steps'][-1]['step']}")
    page.wait_for_timeout(400)  # one more frame, so that the counts are of the idle state
    dom = {k: int(page.text_content(f"[data-testid=kv-{k}]")) for k in ("free", "used", "cached", "evictable", "total")}
    kv = snap["kv_cache"]
    assert dom["total"] == kv["num_blocks"] and dom["used"] == kv["blocks_used"]
    assert dom["free"] + dom["evictable"] == kv["blocks_free"]
    assert dom["cached"] + dom["evictable"] == kv["blocks_cached"] and dom["evictable"] > 0
    assert int(page.text_content("[data-testid=lat-finished]")) >= len(results)
    assert int(page.text_content("[data-testid=q-running]")) == 0
    for canvas in ("c-timeline", "c-roofline", "c-blocks", "c-ttft", "c-tpot", "c-itl", "c-throughput"):
        assert _painted(page, canvas) > 500, canvas
    assert page.locator("#panel-spec").is_hidden() and page.locator("#panel-comm").is_hidden()
    assert page.locator("#panel-moe").is_hidden()  # a dense model routes nothing
    assert errors == []
    page.close()


def test_without_the_key_the_browser_is_asked_for_it(browser, tiny_server):
    """The page needs the key too (every route but /health): its 401 asks the browser for Basic
    credentials, and the key given there as the password reaches the page's feed as well."""
    for credentials in (None, {"username": "viewer", "password": "wrong"}):
        page = browser.new_page(http_credentials=credentials)  # headless: a prompt nobody can answer
        try:  # Chromium shows the 401, or fails the navigation when its credentials were refused
            refused = page.goto(f"{tiny_server.url}/dashboard").status == 401
        except PlaywrightError as e:
            refused = "INVALID_AUTH_CREDENTIALS" in str(e)
        assert refused, credentials
        page.close()
    page, errors = _open(browser, tiny_server.url, credentials=TINY_KEY)
    _wait(page, "document.getElementById('conn-text').textContent === 'live'")
    assert page.locator("#keyform").is_hidden()
    assert errors == []
    page.close()


def test_the_embedded_model_live(browser, server):
    page, errors = _open(browser, server.url, API_KEY)
    _wait(page, "document.getElementById('conn-text').textContent === 'live'")
    headers = {"Authorization": f"Bearer {API_KEY}"}

    def ask(i):
        r = httpx.post(server.url + "/v1/chat/completions", headers=headers, timeout=300,
                       json={"model": "smollm2-135m", "max_tokens": 12, "temperature": 0,
                             "messages": [{"role": "user", "content": f"Name a colour ({i})."}]})
        assert r.status_code == 200

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    _wait(page, "Number(document.querySelector('[data-testid=lat-finished]').textContent) >= 3")
    assert "smollm2-135m" in page.text_content("#what") and "roofline of" in page.text_content("#what")
    assert _painted(page, "c-roofline") > 500 and _painted(page, "c-blocks") > 500
    assert errors == []
    page.close()


def test_a_replayed_trace_in_the_page(browser):
    from telemetry.test_trace import _outputs, _records  # tests/ is on sys.path (the packages under it)

    from servescope.server.background import BackgroundServer
    from servescope.server.replay import ReplaySource, build_replay_app
    from servescope.telemetry.trace import chrome_trace
    from servescope.telemetry.trace_replay import read_recorded_run

    run = read_recorded_run(chrome_trace(_records(), _outputs()))
    srv = BackgroundServer(build_replay_app(ReplaySource(run, "t.json", speed=1.0))).start()
    try:
        page, errors = _open(browser, srv.url)
        _wait(page, "Number(document.body.dataset.lastStep) === 3")
        assert page.text_content("#what").startswith("replay of t.json (1× speed)")
        assert "only the counts" in page.text_content("#kv-note")
        assert page.text_content("[data-testid=kv-used]") == "5" and page.text_content("[data-testid=kv-total]") == "10"
        _wait(page, "document.querySelector('[data-testid=lat-finished]').textContent === '1'")
        assert errors == []
        page.close()
    finally:
        srv.stop()


def test_a_replayed_expert_parallel_trace_shows_each_ranks_load(browser):
    """A trace of a mixture of experts under expert parallelism (telemetry/test_trace.moe_records: 2 ranks, 9 and 3
    rows): the replay draws the expert panel with the ranks' rows, their imbalance and the all-to-alls' share."""
    from telemetry.test_trace import moe_records

    from servescope.server.background import BackgroundServer
    from servescope.server.replay import ReplaySource, build_replay_app
    from servescope.telemetry.trace import chrome_trace
    from servescope.telemetry.trace_replay import read_recorded_run

    run = read_recorded_run(chrome_trace(moe_records()))
    srv = BackgroundServer(build_replay_app(ReplaySource(run, "ep.json", speed=1.0))).start()
    try:
        page, errors = _open(browser, srv.url)
        _wait(page, "Number(document.body.dataset.lastStep) === 3")
        assert page.locator("#panel-moe").is_visible() and page.locator("#moe-ep").is_visible()
        assert page.text_content("[data-testid=moe-experts]") == "4"
        assert page.text_content("[data-testid=moe-ep-ranks]") == "2"
        assert page.text_content("[data-testid=moe-ep-rows]") == "9 / 3"
        assert page.text_content("[data-testid=moe-ep-imbalance]") == "1.50×"
        assert page.text_content("[data-testid=moe-ep-a2a]") == "20%"  # 1 ms of the 5 ms step
        assert _painted(page, "c-moe-load") > 300 and errors == []
        page.close()
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def moe_server(tmp_path_factory):
    from tiny_models import make_tiny_hf_model  # tests/model is on sys.path (tests/conftest.py)

    path = make_tiny_hf_model(tmp_path_factory.mktemp("dash-moe"), "qwen3_moe")
    ae = AsyncEngine(LLMEngine(model=str(path), num_kv_blocks=96, block_size=8, max_model_len=256, max_num_seqs=8,
                               max_num_batched_tokens=128))
    s = LiveServer(build_app(ae, model_name="tiny", api_key=TINY_KEY)).start()
    yield s, ae.engine.model_config
    s.stop()
    ae.shutdown()


def test_a_moe_models_expert_panel(browser, moe_server):
    server, cfg = moe_server
    page, errors = _open(browser, server.url, TINY_KEY)
    _wait(page, "document.getElementById('conn-text').textContent === 'live'")
    assert page.locator("#panel-moe").is_hidden()  # nothing routed yet
    assert _load(server.url, 6, 16) == [200] * 6
    _wait(page, "!document.getElementById('panel-moe').classList.contains('hidden')")
    snap = httpx.get(server.url + "/v1/internals?n=1", headers={"Authorization": f"Bearer {TINY_KEY}"}).json()
    _wait(page, f"Number(document.body.dataset.lastStep) >= {snap['steps'][-1]['step']}")
    assert int(page.text_content("[data-testid=moe-experts]")) == cfg.moe.experts.num_experts
    assert page.text_content("[data-testid=moe-imbalance]").endswith("×")
    assert _painted(page, "c-moe-active") > 300 and _painted(page, "c-moe-load") > 300
    assert page.locator("#panel-spec").is_hidden() and page.locator("#moe-ep").is_hidden() and errors == []
    page.close()

