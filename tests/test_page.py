"""The chat page at `/`, driven in headless Chromium (selenium, Debian's chromium and
chromium-driver) against a live server on loopback: the key dialog, a streamed reply with its
reasoning apart, stop, new conversation. Skips where Chromium, its driver or selenium is missing."""
from __future__ import annotations

import os
import shutil
import tempfile
import time

import pytest

pytest.importorskip("uvicorn")
webdriver = pytest.importorskip("selenium.webdriver")

from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

from test_server import Running  # noqa: E402

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(not (CHROMIUM and DRIVER), reason="needs chromium and chromedriver (apt)")

KEY = "page-key"
REPLY = "<think>\nThe user greets me.\n</think>\n\nHello there, friend."


@pytest.fixture(scope="module")
def served(tiny_qwen3_vault):
    """The tiny vault under Qwen3's template (reasoning), with an API key."""
    s = Running(tiny_qwen3_vault, max_batch=2, api_key=KEY)
    yield s
    s.close()


@pytest.fixture(scope="module")
def browser():
    from selenium.webdriver.chrome.service import Service
    profile = tempfile.mkdtemp(prefix="pysmoe-chromium-")
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", f"--user-data-dir={profile}", "--window-size=1100,800"):
        opts.add_argument(flag)
    os.environ.setdefault("SE_OFFLINE", "true")  # never let selenium look for a driver online
    # the driver and the browser are not ours to sanitize: `make asan`'s preloaded runtimes abort them
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "ASAN_OPTIONS", "UBSAN_OPTIONS")}
    drv = webdriver.Chrome(service=Service(DRIVER, env=env), options=opts)
    yield drv
    drv.quit()
    shutil.rmtree(profile, ignore_errors=True)


def _script(monkeypatch, served, text, delay=0.0, seen=None):
    """The model 'says' text then an end-of-sequence id (each engine step still runs; only the
    choice is forced), optionally slowly; seen collects each request's messages."""
    from pysmoe.server.text import RequestText
    tok = served.vault.tokenizer
    ids = tok.encode(text) + [tok.eos_ids[0]]

    def step(self, token, logits=None):
        if seen is not None and not self.gen.tokens:
            seen.append(self.req.messages)
        time.sleep(delay)
        return self.gen.push(ids[min(len(self.gen.tokens), len(ids) - 1)], logits)

    monkeypatch.setattr(RequestText, "step", step)


def _wait(drv, cond, what):
    try:
        return WebDriverWait(drv, 60, poll_frequency=0.05).until(lambda d: cond(d), message=what)
    except Exception:
        raise AssertionError(f"waiting for {what}: the page shows {drv.find_element(By.TAG_NAME, 'body').text!r}")


def _send(drv, text):
    box = drv.find_element(By.ID, "prompt")
    box.click()  # after the modal key dialog, keys go nowhere until the box is clicked
    box.send_keys(text)
    drv.find_element(By.ID, "send").click()


def _assistants(drv):
    return drv.find_elements(By.CSS_SELECTOR, ".msg.assistant")


def test_the_page_chats_with_the_server(served, browser, monkeypatch, tmp_path):
    seen = []
    _script(monkeypatch, served, REPLY, seen=seen)
    drv = browser
    drv.get(served.base_url.rsplit("/v1", 1)[0] + "/")
    assert drv.title == "pysmoe"
    # the server has a key: the page asks for it
    _wait(drv, lambda d: d.find_element(By.ID, "key-dialog").get_attribute("open") is not None, "the key dialog")
    drv.find_element(By.ID, "key-input").send_keys(KEY)
    drv.find_element(By.ID, "key-save").click()
    _wait(drv, lambda d: d.find_element(By.ID, "model").text == served.server.model, "the model's name")

    _send(drv, "Hi!")
    _wait(drv, lambda d: _assistants(d) and _assistants(d)[-1].get_attribute("data-finish"), "the reply")
    msg = _assistants(drv)[-1]
    assert msg.get_attribute("data-finish") == "stop"
    assert msg.find_element(By.CSS_SELECTOR, ".answer").text == "Hello there, friend."
    thought = msg.find_element(By.CSS_SELECTOR, "details.reasoning")
    assert thought.is_displayed()
    assert thought.get_attribute("textContent").endswith("The user greets me.")
    assert seen[-1] == [{"role": "user", "content": "Hi!"}]
    drv.save_screenshot(str(tmp_path / "page.png"))
    if os.environ.get("PYSMOE_PAGE_SCREENSHOT"):
        shutil.copy(tmp_path / "page.png", os.environ["PYSMOE_PAGE_SCREENSHOT"])

    _send(drv, "Again?")  # the second turn carries the first
    _wait(drv, lambda d: len(_assistants(d)) == 2 and _assistants(d)[-1].get_attribute("data-finish"), "reply 2")
    assert [m["role"] for m in seen[-1]] == ["user", "assistant", "user"]
    assert seen[-1][1]["content"] == "Hello there, friend."

    drv.find_element(By.ID, "new").click()  # a new conversation
    assert not drv.find_elements(By.CSS_SELECTOR, ".msg")
    _send(drv, "Fresh.")
    _wait(drv, lambda d: _assistants(d) and _assistants(d)[-1].get_attribute("data-finish"), "reply 3")
    assert seen[-1] == [{"role": "user", "content": "Fresh."}]


def test_stop_ends_the_reply_and_frees_the_server(served, browser, monkeypatch):
    _script(monkeypatch, served, "word " * 400, delay=0.05)  # 20 s unless stopped
    drv = browser
    if not drv.current_url.startswith(served.base_url.rsplit("/v1", 1)[0]):
        pytest.skip("runs after test_the_page_chats_with_the_server")
    drv.find_element(By.ID, "new").click()
    _send(drv, "Talk a lot.")
    _wait(drv, lambda d: _assistants(d) and "word" in _assistants(d)[-1].text, "the first words")
    assert drv.find_element(By.ID, "stop").is_displayed()
    drv.find_element(By.ID, "stop").click()
    _wait(drv, lambda d: _assistants(d)[-1].get_attribute("data-finish"), "the stopped reply")
    msg = _assistants(drv)[-1]
    assert msg.get_attribute("data-finish") == "stopped" and "(stopped)" in msg.text
    assert drv.find_element(By.ID, "send").is_displayed()
    assert served.wait_idle()["running"] == 0  # the server cancelled the job
