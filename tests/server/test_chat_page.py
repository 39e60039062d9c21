"""The chat page at / in a real browser: Debian's headless chromium, driven by selenium through
Debian's chromedriver, against a real `llambda serve` with a tiny random model on loopback.

tools/setup-system.sh installs chromium and chromium-driver when run as root; without them the
tests skip with one line. Every wait is bounded (WebDriverWait, the server helper's deadlines).
"""
import json
import shutil

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
if CHROMIUM is None or CHROMEDRIVER is None:
    pytest.skip("no chromium/chromedriver (Debian's chromium and chromium-driver; tools/setup-system.sh "
                "installs them as root)", allow_module_level=True)
webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (the test extra has it)")
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import WebDriverWait

from synth import write_random_llama
from server_process import ServerProcess

N_CTX = 32768           # room for a reply that outlasts the test's look at it, even on a fast host
LONG_REPLY = N_CTX - 256
WAIT_S = 60
API_KEY = "sk-chat-page-test"

# The random model ends a reply whenever it samples end-of-generation. The page sends what
# OpenAI's API knows; this adds llama.cpp's ignore_eos to its requests, so a reply runs to its
# max_tokens (the short one has a known length, the long one is still running when stopped).
IGNORE_EOS = """
const fetchAsThePageDoes = window.fetch;
window.fetch = (url, init) => {
  if (url === "/v1/chat/completions") {
    init = {...init, body: JSON.stringify({...JSON.parse(init.body), ignore_eos: true})};
  }
  return fetchAsThePageDoes(url, init);
};
"""


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("chat-page") / "tiny.gguf"
    write_random_llama(path, n_layer=2, dim=64, n_head=4, n_kv_head=2, ffn_dim=96, vocab_size=300,
                       tensor_type="Q8_0", n_ctx=N_CTX, seed=11)
    return path


@pytest.fixture(scope="module")
def server(model_path):
    s = ServerProcess(model_path, "--ctx", str(N_CTX), "--parallel", "1", "--threads", "1")
    yield s
    assert s.stop() == 0, "".join(s.log)


@pytest.fixture(scope="module")
def keyed(model_path):
    s = ServerProcess(model_path, "--ctx", "256", "--parallel", "1", "--threads", "1", "--api-key", API_KEY,
                      headers={"Authorization": f"Bearer {API_KEY}"})
    yield s
    assert s.stop() == 0, "".join(s.log)


@pytest.fixture
def browser(tmp_path, monkeypatch):
    monkeypatch.setenv("SE_OFFLINE", "true")            # Selenium Manager never downloads a driver
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    # this machine has no internet: nothing in the background may try to reach it
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", "--window-size=1000,900", f"--user-data-dir={tmp_path / 'profile'}"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    service = webdriver.ChromeService(executable_path=CHROMEDRIVER, log_output=str(tmp_path / "chromedriver.log"))
    driver = webdriver.Chrome(options=options, service=service)
    driver.set_script_timeout(WAIT_S)
    yield driver
    try:
        errors = [e["message"] for e in driver.get_log("browser")
                  if e["level"] == "SEVERE" and "status of 401" not in e["message"]]   # the keyed test's
    finally:
        driver.quit()
    assert errors == [], "the page logged errors"


def wait(driver, condition, message):
    return WebDriverWait(driver, WAIT_S, poll_frequency=0.05).until(lambda d: condition(d), message)


def open_page(driver, server):
    driver.get(server.url + "/")
    wait(driver, lambda d: d.find_element(By.ID, "model").text == server.model_id, "the page never named the model")
    driver.execute_script(IGNORE_EOS)


def set_field(driver, field_id, value):
    field = driver.find_element(By.ID, field_id)
    field.clear()
    field.send_keys(str(value))
    driver.execute_script("arguments[0].dispatchEvent(new Event('change'))", field)


def stored_chat(driver):
    return json.loads(driver.execute_script("return localStorage.getItem('llambda.chat')") or "[]")


def replies(driver):
    return driver.find_elements(By.CSS_SELECTOR, "#messages .message.assistant")


def reply_text(element):
    return element.find_element(By.CSS_SELECTOR, ".body").get_attribute("textContent")


