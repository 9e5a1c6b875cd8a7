"""The report in a real headless Chromium: sections shown, images decoded, the source filter
works, no script errors, and a completion holding markup shows as text and runs nothing.

Needs the `chromium` and `chromedriver` executables (Debian: apt-get install chromium
chromium-driver) and `pip install selenium`; skipped when any is missing. The driver path is
given explicitly, so selenium-manager never tries to download a browser or a driver.
"""

from __future__ import annotations

import pytest

from tests.report_fixtures import ALERT, browser_missing, chromium, write_fake_run
from vlrft.trajectory.report import write_report

pytestmark = pytest.mark.integration

if browser_missing():
    pytest.skip(browser_missing(), allow_module_level=True)

from selenium.common.exceptions import NoAlertPresentException  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import Select  # noqa: E402

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture()
def browser():
    driver = chromium(javascript=True)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture()
def browser_without_scripts():
    driver = chromium(javascript=False)
    try:
        yield driver
    finally:
        driver.quit()


def shown_cards(driver, source: str) -> list[bool]:
    return [card.is_displayed() for card in driver.find_elements(By.CSS_SELECTOR, f'.card[data-source="{source}"]')]


def test_report_in_headless_chromium(browser, tmp_path):
    html_path, _ = write_report(write_fake_run(tmp_path / "run"))
    browser.get(html_path.as_uri())

    assert browser.title == "vlrft report: run"
    for section in ("overview", "curves", "histograms", "per-source", "samples"):
        element = browser.find_element(By.ID, section)
        assert element.is_displayed() and element.find_element(By.TAG_NAME, "h2").text
    decoded = browser.execute_script(
        "return Array.from(document.images).filter(i => i.complete && i.naturalWidth > 0).length")
    assert decoded >= 1
    assert browser.find_elements(By.CSS_SELECTOR, "svg.chart")

    # The script reveals the filters and shows the last step, both sources.
    assert browser.find_element(By.ID, "sample-controls").is_displayed()
    assert any(shown_cards(browser, "maths")) and any(shown_cards(browser, "colours"))
    Select(browser.find_element(By.ID, "source-filter")).select_by_value("maths")
    assert any(shown_cards(browser, "maths")) and not any(shown_cards(browser, "colours"))
    Select(browser.find_element(By.ID, "step-filter")).select_by_value("all")
    Select(browser.find_element(By.ID, "source-filter")).select_by_value("all")
    assert all(shown_cards(browser, "maths")) and all(shown_cards(browser, "colours"))

    responses = [r.text for r in browser.find_elements(By.CSS_SELECTOR, "pre.response") if r.is_displayed()]
    assert ALERT in responses
    with pytest.raises(NoAlertPresentException):
        browser.switch_to.alert.text

    errors = [entry for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]
    assert errors == []

    browser.execute_script("document.getElementById('samples').scrollIntoView()")
    screenshot = tmp_path / "report.png"
    assert browser.save_screenshot(str(screenshot))
    assert screenshot.stat().st_size > 0 and screenshot.read_bytes().startswith(PNG_SIGNATURE)


def test_report_without_javascript_shows_every_sample(browser_without_scripts, tmp_path):
    browser = browser_without_scripts
    browser.get(write_report(write_fake_run(tmp_path / "run"))[0].as_uri())
    # With scripts on, the filter would show only step 20 and reveal the controls.
    assert not browser.find_element(By.ID, "sample-controls").is_displayed()  # no controls that do nothing
    cards = browser.find_elements(By.CSS_SELECTOR, ".card")
    assert len(cards) == 12 and all(card.is_displayed() for card in cards)  # every saved response fits in 3 + 3
