"""Helpers for the app tests: a random EAGLE head for the real SmolLM2, and `python launcher.py`
run as a real subprocess whose printed URL the tests then drive."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = "/usr/bin/chromium"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def random_head(folder: Path) -> Path:
    """A seeded random head for SmolLM2: low acceptance, but output must stay exact."""
    from transformers import AutoConfig

    from core.decoding.head import new_head, save_head
    from core.models import embedded_model_dir

    config = AutoConfig.from_pretrained(embedded_model_dir())
    return save_head(new_head(config, seed=0), folder)


# The machine-level caches a private home may share: the SmolLM2 conversion, the compiled kernels, the LM head's
# screen and the probe's verdicts (each keyed by what it was built from). Built afresh in every test's home, they
# cost 20-60 s a launch on a 2-core machine (a gcc build, 1,600 tokens of screen fitting, the conversion).
SHARED_CACHES = ("models", "kernels", "screen", "probe")


def shared_home(home: Path, share: tuple[str, ...] = SHARED_CACHES) -> Path:
    """`home` (created) as an EAGLE_CHAT_HOME whose `share` folders link to the test run's own cache home's;
    everything else in it (the last model, the browser secret, tuned trees) stays private."""
    from core.models import cache_home

    home.mkdir(parents=True, exist_ok=True)
    for name in share:
        target = cache_home() / name
        target.mkdir(mode=0o700, parents=True, exist_ok=True)
        link = home / name
        if not link.exists():
            link.symlink_to(target, target_is_directory=True)
    return home


def isolated_home(tmp: Path) -> dict[str, str]:
    """Environment with a private EAGLE_CHAT_HOME (so last_model.json of a test never leaks
    into the user's) that still reuses the machine-level caches (SHARED_CACHES)."""
    return {"EAGLE_CHAT_HOME": str(shared_home(tmp / "eagle-home"))}


class Launched:
    """`python launcher.py ARGS` in the background; `url` once it prints that it is running."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None, timeout_s: float = 240):
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "GRADIO_ANALYTICS_ENABLED": "False", **(env or {})}
        self.proc = subprocess.Popen([sys.executable, str(ROOT / "launcher.py"), *args], cwd=ROOT, env=full_env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self._seen = 0
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.url = self._wait_for(r"running at (http://\S+)", timeout_s)

    def _read(self) -> None:
        for line in self.proc.stdout:  # a thread, so a silent launcher cannot block the test
            self.lines.append(line)

    def _wait_for(self, pattern: str, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            while self._seen < len(self.lines):
                line = self.lines[self._seen]
                self._seen += 1
                if m := re.search(pattern, line):
                    return m[1].rstrip("/") + "/" if m[1].startswith("http") else m[1]
            if self.proc.poll() is not None and self._seen == len(self.lines):
                raise RuntimeError("launcher exited early:\n" + self.output)
            time.sleep(0.05)
        raise TimeoutError(f"no line matching {pattern!r} within {timeout_s} s:\n" + self.output)

    def read_more(self, pattern: str, timeout_s: float = 10) -> str:
        """The next printed line part matching `pattern` (searching lines after the URL)."""
        return self._wait_for(f"({pattern})", timeout_s)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._reader.join(5)


class Served:
    """The app built on a given engine (tiny models in tests) and served by a real Gradio server in
    this process, so tests reach it over HTTP like any client and can also inspect its state."""

    def __init__(self, engine, access=None, loader=None):
        from app.manager import ModelManager
        from app.state import Access, ModelChoice
        from app.ui import build, launch

        self.manager = ModelManager(loader, ModelChoice("tiny", None), engine)
        self.app = build(self.manager, access or Access())
        self.url, _ = launch(self.app, port=free_port(), share=False, auth=None, inbrowser=False)

    @property
    def handlers(self):
        return self.app.handlers

    def close(self) -> None:
        self.app.demo.close()


class FakeRequest:
    """What the app reads of a gr.Request: headers, the client address and the session."""

    def __init__(self, host="127.0.0.1:7860", client="127.0.0.1", forwarded=None, session_hash="s1"):
        self.headers = {"host": host, **({"x-forwarded-for": forwarded} if forwarded else {})}
        self.client = type("Address", (), {"host": client})()
        self.session_hash = session_hash


LOCAL = FakeRequest()
SHARE_LINK = FakeRequest(host="abcd1234.gradio.live", forwarded="203.0.113.7")  # through the share tunnel