def idle(server):
    m = server.wait_metrics(lambda m: m["llambda_requests_running"] == 0 and m["llambda_kv_blocks_in_use"] == 0)
    assert m["llambda_requests_running"] == 0 and m["llambda_kv_blocks_in_use"] == 0
    return m


def test_page_and_static_files_are_served(server):
    status, headers, body = server.get("/")
    assert status == 200 and headers["content-type"].startswith("text/html")
    assert b'src="/static/chat.js"' in body and b'href="/static/chat.css"' in body
    for name, kind in (("chat.js", "javascript"), ("chat.css", "text/css")):
        status, headers, body = server.get("/static/" + name)
        assert status == 200 and kind in headers["content-type"] and body
    status, _, body = server.get("/static/nothing.js")
    assert status == 404 and json.loads(body)["error"]["type"] == "not_found_error"


def test_chat_streams_stops_and_survives_a_reload(server, browser, tmp_path):
    d = browser
    open_page(d, server)
    system = "You answer in random bytes."
    d.find_element(By.CSS_SELECTOR, "#settings summary").click()
    set_field(d, "system", system)
    for name, value in (("temperature", 0.8), ("top_p", 0.95), ("seed", 3), ("max_tokens", 12)):
        set_field(d, name, value)
    before = idle(server)

    # a short reply: Enter sends; the reply is the server's own answer to the same request
    d.find_element(By.ID, "prompt").send_keys("hello", Keys.ENTER)
    stats = wait(d, lambda d: d.find_elements(By.CSS_SELECTOR, ".message.assistant .stats"), "no reply finished")
    assert "12 tokens" in stats[0].text and "TTFT" in stats[0].text and "tokens/s" in stats[0].text
    chat = stored_chat(d)
    assert [m["role"] for m in chat] == ["user", "assistant"] and chat[0]["content"] == "hello"
    status, _, answer = server.post_json("/v1/chat/completions", dict(
        model=server.model_id, messages=[{"role": "system", "content": system}, {"role": "user", "content": "hello"}],
        temperature=0.8, top_p=0.95, seed=3, max_tokens=12, ignore_eos=True))
    assert status == 200 and chat[1]["content"] == answer["choices"][0]["message"]["content"] != ""
    shown = d.execute_script("return JSON.parse(localStorage.getItem('llambda.chat'))[1].content.trim()")
    assert reply_text(replies(d)[0]) == shown

    # Shift+Enter is a new line, not a send
    prompt = d.find_element(By.ID, "prompt")
    prompt.send_keys("go on", Keys.SHIFT, Keys.ENTER, Keys.SHIFT, "and on")
    assert prompt.get_attribute("value") == "go on\nand on" and len(replies(d)) == 1

    # a long reply, stopped while it streams
    set_field(d, "max_tokens", LONG_REPLY)
    d.find_element(By.ID, "send").click()
    wait(d, lambda d: len(replies(d)) == 2 and len(reply_text(replies(d)[1])) > 50, "the long reply never began")
    first_look = len(reply_text(replies(d)[1]))
    wait(d, lambda d: len(reply_text(replies(d)[1])) > first_look, "the reply did not grow while streaming")
    assert server.metrics()["llambda_requests_running"] == 1
    assert d.find_element(By.ID, "send").get_attribute("disabled") is not None
    d.find_element(By.ID, "stop").click()
    stats = wait(d, lambda d: d.find_elements(By.CSS_SELECTOR, ".message.assistant .stats.stopped"), "not stopped")
    assert "stopped" in stats[0].text
    m = idle(server)                                     # the server cancelled the sequence: its slot is free
    assert m["llambda_client_disconnects_total"] >= before["llambda_client_disconnects_total"] + 1
    assert m["llambda_generated_tokens_total"] - before["llambda_generated_tokens_total"] < 12 + LONG_REPLY
    stopped = stored_chat(d)[3]["content"]
    assert len(stopped) >= first_look and d.find_element(By.ID, "stop").get_attribute("disabled") is not None
    d.save_screenshot(str(tmp_path / "chat.png"))
    assert (tmp_path / "chat.png").stat().st_size > 0
    assert server.metrics()["llambda_generated_tokens_total"] == m["llambda_generated_tokens_total"]
    assert stored_chat(d)[3]["content"] == stopped      # nothing more arrived after the stop

    # the conversation and the settings come back after a reload
    chat = stored_chat(d)
    d.refresh()
    wait(d, lambda d: d.find_element(By.ID, "model").text == server.model_id, "the page never named the model")
    assert stored_chat(d) == chat and len(replies(d)) == 2
    assert [e.text for e in d.find_elements(By.CSS_SELECTOR, "#messages .role")] == ["YOU", "ASSISTANT"] * 2
    assert d.find_element(By.ID, "system").get_attribute("value") == system
    assert d.find_element(By.ID, "max_tokens").get_attribute("value") == str(LONG_REPLY)
    assert "stopped" in replies(d)[1].find_element(By.CSS_SELECTOR, ".stats").text

    d.find_element(By.ID, "new-chat").click()
    assert stored_chat(d) == [] and d.find_elements(By.CSS_SELECTOR, "#messages li") == []


