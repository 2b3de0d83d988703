"""Chat through any OpenAI-compatible server: our `python -m core.serve`, vLLM, SGLang or llama.cpp.

Streams /v1/chat/completions with httpx and reads what the server reports about speculation:
  eagle-chat  the `eagle` field of every chunk: this answer's totals (see core/serve.py)
  vLLM        the Prometheus counters vllm:spec_decode_num_drafts_total and
              vllm:spec_decode_num_accepted_tokens_total from /metrics, differenced over the
              answer; they are server-wide, so other users' requests in that time count too
  SGLang      per request: spec_verify_ct (verification passes), spec_accept_length (tokens
              per pass), spec_num_correct_drafts, in `sglext.spec_tokens_details` (asked for
              with return_spec_tokens_details) or in a native `meta_info`
  llama.cpp   per request, `llama-server`'s `timings` object (on the last chunk, and on every
              chunk when asked with timings_per_token): predicted_n tokens, and while it
              speculates draft_n drafted and draft_n_accepted accepted tokens. Each target
              forward yields one token the draft did not supply, so forwards = predicted_n -
              draft_n_accepted (the prompt's forward, which yields the first token, included)
Any other server streams text only. tau is tokens per target forward (vLLM and SGLang call it
the mean acceptance length; it counts the bonus token).
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, replace
from typing import Iterator

import httpx

from app.errors import plain_reason

VLLM_DRAFTS = "vllm:spec_decode_num_drafts_total"
VLLM_ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
VLLM_POLL_S = 1.0  # how often /metrics is read while an answer streams
KINDS = {"eagle-chat": "eagle-chat", "vllm": "vllm", "sglang": "sglang", "llamacpp": "llama.cpp"}  # owned_by -> kind
# how each kind of server is asked to continue a final assistant message (vLLM's field, which SGLang and ours take;
# llama-server does it unasked); an OpenAI server proper has no way
CONTINUE_FIELDS = {"continue_final_message": True, "add_generation_prompt": False}
CONTINUES = {"eagle-chat": CONTINUE_FIELDS, "vllm": CONTINUE_FIELDS, "sglang": CONTINUE_FIELDS, "llama.cpp": {}}
METRIC_NAME = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")


class RemoteError(RuntimeError):
    """The server cannot be reached, refused the request, or went away; the message says which."""


@dataclass(frozen=True)
class ServerInfo:
    url: str                 # base URL without /v1, as shown to the user
    model: str               # the id the server serves (sent with each request)
    kind: str                # "eagle-chat" | "vllm" | "sglang" | "llama.cpp" | "openai" (anything else)
    max_context: int | None  # when the server says


@dataclass(frozen=True)
class RemoteStats:
    source: str                        # where the numbers come from, for the panel's label
    tokens: int | None                 # tokens in this answer
    accepted_draft_tokens: int | None
    target_forwards: int | None        # verification passes of the target
    tau: float | None                  # tokens per target forward
    draft_tokens: int | None = None    # tokens the draft proposed, where the server says (llama.cpp)


@dataclass(frozen=True)
class RemoteEvent:
    text: str                    # text delta to append to the answer
    stats: RemoteStats | None    # the latest statistics, if the server reports any
    finished: bool
    finish_reason: str | None    # the server's word: "stop", "length", ...
    elapsed_s: float


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text format -> {metric name: sum over its label sets}."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        name = METRIC_NAME.match(line)  # comments (#) and blank lines do not match
        if name is None:
            continue
        rest = line[name.end():]
        if rest.startswith("{"):  # label values may hold spaces: skip to the closing brace
            rest = rest[rest.rfind("}") + 1:]
        try:
            out[name.group()] = out.get(name.group(), 0.0) + float(rest.split()[0])
        except (IndexError, ValueError):
            continue
    return out


def eagle_stats(chunk: dict) -> RemoteStats | None:
    e = chunk.get("eagle")
    if not isinstance(e, dict):
        return None
    return RemoteStats("eagle-chat server, this answer", e.get("tokens"), e.get("accepted_draft_tokens"),
                       e.get("target_forwards"), e.get("tau"))


def sglang_stats(chunk: dict) -> RemoteStats | None:
    for holder in (chunk, *(chunk.get("choices") or [])):
        d = (holder.get("sglext") or {}).get("spec_tokens_details") or holder.get("meta_info")
        if isinstance(d, dict) and d.get("spec_verify_ct"):
            verify, tokens = d["spec_verify_ct"], d.get("completion_tokens")
            tau = d.get("spec_accept_length") or (tokens / verify if tokens else None)
            return RemoteStats("SGLang, this answer", tokens, d.get("spec_num_correct_drafts"), verify, tau)
    return None


def llamacpp_stats(chunk: dict) -> RemoteStats | None:
    t = chunk.get("timings")
    if not isinstance(t, dict) or not isinstance(t.get("draft_n"), int) or t["draft_n"] <= 0:
        return None  # draft_n is sent only while the server speculates
    tokens, accepted = t.get("predicted_n"), t.get("draft_n_accepted")
    if not isinstance(tokens, int) or not isinstance(accepted, int) or not 0 <= accepted < tokens:
        return None
    forwards = tokens - accepted  # every forward yields one token the draft did not supply
    return RemoteStats("llama.cpp timings, this answer", tokens, accepted, forwards, tokens / forwards,
                       draft_tokens=t["draft_n"])


def vllm_stats(before: dict[str, float], after: dict[str, float]) -> RemoteStats | None:
    drafts = after.get(VLLM_DRAFTS, 0.0) - before.get(VLLM_DRAFTS, 0.0)
    accepted = after.get(VLLM_ACCEPTED, 0.0) - before.get(VLLM_ACCEPTED, 0.0)
    if drafts <= 0:
        return None
    return RemoteStats("vLLM /metrics, server-wide during this answer", None, int(accepted), int(drafts),
                       1 + accepted / drafts)


def _message(r: httpx.Response) -> str:
    try:
        body = r.json()
    except ValueError:
        return r.text[:300] or r.reason_phrase
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict):
        return str(err.get("message"))
    return str(body.get("message") or body.get("detail") or err or body)[:300]


class RemoteBackend:
    """One OpenAI-compatible server. `connect()` once (cheap), then `chat(...)` per answer."""

    def __init__(self, url: str, *, api_key: str | None = None, timeout_s: float = 300.0):
        url = url.strip().rstrip("/")
        url = url if "://" in url else f"http://{url}"
        self.url = url[:-3] if url.endswith("/v1") else url
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(headers=headers, timeout=httpx.Timeout(timeout_s, connect=5.0))
        self.info: ServerInfo | None = None

    def connect(self) -> ServerInfo:
        try:
            r = self.client.get(f"{self.url}/v1/models", timeout=10.0)  # a listing, not an answer: fail fast
        except httpx.HTTPError as e:
            raise RemoteError(f"cannot reach an OpenAI-compatible server at {self.url}: {plain_reason(e)}. "
                              "Is it running, and is the address right?") from e
        if r.status_code != 200:
            raise RemoteError(f"the server at {self.url} answered /v1/models with {r.status_code}: {_message(r)}")
        try:
            models = r.json()["data"]
            models[0]["id"]
        except (ValueError, KeyError, IndexError, TypeError) as e:
            raise RemoteError(f"the server at {self.url} lists no model at /v1/models: is it an "
                              "OpenAI-compatible server?") from e
        owner = str(models[0].get("owned_by", "")).lower()
        kind = next((kind for k, kind in KINDS.items() if k in owner), "openai")
        meta = models[0].get("meta") if isinstance(models[0].get("meta"), dict) else {}
        self.info = ServerInfo(self.url, models[0]["id"], kind, models[0].get("max_model_len") or meta.get("n_ctx"))
        return self.info

    def _metrics(self) -> dict[str, float] | None:
        try:
            r = self.client.get(f"{self.url}/metrics", timeout=5.0)
            return parse_metrics(r.text) if r.status_code == 200 else None
        except httpx.HTTPError:
            return None  # statistics are a bonus; the answer goes on without them

    def chat(self, messages: list[dict], *, max_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
             seed: int | None = None, stop: tuple[str, ...] = (), continue_final: bool = False) -> Iterator[RemoteEvent]:
        """Stream one answer (`continue_final`: more of the final assistant message, its text only).
        Raises RemoteError; text already yielded stays valid."""
        info = self.info or self.connect()
        if continue_final and info.kind not in CONTINUES:
            raise RemoteError(f"the server at {self.url} ({info.kind}) has no known way to continue an answer; "
                              "eagle-chat, vLLM, SGLang and llama.cpp servers do. Press Regenerate for a new one.")
        body = {"model": info.model, "messages": messages, "max_tokens": max_tokens, "temperature": temperature,
                "top_p": top_p, "stream": True, "stream_options": {"include_usage": True},
                **({"seed": seed} if seed is not None else {}), **({"stop": list(stop)} if stop else {}),
                **({"return_spec_tokens_details": True} if info.kind == "sglang" else {}),
                **({"timings_per_token": True} if info.kind == "llama.cpp" else {}),
                **(CONTINUES[info.kind] if continue_final else {})}
        # llama-server continues a final assistant message by itself, and streams that message first
        echo, held = (str(messages[-1]["content"]) if continue_final and info.kind == "llama.cpp" else ""), ""
        before = self._metrics() if info.kind == "vllm" else None
        start = polled = time.perf_counter()
        stats, finish, tokens = None, None, None
        try:
            with self.client.stream("POST", f"{self.url}/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    r.read()
                    raise RemoteError(f"the server at {self.url} refused the request ({r.status_code}): "
                                      f"{_message(r)}")
                for chunk in self._chunks(r):
                    stats = eagle_stats(chunk) or sglang_stats(chunk) or llamacpp_stats(chunk) or stats
                    tokens = (chunk.get("usage") or {}).get("completion_tokens", tokens)
                    if before is not None and time.perf_counter() - polled > VLLM_POLL_S:
                        stats, polled = vllm_stats(before, self._metrics() or before) or stats, time.perf_counter()
                    for choice in chunk.get("choices") or []:
                        finish = choice.get("finish_reason") or finish
                        text = (choice.get("delta") or {}).get("content") or ""
                        if echo:  # held until it is known whether the stream repeats the message
                            held += text
                            if len(held) < len(echo) and echo.startswith(held):
                                continue
                            text, echo = (held[len(echo):] if held.startswith(echo) else held), ""
                        yield RemoteEvent(text, stats, False, None, time.perf_counter() - start)
        except httpx.ConnectError as e:
            raise RemoteError(f"cannot reach the server at {self.url}: {plain_reason(e)}. Is it still running?") from e
        except httpx.TransportError as e:
            raise RemoteError(f"the server at {self.url} stopped responding mid-answer; the text so far "
                              "is kept (the connection broke)") from e
        except json.JSONDecodeError as e:
            raise RemoteError(f"the server at {self.url} sent a malformed event ({e}); the text so far "
                              "is kept") from e
        if before is not None:
            stats = vllm_stats(before, self._metrics() or before) or stats
        if stats is not None and stats.tokens is None and tokens is not None:
            stats = replace(stats, tokens=tokens)
        yield RemoteEvent("", stats, True, finish, time.perf_counter() - start)

    def _chunks(self, r: httpx.Response) -> Iterator[dict]:
        """The JSON objects of a server-sent event stream, up to `data: [DONE]`."""
        for line in r.iter_lines():
            data = line[5:].strip() if line.startswith("data:") else ""
            if data == "[DONE]":
                return
            if data:
                chunk = json.loads(data)
                if "error" in chunk:
                    err = chunk["error"]
                    why = err.get("message") if isinstance(err, dict) else err
                    raise RemoteError(f"the server at {self.url} failed mid-answer: {why}; the text so far is kept")
                yield chunk
        raise httpx.RemoteProtocolError("the stream ended without [DONE]")

    def close(self) -> None:
        self.client.close()


def _drafts(stats: RemoteStats) -> str | None:
    if stats.accepted_draft_tokens is None:
        return None
    if stats.draft_tokens is None:
        return f"{stats.accepted_draft_tokens} accepted draft tokens"
    return f"{stats.accepted_draft_tokens} of {stats.draft_tokens} drafted tokens accepted"


def stats_markdown(info: ServerInfo, stats: RemoteStats | None, ev: RemoteEvent | None) -> str:
    """The live panel for a remote answer, clearly labelled as what the server reports."""
    where = f"**remote** · {info.kind} server at {info.url} · model `{info.model}`"
    if stats is None:
        return f"{where}\n\nno speculation statistics from this server"
    parts = [f"**τ {stats.tau:.2f}** tokens per target forward" if stats.tau else None,
             _drafts(stats),
             f"{stats.target_forwards} target forwards" if stats.target_forwards is not None else None,
             f"{stats.tokens / ev.elapsed_s:.1f} tok/s" if stats.tokens and ev and ev.elapsed_s > 0 else None]
    return f"{where}\n\n{' · '.join(p for p in parts if p)} ({stats.source})"
