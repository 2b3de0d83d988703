"""llama.cpp as the benchmark's peer: one `llama-server` on the same GGUF, asked for completions
of token ids (core.bench's `llama.cpp` mode and its time-to-first-token measurement).

Why the server rather than `llama-completion`: it loads the model once for a whole benchmark,
takes the prompt as token ids (our chat template's tokens exactly, no second tokenization and
no BOS added), returns the answer's ids (the EOS included, as our engine emits it) and times
the two phases itself, in each reply's `timings`:
  prompt_n      prompt tokens processed (all of them: requests set cache_prompt false);
  prompt_ms     from the request's start until the first token is sampled: prompt processing,
                what core.bench calls a generation's `first_s`;
  predicted_n   tokens generated, the first included;
  predicted_ms  from the first token to the last: predicted_n - 1 decoding steps.
Its HTTP and JSON time is outside both, as our tokenizer and chat template are outside ours.

Build llama.cpp from the PyPI sdist: docs/benchmarks.md, "Comparing with llama.cpp".
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from core.threads import OMP_VARIABLES

ENV = "EAGLE_CHAT_LLAMA_CPP"  # a llama.cpp build's bin folder, as --llama-cpp DIR
SERVER = "llama-server"
START_TIMEOUT_S = 180.0       # loading a 7B GGUF from a cold disk takes tens of seconds
REQUEST_TIMEOUT_S = 1800.0
SAMPLERS = ["temperature", "top_k", "top_p"]  # our order (core.config.SamplingConfig); temperature 0 = argmax
SIGILL = 4


class LlamaCppError(RuntimeError):
    """llama.cpp could not be found, started or asked; the message says what to do."""


@dataclass(frozen=True)
class Completion:
    """One llama-server answer and its own timings (see the module docstring)."""

    tokens: tuple[int, ...]
    prompt_n: int
    prompt_ms: float
    predicted_n: int
    predicted_ms: float


def parse_completion(reply: dict) -> Completion:
    """A /completion reply (requested with return_tokens) -> Completion."""
    try:
        t = reply["timings"]
        return Completion(tuple(int(x) for x in reply["tokens"]), int(t["prompt_n"]), float(t["prompt_ms"]),
                          int(t["predicted_n"]), float(t["predicted_ms"]))
    except (KeyError, TypeError, ValueError) as e:
        raise LlamaCppError(f"{SERVER}'s reply lacks its tokens or timings ({type(e).__name__}: {e}); "
                            f"is this a llama.cpp server from 2025 or later?") from e


def find_server(bin_dir: str | Path) -> Path:
    """The llama-server executable in a llama.cpp build's bin folder, or a LlamaCppError saying how to get one."""
    folder = Path(bin_dir).expanduser()
    how = (f"build it (docs/benchmarks.md, \"Comparing with llama.cpp\": ninja -C build {SERVER}) and pass its "
           f"bin folder, e.g. --llama-cpp llama.cpp/build/bin (or {ENV}=DIR)")
    if not folder.is_dir():
        raise LlamaCppError(f"llama.cpp build folder {folder} does not exist; {how}")
    exe = folder / SERVER
    if not (exe.is_file() and os.access(exe, os.X_OK)):
        raise LlamaCppError(f"{folder} holds no executable {SERVER}; {how}")
    return exe


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """A llama-server process on one GGUF (a context manager: started on entry, stopped on exit).

    It gets our thread count for generation and prompt processing (-t, -tb), one slot and our
    context length, and inherits our environment, so the OpenMP wait policy core.threads chose
    (llama.cpp's CPU backend is an OpenMP team too) applies to both sides of the comparison."""

    def __init__(self, exe: Path, gguf: str | Path, threads: int, context: int, extra_args: Sequence[str] = ()):
        self.exe, self.gguf, self.port = Path(exe), Path(gguf), _free_port()
        self.command = [str(self.exe), "-m", str(self.gguf), "-t", str(threads), "-tb", str(threads),
                        "-c", str(context), "-np", "1", "--host", "127.0.0.1", "--port", str(self.port),
                        *extra_args]
        self.proc: subprocess.Popen | None = None
        self.build = "?"

    def __enter__(self) -> "LlamaServer":
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(self.command, stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT)
        try:
            self._wait_ready()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *_) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()

    def describe(self) -> dict:
        omp = {k: os.environ[k] for k in OMP_VARIABLES if k in os.environ}
        return {"server": str(self.exe), "gguf": str(self.gguf), "build": self.build, "command": self.command,
                "openmp_environment": omp}

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise LlamaCppError(self._died("while loading"))
            try:
                with urllib.request.urlopen(f"{self._url}/health", timeout=5) as r:
                    if r.status == 200:
                        self.build = str(self._get("/props").get("build_info", "?"))
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass  # not listening yet, or 503 while the model loads
            time.sleep(0.2)
        raise LlamaCppError(f"{SERVER} did not become ready within {START_TIMEOUT_S:.0f} s; its log ends:\n"
                            f"{self._log_tail()}")

    @property
    def _url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _get(self, path: str) -> dict:
        try:
            with urllib.request.urlopen(self._url + path, timeout=30) as r:
                return json.loads(r.read())
        except (urllib.error.URLError, ValueError):
            return {}

    def complete(self, ids: Sequence[int], n_predict: int, *, temperature: float = 0.0, top_p: float = 1.0,
                 top_k: int = 0, seed: int = 0) -> Completion:
        """Answer the prompt `ids` with at most n_predict tokens, sampled as our SamplingConfig
        samples (temperature 0: greedy), the prompt processed from scratch."""
        body = {"prompt": [int(t) for t in ids], "n_predict": n_predict, "cache_prompt": False, "return_tokens": True,
                "temperature": temperature, "top_k": top_k, "top_p": top_p, "min_p": 0.0, "samplers": SAMPLERS,
                "seed": seed % 2**32, "stream": False}
        request = urllib.request.Request(f"{self._url}/completion", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as r:
                return parse_completion(json.loads(r.read()))
        except urllib.error.HTTPError as e:
            reason = e.read()[:500].decode(errors="replace")
            raise LlamaCppError(f"{SERVER} refused a completion ({e.code}): {reason}") from e
        except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
            if self.proc.poll() is not None:
                raise LlamaCppError(self._died("during a completion")) from e
            raise LlamaCppError(f"{SERVER} did not answer ({e})") from e

    def _died(self, when: str) -> str:
        code = self.proc.returncode
        hint = ""
        if code == -SIGILL:
            hint = (" (an illegal instruction: a build with -DGGML_NATIVE=ON from another CPU, or its AMX kernels "
                    "on a machine or VM that does not run them: try --llama-cpp-args=--no-repack, which keeps "
                    "the weights out of the AMX buffers)")
        return f"{SERVER} exited with status {code} {when}{hint}; its log ends:\n{self._log_tail()}"

    def _log_tail(self, lines: int = 15) -> str:
        self.log.seek(0)
        return "\n".join(self.log.read().decode(errors="replace").splitlines()[-lines:])
