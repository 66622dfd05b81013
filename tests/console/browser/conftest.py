"""Browser fixtures: Debian's chromium driven by Playwright (never a browser Playwright downloads), against the
control plane served by pytest-django's live server on PostgreSQL.

`make test` installs chromium (scripts/browser.sh) and names it in KCAAS_CHROMIUM; there, or under CI, a missing
browser fails the tests instead of skipping them. Screenshots: KCAAS_CONSOLE_SCREENSHOTS=<dir> writes the main pages
there (docs/console/ holds the committed ones), otherwise they go to the test's tmp dir.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.console.conftest import PASSWORD, make_console_user, totp_code

CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-quic",
    "--no-first-run",
    "--disable-component-update",
    "--disable-sync",
]
LAPTOP = {"width": 1280, "height": 800}
PHONE = {"width": 375, "height": 740}


def _chromium() -> str | None:
    path = os.environ.get("KCAAS_CHROMIUM") or "/usr/bin/chromium"
    return path if os.access(path, os.X_OK) else None


@pytest.fixture(scope="session")
def browser():
    executable = _chromium()
    if executable is None:
        if os.environ.get("CI") or os.environ.get("KCAAS_CHROMIUM"):
            pytest.fail("chromium is missing: make test installs it with scripts/browser.sh")
        pytest.skip("no chromium here: run `make test` (it installs Debian's chromium)")
    from playwright.sync_api import sync_playwright

    # Playwright's sync API runs an event loop in this thread; the tests' own ORM calls are plain synchronous code.
    previous = os.environ.get("DJANGO_ALLOW_ASYNC_UNSAFE")
    os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        yield launched
        launched.close()
    if previous is None:
        os.environ.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)
    else:
        os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = previous


@pytest.fixture
def page(browser, live_server):
    """A fresh browser context (own cookies) at laptop size; `page.base` is the live server's URL."""
    context = browser.new_context(viewport=LAPTOP, accept_downloads=True)
    context.set_default_timeout(15_000)
    opened = context.new_page()
    opened.base = live_server.url
    errors: list[str] = []
    opened.on("pageerror", lambda error: errors.append(str(error)))
    # Script errors and console errors, but not the browser's note on a 4xx answer (a form refused on purpose).
    opened.on(
        "console",
        lambda message: (
            errors.append(message.text)
            if message.type == "error" and not message.text.startswith("Failed to load resource")
            else None
        ),
    )
    opened.js_errors = errors
    yield opened
    context.close()


@pytest.fixture
def shots(tmp_path) -> Path:
    wanted = os.environ.get("KCAAS_CONSOLE_SCREENSHOTS")
    folder = Path(wanted) if wanted else tmp_path / "screenshots"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def browser_sign_in(page, user, device, *, next_path: str = "") -> None:
    """Type the password, then the authenticator's current code, as a person would."""
    page.goto(page.base + "/console/login" + (f"?next={next_path}" if next_path else ""))
    page.get_by_label("Username").fill(user.get_username())
    page.get_by_label("Password").fill(PASSWORD)
    page.get_by_role("button", name="Continue").click()
    page.wait_for_url("**/console/login/verify**")
    device.refresh_from_db()
    device.last_t = -1
    device.save(update_fields=["last_t"])
    page.get_by_label("6-digit code").fill(totp_code(device))
    page.get_by_role("button", name="Sign in").click()
    page.get_by_role("button", name="Sign out").wait_for()


@pytest.fixture
def signed_in(page, transactional_db):
    """signed_in(*roles) -> (page, user): a browser signed in as a new console user holding `roles`."""

    def make(*role_names: str):
        user, device = make_console_user(*role_names)
        browser_sign_in(page, user, device)
        return page, user

    return make


_A11Y_PROBLEMS_JS = """() => {
  const problems = [];
  const visible = (el) => (el.checkVisibility ? el.checkVisibility() : !!(el.offsetWidth || el.offsetHeight || el.getClientRects().length));  // checkVisibility: not inside a closed <details>
  for (const el of document.querySelectorAll('input, select, textarea')) {
    if (el.type === 'hidden' || !visible(el)) continue;
    const named = (el.labels && el.labels.length) || el.getAttribute('aria-label') || el.getAttribute('aria-labelledby');
    if (!named) problems.push('unlabelled ' + el.tagName.toLowerCase() + ' ' + (el.name || el.id));
  }
  for (const el of document.querySelectorAll('button, a[href]')) {
    if (visible(el) && !(el.innerText || '').trim() && !el.getAttribute('aria-label')) problems.push('nameless ' + el.outerHTML.slice(0, 80));
  }
  for (const el of document.querySelectorAll('table')) {
    if (!el.querySelector('caption') && !el.getAttribute('aria-label') && !el.getAttribute('aria-labelledby')) problems.push('table without caption');
  }
  for (const el of document.querySelectorAll('svg')) {
    if (!el.querySelector('title') && !el.getAttribute('aria-label') && el.getAttribute('aria-hidden') !== 'true') problems.push('svg without a name');
  }
  if (!document.documentElement.lang) problems.push('no lang');
  if (document.querySelectorAll('h1').length !== 1) problems.push('h1 count ' + document.querySelectorAll('h1').length);
  if (document.documentElement.scrollWidth > window.innerWidth + 1) problems.push('page scrolls sideways: ' + document.documentElement.scrollWidth + ' > ' + window.innerWidth);
  return problems;
}"""


def accessibility_problems(page) -> list[str]:
    """Labels, names, captions, one h1, and no sideways scrolling at the current width (tables scroll inside their
    own wrapper): what a screen-reader or phone user hits first."""
    return page.evaluate(_A11Y_PROBLEMS_JS)