def test_code_blocks_are_copyable_and_model_text_stays_text(server, browser):
    d = browser
    open_page(d, server)
    code = 'print("<b>hi</b>")\nx = 1 < 2'
    reply = f"Here:\n```python\n{code}\n```\n<img src=x onerror=\"window.pwned = 1\"> done"
    chat = [{"role": "user", "content": "<script>window.pwned = 1</script>"}, {"role": "assistant", "content": reply}]
    d.execute_script("localStorage.setItem('llambda.chat', arguments[0])", json.dumps(chat))
    d.refresh()
    wait(d, lambda d: len(replies(d)) == 1, "the stored conversation did not come back")
    blocks = d.find_elements(By.CSS_SELECTOR, ".message.assistant .code pre code")
    assert [b.get_attribute("textContent") for b in blocks] == [code]
    texts = [p.get_attribute("textContent") for p in d.find_elements(By.CSS_SELECTOR, ".message.assistant .text")]
    assert texts == ["Here:", '<img src=x onerror="window.pwned = 1"> done']
    assert d.find_elements(By.CSS_SELECTOR, "#messages img, #messages script, #messages b") == []
    assert d.execute_script("return window.pwned") is None

    d.execute_cdp_cmd("Browser.grantPermissions", {"origin": server.url,
                                                   "permissions": ["clipboardReadWrite", "clipboardSanitizedWrite"]})
    d.find_element(By.CSS_SELECTOR, ".code button").click()
    wait(d, lambda d: d.find_element(By.CSS_SELECTOR, ".code button").text == "Copied", "Copy did not copy")
    copied = d.execute_async_script("navigator.clipboard.readText().then(arguments[0], (e) => arguments[0](String(e)))")
    assert copied == code


def test_api_key_from_the_settings_is_sent(keyed, browser):
    d = browser
    d.get(keyed.url + "/")                               # the page itself needs no key
    wait(d, lambda d: "401" in d.find_element(By.ID, "status").text, "no word of the missing key")
    assert "API key" in d.find_element(By.ID, "status").text
    d.find_element(By.CSS_SELECTOR, "#settings summary").click()
    set_field(d, "api-key", API_KEY)
    wait(d, lambda d: d.find_element(By.ID, "model").text == keyed.model_id, "the key did not open /v1/models")
    assert d.execute_script("return localStorage.getItem('llambda.apiKey')") == API_KEY
    set_field(d, "max_tokens", 4)
    d.find_element(By.ID, "prompt").send_keys("hi", Keys.ENTER)
    stats = wait(d, lambda d: d.find_elements(By.CSS_SELECTOR, ".message.assistant .stats"), "no reply finished")
    assert "error" not in stats[0].text and d.find_element(By.ID, "status").text == ""

    set_field(d, "api-key", "sk-wrong")                 # a refused send gives the message back
    d.find_element(By.ID, "prompt").send_keys("again", Keys.ENTER)
    wait(d, lambda d: d.find_element(By.ID, "prompt").get_attribute("value") == "again", "the message was lost")
    assert "401" in d.find_element(By.ID, "status").text and len(replies(d)) == 1
