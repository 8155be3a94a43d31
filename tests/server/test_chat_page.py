"""The chat page at GET / in a real browser: Debian's chromium, driven by Selenium through
/usr/bin/chromedriver (never a downloaded driver), against a `ds2 serve` of ds2-tiny on
localhost. Where chromium is not installed, the tests skip and say how to install it."""

import os
import shutil
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

import ds2cli
from test_serve import logged, running, serve_process

CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
    pytest.skip("the chat page's browser test needs Debian's chromium and chromedriver: "
                "sudo apt-get install chromium chromium-driver", allow_module_level=True)
webdriver = pytest.importorskip("selenium.webdriver", reason="the test extra: pip install '.[test]'")
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

pytestmark = pytest.mark.slow      # left out of `pytest -m "not slow"` (docs/internals.md, Tests)

QUESTION, ANSWER = "What is 451 - 123?", "451 - 123 = 328."
WAIT_S = 60


@pytest.fixture(scope="module")
def browser():
    """One headless chromium for the module (each test's server has its own port, so its own origin)."""
    profile = tempfile.mkdtemp(prefix="ds2-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", f"--user-data-dir={profile}"):
        options.add_argument(flag)
    # the driver's path given outright, so Selenium Manager never looks for (or downloads) one
    driver = webdriver.Chrome(service=Service(executable_path=str(CHROMEDRIVER)), options=options)
    driver.set_page_load_timeout(WAIT_S)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def ask(driver, text, temperature="0"):
    """Set the page's temperature, type `text`, send it; return the assistant's answer once done."""
    field = driver.find_element(By.ID, "temperature")
    field.clear()
    field.send_keys(temperature)
    done = len(driver.find_elements(By.CSS_SELECTOR, ".msg.assistant[data-done]"))
    driver.find_element(By.ID, "input").send_keys(text)
    driver.find_element(By.ID, "send").click()
    wait = WebDriverWait(driver, WAIT_S)
    reply = wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".msg.assistant[data-done]")[done:])[0]
    return reply.get_attribute("data-done"), reply.find_element(By.CLASS_NAME, "text").text


def test_the_page_streams_an_answer_and_shows_the_stats(browser):
    with serve_process() as (proc, port):
        browser.get(f"http://127.0.0.1:{port}/")
        assert browser.title == "ds2 chat"
        WebDriverWait(browser, WAIT_S).until(lambda d: "ds2-tiny" in d.find_element(By.ID, "model").text)
        assert browser.find_element(By.ID, "key-panel").get_attribute("hidden") is not None   # no key asked
        done, text = ask(browser, QUESTION)
        assert (done, text) == ("stop", ANSWER)
        stats = browser.find_element(By.ID, "stats").text
        assert "tok/s" in stats and "0 cached" in stats
        done, text = ask(browser, "What is 17 + 25?")       # the second turn starts from the prompt cache
        assert done == "stop" and text == "17 + 25 = 42."
        cached = int(browser.find_element(By.ID, "stats").text.split(" cached")[0].rsplit(" ", 1)[1])
        assert cached > 0


def test_the_page_asks_for_the_key_when_the_server_has_one(browser):
    key = "sk-page-test"
    env_key = os.environ.pop("DS2_API_KEY", None)
    try:
        with serve_process("--api-key", key) as (proc, port):
            browser.get(f"http://127.0.0.1:{port}/")
            wait = WebDriverWait(browser, WAIT_S)
            wait.until(lambda d: d.find_element(By.ID, "key-panel").is_displayed())
            browser.find_element(By.ID, "api-key").send_keys("wrong")
            browser.find_element(By.ID, "key-save").click()
            wait.until(lambda d: "refused" in d.find_element(By.ID, "key-error").text)
            browser.find_element(By.ID, "api-key").send_keys(key)
            browser.find_element(By.ID, "key-save").click()
            wait.until(lambda d: not d.find_element(By.ID, "key-panel").is_displayed())
            assert ask(browser, QUESTION) == ("stop", ANSWER)
    finally:
        if env_key is not None:
            os.environ["DS2_API_KEY"] = env_key


