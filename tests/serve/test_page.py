"""attn serve's web page (GET /, serve/page/index.html) in a real browser: headless Chromium
(Debian's chromium and chromium-driver; .ci/run installs them) driven by Selenium, against a real
`attn serve` of a small model served both ways (en-de and de-en) behind --api-keys.

It types a paragraph and checks the page shows what POST /translate answers; swaps the pair;
translates a file and downloads it; sees a key's 429 in words; and keeps screenshots at a
desktop's and a phone's width (ATTN_ARTIFACTS, else the test's folder; the paths are printed)."""

from __future__ import annotations

import io
import json
import os
import shutil
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from .client import Server, call

PARAGRAPH = "A man is riding a bike. Two dogs play in the snow."
KEYS = "open key-open 0 -\ntight key-tight 2 -\n"

pytestmark = pytest.mark.long


@pytest.fixture(scope="module")
def browser():
    webdriver = pytest.importorskip("selenium.webdriver", reason="pip install selenium")
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if chromium is None or driver is None:
        pytest.skip("needs Debian's chromium and chromium-driver (.ci/run installs them)")
    from selenium.webdriver.chrome.service import Service as ChromeService

    os.environ["SE_OFFLINE"] = "true"  # Selenium Manager must not look for drivers online
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                     "--window-size=1280,900", "--disable-gpu"):
        options.add_argument(argument)
    session = webdriver.Chrome(service=ChromeService(driver), options=options)
    yield session
    session.quit()


@pytest.fixture(scope="module")
def server(trained, tmp_path_factory):
    model, _ = trained
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text(KEYS)
    process = Server([sys.executable, "-m", "attn_cli", "serve", "-m", f"en-de={model}", "-m",
                      f"de-en={model}", "--port", "0", "--threads", "2", "--api-keys",
                      str(keys)])
    process.wait_ready()
    yield process
    assert process.stop() == 0


def translated(server, text: str, source: str, target: str) -> str:
    status, answer = call(server, "POST", "/translate", {"q": text, "source": source,
                                                         "target": target},
                          {"X-API-Key": "key-open"})
    assert status == 200, answer
    return answer["translatedText"]


def wait(condition, seconds: float = 20.0):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        found = condition()
        if found:
            return found
        time.sleep(0.1)
    raise AssertionError(f"not within {seconds} s")


