"""README's screenshot, taken again: the app on the embedded default model and the shipped head, one question answered
in headless Chromium (Debian's `chromium`, driven by pip's playwright, as tests/test_app_browser.py does).

    python scripts/screenshot.py [--out assets/screenshots/app.png] [--prompt TEXT]

Starts `python launcher.py --no-browser --port P` in a process of its own, waits for its page, sends the prompt, waits
for the answer's stats line to say it ended, and saves a full-page PNG. Run it on a quiet machine: the page shows the
answer's tokens/s."""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = "/usr/bin/chromium"
PROMPT = "Write a Python function that checks whether a number is prime, then explain how it works."
DONE = "/end of answer|max new tokens/.test(document.querySelector('#stats').innerText)"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(url: str, proc: subprocess.Popen, seconds: float = 300) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise SystemExit(f"the app exited with status {proc.returncode} before serving its page")
        try:
            with urllib.request.urlopen(url, timeout=5):
                return
        except OSError:
            time.sleep(1)
    raise SystemExit(f"the app did not serve {url} within {seconds:.0f} s")


@contextmanager
def launched_page(cwd: Path = ROOT, launcher_args=(), width: int = 1400, height: int = 1624):
    """(page, url): the launcher started in `cwd` on a free port (`--no-browser`, then `launcher_args`), and a page of
    headless Chromium at its address; both closed on leaving."""
    from playwright.sync_api import sync_playwright

    port = free_port()
    url = f"http://127.0.0.1:{port}/"
    proc = subprocess.Popen([sys.executable, "launcher.py", "--no-browser", "--port", str(port), *launcher_args],
                            cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        print(f"waiting for the app at {url} ...", flush=True)
        wait_for(url, proc)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM,
                                        args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
            try:
                yield browser.new_page(viewport={"width": width, "height": height}), url
            finally:
                browser.close()
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "assets/screenshots/app.png")
    ap.add_argument("--prompt", default=PROMPT)
    ap.add_argument("--width", type=int, default=1400)
    ap.add_argument("--height", type=int, default=1624)
    args = ap.parse_args()
    with launched_page(width=args.width, height=args.height) as (page, url):
        page.goto(url)
        page.wait_for_selector("#message textarea", timeout=120_000)
        page.fill("#message textarea", args.prompt)
        page.click("#send")
        page.wait_for_function(DONE, polling=500, timeout=300_000)
        time.sleep(1.5)  # the chart and the token colours settle after the last update
        args.out.parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(args.out), full_page=True)
        stats = page.inner_text("#stats")
        print(f"saved {args.out}: {stats.splitlines()[0] if stats else ''}")


if __name__ == "__main__":
    main()