def test_stop_ends_a_reply_mid_stream(browser, monkeypatch):
    """ds2-tiny's answers are short: this server ignores eos and pauses between tokens, so that
    the reply is still streaming when Stop is pressed; the server sees the client go."""
    import ds2cli
    from ds2cli.server import scheduler as engine_module

    class Endless(engine_module.Generation):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.eos = set()

        def take(self, logits):
            time.sleep(0.02)
            return super().take(logits)
    monkeypatch.setattr(engine_module, "Generation", Endless)
    with running(ds2cli.load(), api_key=None) as (port, _, lines):
        browser.get(f"http://127.0.0.1:{port}/")
        browser.find_element(By.ID, "input").send_keys(QUESTION)
        browser.find_element(By.ID, "send").click()
        wait = WebDriverWait(browser, WAIT_S)
        wait.until(lambda d: len(d.find_element(By.CSS_SELECTOR, ".msg.assistant .text").text) > 40)
        browser.find_element(By.ID, "stop").click()
        reply = wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".msg.assistant[data-done]"))[-1]
        assert reply.get_attribute("data-done") == "stopped"
        assert browser.find_element(By.ID, "send").is_enabled() and not browser.find_element(By.ID, "stop").is_enabled()
        assert logged(lines, "client gone")


@contextmanager
def loading(state):
    """Hold a running server where `ds2 serve` is while its model loads: listening, no scheduler
    yet (/health 503 "loading", the API 503 with Retry-After), as test_serve_edges does; the load
    ends when the block does."""
    loaded = state.scheduler, state.defaults
    state.scheduler = state.defaults = None
    try:
        yield
    finally:
        state.defaults, state.scheduler = loaded[1], loaded[0]     # the scheduler last, as serve does


def shown(element_id):
    return lambda d: d.find_element(By.ID, element_id).is_displayed() and d.find_element(By.ID, element_id)


def test_while_the_model_loads_the_page_says_so_and_sends_nothing_until_it_has(browser):
    with running(ds2cli.load(), api_key=None) as (port, state, lines):
        with loading(state):
            browser.get(f"http://127.0.0.1:{port}/")
            wait = WebDriverWait(browser, WAIT_S)
            assert "Loading the model" in wait.until(shown("status")).text
            assert not browser.find_element(By.ID, "send").is_enabled()
            browser.find_element(By.ID, "input").send_keys(QUESTION, Keys.ENTER)   # Enter sends nothing either
            # the page keeps asking /health (every second, as its Retry-After says) while it is 503
            wait.until(lambda d: sum('"GET /health" 503' in line for line in lines) >= 3)
            assert "Loading the model" in browser.find_element(By.ID, "status").text
            assert not browser.find_element(By.ID, "send").is_enabled()
            assert not browser.find_elements(By.CSS_SELECTOR, ".msg")
            assert browser.find_element(By.ID, "input").get_attribute("value") == QUESTION   # kept, not sent
            assert not any("/v1/chat/completions" in line for line in lines)
        # the load has ended: the status line goes, Send opens, the model's name is shown
        wait.until(lambda d: not d.find_element(By.ID, "status").is_displayed())
        wait.until(lambda d: d.find_element(By.ID, "send").is_enabled())
        wait.until(lambda d: "ds2-tiny" in d.find_element(By.ID, "model").text)
        browser.find_element(By.ID, "input").clear()
        assert ask(browser, QUESTION) == ("stop", ANSWER)


def test_a_send_that_meets_a_loading_server_says_so_and_keeps_the_message(browser):
    """The page had seen the model loaded, then the server answers 503 "loading" (restarted under
    it): the reply says the model is loading, not "error", and the message goes back in the box."""
    with running(ds2cli.load(), api_key=None) as (port, state, lines):
        browser.get(f"http://127.0.0.1:{port}/")
        wait = WebDriverWait(browser, WAIT_S)
        wait.until(lambda d: d.find_element(By.ID, "send").is_enabled())
        with loading(state):
            browser.find_element(By.ID, "input").send_keys(QUESTION)
            browser.find_element(By.ID, "send").click()
            reply = wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".msg.assistant[data-done]"))[-1]
            assert reply.get_attribute("data-done") == "loading"
            assert "still loading" in reply.text and "error" not in reply.get_attribute("class")
            assert not browser.find_elements(By.CSS_SELECTOR, ".msg.user")
            assert browser.find_element(By.ID, "input").get_attribute("value") == QUESTION
            assert "Loading the model" in wait.until(shown("status")).text
            assert not browser.find_element(By.ID, "send").is_enabled()
        wait.until(lambda d: d.find_element(By.ID, "send").is_enabled())
        assert not browser.find_element(By.ID, "status").is_displayed()
        browser.find_element(By.ID, "input").clear()
        assert ask(browser, QUESTION) == ("stop", ANSWER)
        assert len(browser.find_elements(By.CSS_SELECTOR, ".msg.user")) == 1
