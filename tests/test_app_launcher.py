"""`python launcher.py` as a user runs it: --help, flag errors, and a --share that cannot
reach Gradio's share servers (the app must keep serving locally and say so)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.app_server import ROOT, Launched, free_port, isolated_home

FLAGS = ("--model", "--head", "--port", "--no-browser", "--share", "--auth", "--load-in-4bit", "--device",
         "--dtype", "--attention", "--weights", "--threads", "--backend", "--api-key", "--api", "--api-port",
         "--remote-max-new-tokens", "--remote-max-seconds", "--help")


def run_launcher(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "launcher.py"), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env={**os.environ, **(env or {})})


def test_help_lists_every_flag_quickly():
    out = run_launcher("--help")
    assert out.returncode == 0
    for flag in FLAGS:
        assert flag in out.stdout, flag
    assert "USER:PASS" in out.stdout


def test_readme_answers_a_new_users_first_questions():
    readme = (ROOT / "README.md").read_text()
    start = readme.split("## Start the app", 1)[1].split("\n## ", 1)[0]
    assert "Python 3.11 is required" in start
    assert "`--no-browser`" in start and "without a display" in start
    assert "first start" in start and "about 30 s" in start and "de-quantizing" in start, "how long, and why"
    assert "--remote-max-new-tokens" in start and "--remote-max-seconds" in start
    generate = readme.split("## Headless generation", 1)[1].split("\n## ", 1)[0]
    assert "--prompt-file" in generate and "python -m core.generate - <" in generate, "long prompts: file or stdin"


def test_bad_flags_are_refused_with_a_message():
    out = run_launcher("--auth", "justauser")
    assert out.returncode == 2 and "--auth must look like USER:PASS" in out.stderr
    out = run_launcher("--port", "http")
    assert out.returncode == 2 and "--port" in out.stderr


def test_a_model_that_cannot_load_ends_with_a_clear_error(tmp_path):
    out = run_launcher("--model", str(tmp_path / "no-such-model"), "--no-browser", env=isolated_home(tmp_path))
    assert out.returncode == 1
    assert "error:" in out.stderr and "neither an existing folder nor a hub id" in out.stderr
    assert "Traceback" not in out.stderr


def browser_spy(tmp_path):
    """A BROWSER command (Python's webbrowser honours it) that records the URLs it is asked to open."""
    marker = tmp_path / "opened.txt"
    spy = tmp_path / "browser.sh"
    spy.write_text(f'#!/bin/sh\necho "$1" >> {marker}\n')
    spy.chmod(0o755)
    return {"BROWSER": str(spy)}, marker


@pytest.mark.slow
def test_share_failure_keeps_serving_locally_with_auth(tmp_path):
    from gradio_client import Client
    from gradio_client.exceptions import AuthenticationError

    from app.controls import LOOKUP_INFO

    port = free_port()
    spy_env, marker = browser_spy(tmp_path)
    # every outside connection fails at once, as on a machine without internet
    offline = {"HTTPS_PROXY": "http://127.0.0.1:9", "HTTP_PROXY": "http://127.0.0.1:9",
               "ALL_PROXY": "http://127.0.0.1:9", "NO_PROXY": "127.0.0.1,localhost"}
    app = Launched(["--share", "--auth", "ada:lovelace", "--no-browser", "--port", str(port), "--head", "none"],
                   env={**isolated_home(tmp_path), **spy_env, **offline})
    try:
        assert app.url == f"http://127.0.0.1:{port}/"
        notice = app.read_more("could not create a public share link.*", timeout_s=60)
        assert "Serving locally only" in notice
        assert "Public link" not in app.output
        with pytest.raises(AuthenticationError, match="credentials were not provided"):
            Client(app.url, verbose=False)
        client = Client(app.url, auth=("ada", "lovelace"), verbose=False)
        message, _table = client.predict("SmolLM2-135M-Instruct (embedded)", "", "", "float32", "cpu", False,
                                         api_name="/download")
        assert "Nothing to download" in message, "a logged-in visitor may manage models"
        toggle = next(c for c in client.config["components"] if c.get("props", {}).get("elem_id") == "speculative")
        assert toggle["props"]["interactive"] is True and toggle["props"]["value"] is True, \
            "without a head the chat still speculates, by context lookup"
        assert toggle["props"]["info"] == LOOKUP_INFO
        assert not marker.exists(), "--no-browser must not open a browser"
    finally:
        app.stop()