def artefacts(tmp_path: Path) -> Path:
    folder = Path(os.environ.get("ATTN_ARTIFACTS") or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def test_the_page_translates_swaps_translates_a_file_and_says_429_in_words(browser, server,
                                                                             tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import Select

    def element(name):
        return browser.find_element(By.ID, name)

    def output():
        return element("output").text.strip()

    def status():
        return element("status").text

    browser.get(f"http://{server.host}:{server.port}/")
    wait(lambda: len(Select(element("target")).options) > 0)
    source, target = Select(element("source")), Select(element("target"))
    assert [option.get_attribute("value") for option in source.options] == ["auto", "en", "de"]
    assert source.first_selected_option.get_attribute("value") == "en"
    assert target.first_selected_option.get_attribute("value") == "de"
    assert element("keybox").is_displayed()  # the server needs a key: the page asks for it
    assert "10000 characters" in element("count").text  # the limit shown

    # Without a key: the refusal in words
    element("input").send_keys("A dog.")
    wait(lambda: "needs an API key" in status())

    element("key").send_keys("key-open")
    element("savekey").click()
    element("input").clear()
    element("input").send_keys(PARAGRAPH)  # translated once typing pauses
    expected = translated(server, PARAGRAPH, "en", "de")
    wait(lambda: output() == expected.strip())
    assert browser.execute_script("return localStorage.getItem('attn.apiKey')") == "key-open"

    # Ctrl+Enter translates at once; alternatives on click
    element("input").send_keys(" A cat sleeps.", Keys.CONTROL, Keys.ENTER)
    longer = translated(server, PARAGRAPH + " A cat sleeps.", "en", "de")
    wait(lambda: output() == longer.strip())
    element("output").click()
    wait(lambda: element("alternatives").is_displayed() or "alternatives" in status().lower()
         or "Error" in status())
    assert "Error" not in status(), status()

    # Swap: de → en, the translation becomes the text, translated back
    element("swap").click()
    assert Select(element("source")).first_selected_option.get_attribute("value") == "de"
    assert Select(element("target")).first_selected_option.get_attribute("value") == "en"
    assert element("input").get_attribute("value") == longer  # the text as translated
    back = translated(server, element("input").get_attribute("value"), "de", "en")
    wait(lambda: output() == back.strip())

    # A file: uploaded, translated, downloaded
    Select(element("source")).select_by_value("en")
    Select(element("target")).select_by_value("de")
    document = tmp_path / "note.txt"
    document.write_text(PARAGRAPH + "\n\nTwo dogs play.\n", encoding="utf-8")
    element("file").send_keys(str(document))
    element("sendfile").click()
    wait(lambda: element("download").is_displayed())
    with urllib.request.urlopen(element("download").get_attribute("href")) as answer:
        downloaded = answer.read().decode("utf-8")
    assert downloaded == translated(server, document.read_text(encoding="utf-8"), "en", "de")

    # A Word file and subtitles: the same, and what comes back is a Word file and subtitles
    docx = pytest.importorskip("docx")
    word = docx.Document()
    word.add_paragraph("A man ").add_run("rides a bike").bold = True
    word.save(tmp_path / "report.docx")
    (tmp_path / "film.srt").write_text("1\n00:00:01,000 --> 00:00:02,000\nA man rides.\n\n",
                                       encoding="utf-8")
    for name in ("report.docx", "film.srt"):
        previous = element("download").get_attribute("href")
        element("file").clear()
        element("file").send_keys(str(tmp_path / name))
        element("sendfile").click()
        wait(lambda previous=previous: element("download").is_displayed()
             and element("download").get_attribute("href") != previous)
        assert element("download").text == f"Download the translation of {name}"
        with urllib.request.urlopen(element("download").get_attribute("href")) as answer:
            data = answer.read()
        if name.endswith(".docx"):
            assert len(docx.Document(io.BytesIO(data)).paragraphs) == 1
        else:
            assert data.decode().startswith("1\n00:00:01,000 --> 00:00:02,000\n")
    assert ".docx" in element("formats").text and ".srt" in element("formats").text

    shots = artefacts(tmp_path)
    desktop = shots / "attn-page-desktop.png"
    assert browser.save_screenshot(str(desktop))
    browser.set_window_size(390, 844)  # a phone's width
    time.sleep(0.3)
    assert browser.execute_script(
        "return document.documentElement.scrollWidth <= window.innerWidth + 1")
    phone = shots / "attn-page-phone.png"
    assert browser.save_screenshot(str(phone))
    browser.set_window_size(1280, 900)
    print(f"screenshots: {desktop} {phone}")

    # A key of 2 requests a minute: the third is refused, and the page says how long to wait
    element("forgetkey").click()
    element("key").send_keys("key-tight")
    element("savekey").click()  # (translates: 1)
    element("go").click()  # 2
    wait(lambda: output() and "Translating" not in status())
    element("go").click()  # 3: over
    wait(lambda: "Too many requests" in status())
    assert "2 a minute from the key 'tight'" in status() and "(wait " in status()
    assert "error" in element("status").get_attribute("class")


def test_the_page_is_served_to_anyone_and_fetches_nothing_from_elsewhere(server):
    """GET / is outside the key (the page asks for it), self-contained (no src or href to
    another host), and sent with a content security policy that allows this server only."""
    with urllib.request.urlopen(f"http://{server.host}:{server.port}/") as answer:
        page = answer.read().decode("utf-8")
        policy = answer.headers["Content-Security-Policy"]
    assert "default-src 'self'" in policy and "frame-ancestors 'none'" in policy
    assert "http://" not in page and "https://" not in page and "//cdn" not in page
    settings = json.loads(urllib.request.urlopen(
        f"http://{server.host}:{server.port}/frontend/settings").read())
    assert settings["keyRequired"] is True
