"""OpenAI-compatible HTTP server for the engine: `python -m core.serve [--model M --head H --port P]`.

Numerics are the other entry points' (`--dtype auto --attention auto`: bf16 with exact kernels
on CPU where the probe passes), so a greedy answer is the same as `core.generate`'s and the app's.

Endpoints: GET /v1/models, POST /v1/chat/completions, POST /v1/completions (server-sent
events with `"stream": true`, one JSON body otherwise), GET /metrics (Prometheus text).
Request fields: messages | prompt, max_tokens, temperature, top_p, stop, seed, stream,
stream_options.include_usage, n (1 only), and vLLM's continue_final_message (chat: the answer
continues the final assistant message, e.g. a prefilled "```json", instead of starting a new turn;
add_generation_prompt may then be false or absent); other fields are ignored. A chat request without
max_tokens gets at most --default-max-tokens (512), a completion OpenAI's 16.

Guards (a web page the user visits can POST to localhost, and a busy server must say so):
  401  --api-key KEY set and no `Authorization: Bearer KEY` (required off loopback hosts)
  415  a body not sent as `Content-Type: application/json`: a cross-site form or `text/plain`
       fetch (a CORS "simple request", sent without a preflight) is refused; no CORS headers
  413  a body over --max-body-bytes (1 MiB)
  400  a prompt over --max-prompt-tokens (8192) or the model's context
  429  --max-queue answers already wait behind the running one (with Retry-After)

Extension field `eagle` (every chunk, and the final `usage`), running totals of this answer:
  tokens                 tokens generated so far
  accepted_draft_tokens  tokens that came from the draft head and the target accepted
  target_forwards        target forward passes so far (prefill included)
  tau                    tokens / target_forwards (1.0 = no speed-up from speculation)
  step_tokens, step_draft_tokens   this chunk's tokens and how many of them were drafted

Answers queue on the one engine (a lock held for a whole answer) and every step runs on one
worker thread inside `torch.inference_mode()`; tokenising runs on another thread, so the event
loop stays free. A client that disconnects, streaming or not, stops its answer within one step, or,
while its prompt is still being read, before the prompt's next chunk (core.decoding.forward.prefill_chunk).
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import ipaddress
import json
import logging
import math
import os
import sys
import threading
import time
import uuid
from dataclasses import dataclass

import core.threads  # noqa: I001
from core.threads import set_threads

if __name__ == "__main__":  # run as a command: choose the OpenMP policy before torch loads (core.threads)
    core.threads.start()

import torch
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from core.config import (DTYPE_NAMES, ConfigError, GenerationConfig, SamplingConfig, TreeConfig, add_runtime_args,
                         add_tree_args, tree_changes)
from core.decoding.engine import Engine, EngineError, StepEvent

log = logging.getLogger("eagle_chat.serve")
FINISH = {"eos": "stop", "stop": "stop", "length": "length", "context": "length"}
ROLES = ("system", "user", "assistant")
API_KEY_ENV = "EAGLE_CHAT_API_KEY"  # --api-key's default: a key on the command line shows in `ps`


class ApiError(Exception):
    """A request the API refuses; rendered as OpenAI's {"error": {...}} object."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers

    def response(self) -> JSONResponse:
        kind = {401: "authentication_error", 429: "rate_limit_error"}.get(
            self.status, "invalid_request_error" if self.status < 500 else "server_error")
        return JSONResponse({"error": {"message": self.message, "type": kind, "param": self.param,
                                       "code": self.code}}, status_code=self.status, headers=self.headers)


@dataclass(frozen=True)
class ServeConfig:
    """What the server accepts, validated once; the CLI only parses. The defaults bound one
    request's work: 1 MiB holds far more text than a context, 8192 tokens is SmolLM2's whole
    context (a CPU prefill of tens of seconds), 512 tokens a long chat answer."""

    api_key: str | None = None      # clients send `Authorization: Bearer <api_key>`; None: no check
    max_body_bytes: int = 1 << 20
    max_prompt_tokens: int = 8192   # and never more than the model's context leaves room for
    default_max_tokens: int = 512   # a chat request without max_tokens
    max_queue: int = 8              # answers that may wait behind the running one
    tree: tuple[tuple[str, int], ...] = ()  # (setting, value) over the engine's default tree (--depth, ...)
    adaptive: bool = False  # GenerationConfig.adaptive (`serve --adaptive`)

    def __post_init__(self):
        if self.api_key is not None and not self.api_key.strip():
            raise ConfigError("--api-key is empty; give a non-empty key, or leave the option out for no key")
        for name, lo in (("max_body_bytes", 1), ("max_prompt_tokens", 1), ("default_max_tokens", 1),
                         ("max_queue", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < lo:
                raise ConfigError(f"--{name.replace('_', '-')} must be an integer >= {lo}, got {value!r}")
        TreeConfig().override(**dict(self.tree))

    def tree_over(self, default: TreeConfig) -> TreeConfig:
        """The tree every answer drafts: the engine's default with this server's settings over it."""
        return default.override(**dict(self.tree))


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 or localhost: only this machine can connect."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve to any interface
        return False


@dataclass(frozen=True)
class Job:
    """One parsed request: prompt token ids and the engine settings for the answer."""

    chat: bool
    ids: tuple[int, ...]
    config: GenerationConfig
    stream: bool
    include_usage: bool
    continues: bool = False  # the ids end with a partial answer that this one continues (its text follows it)


# ---- request parsing --------------------------------------------------------------------
def _number(body: dict, name: str, default: float, lo: float, hi: float) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
        raise ApiError(400, f"{name} must be a number in [{lo:g}, {hi:g}], got {v!r}", name)
    return float(v)


def _integer(body: dict, name: str, lo: int, hi: int) -> int | None:
    v = body.get(name)
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi):
        raise ApiError(400, f"{name} must be an integer in [{lo}, {hi}], got {v!r}", name)
    return v


def _stops(v) -> tuple[str, ...]:
    stops = [v] if isinstance(v, str) else v if v is not None else []
    if not isinstance(stops, list) or len(stops) > 4 or not all(isinstance(s, str) and s for s in stops):
        raise ApiError(400, f"stop must be a non-empty string or a list of up to 4 of them, got {v!r}", "stop")
    return tuple(stops)


def _text(content, i: int) -> str:
    """Message content: a string or a list of text parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise ApiError(400, f"messages[{i}].content must be a string or a list of text parts", "messages")


def _messages(v) -> list[dict]:
    if not isinstance(v, list) or not v:
        raise ApiError(400, "messages must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(v):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ApiError(400, f"messages[{i}] needs a role of {', '.join(ROLES)}", "messages")
        out.append({"role": m["role"], "content": _text(m.get("content"), i)})
    return out


def _prompt_ids(engine: Engine, v) -> list[int]:
    """A /v1/completions prompt: raw text (no chat template), one text in a list, or token ids."""
    if isinstance(v, list) and len(v) == 1 and isinstance(v[0], str):
        v = v[0]
    if isinstance(v, str):
        if not v:
            raise ApiError(400, "prompt is empty", "prompt")
        return list(engine.target.tokenizer(v)["input_ids"])
    vocab = engine.target.model.config.vocab_size
    if isinstance(v, list) and v and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab
                                         for t in v):
        return list(v)
    raise ApiError(400, f"prompt must be a string, a list with one string, or token ids in 0..{vocab - 1}",
                   "prompt")


def parse(body, engine: Engine, model_id: str, chat: bool, limits: ServeConfig = ServeConfig()) -> Job:
    """A request body -> a Job; tokenises, so the server calls it off the event loop."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    if body.get("model") not in (None, model_id):
        raise ApiError(404, f"the model {body['model']!r} does not exist; this server serves {model_id!r}",
                       "model", "model_not_found")
    if body.get("n") not in (None, 1):
        raise ApiError(400, "only n=1 is supported", "n")
    if not isinstance(body.get("stream", False), bool):
        raise ApiError(400, "stream must be true or false", "stream")
    continues = chat and _continues(body)
    try:
        ids = (engine.encode(_messages(body.get("messages")), continue_final=continues) if chat
               else _prompt_ids(engine, body.get("prompt")))
    except EngineError as e:
        raise ApiError(400, str(e), "messages" if chat else "prompt") from e
    except ValueError as e:  # e.g. a tokenizer without a chat template, or a template that refuses roles
        raise ApiError(400, f"cannot build the prompt with the model's chat template: {e}", "messages") from e
    room = engine.max_context - len(ids)
    if room <= 0:
        raise ApiError(400, f"the prompt is {len(ids)} tokens but the model's context is {engine.max_context} "
                       "tokens; shorten it", "messages" if chat else "prompt", "context_length_exceeded")
    if len(ids) > limits.max_prompt_tokens:
        raise ApiError(400, f"the prompt is {len(ids)} tokens but this server accepts at most "
                       f"{limits.max_prompt_tokens} (its --max-prompt-tokens); shorten the prompt",
                       "messages" if chat else "prompt", "context_length_exceeded")
    name = "max_completion_tokens" if chat and "max_tokens" not in body else "max_tokens"  # chat has both
    max_tokens = _integer(body, name, 1, 1 << 31)
    if max_tokens is not None and max_tokens > room:
        raise ApiError(400, f"the prompt ({len(ids)} tokens) plus {name} ({max_tokens}) exceed the model's "
                       f"context ({engine.max_context} tokens)", name, "context_length_exceeded")
    seed = _integer(body, "seed", -(1 << 63), (1 << 64) - 1)
    options = body.get("stream_options") or {}
    try:
        sampling = SamplingConfig(temperature=_number(body, "temperature", 1.0, 0, 2),
                                  top_p=_number(body, "top_p", 1.0, 0, 1))
        default = limits.default_max_tokens if chat else 16  # 16: OpenAI's default for completions
        tree = limits.tree_over(engine.default_tree)
        config = GenerationConfig(max_new_tokens=max_tokens or min(default, room),  # without a head: context lookup
                                  speculative=engine.has_head or bool(tree.lookup), tree=tree,
                                  sampling=sampling, adaptive=limits.adaptive,
                                  stop_strings=_stops(body.get("stop")), seed=seed)
    except ConfigError as e:
        raise ApiError(400, str(e)) from e
    return Job(chat, tuple(ids), config, body.get("stream", False),
               isinstance(options, dict) and options.get("include_usage") is True, continues)


def _continues(body: dict) -> bool:
    """vLLM's continue_final_message (with add_generation_prompt false or absent)."""
    for name in ("continue_final_message", "add_generation_prompt"):
        if not isinstance(body.get(name, False), bool):
            raise ApiError(400, f"{name} must be true or false", name)
    continues = body.get("continue_final_message", False)
    if continues and body.get("add_generation_prompt", False):
        raise ApiError(400, "continue_final_message and add_generation_prompt cannot both be true: the answer either "
                       "continues the final assistant message or starts a new turn", "continue_final_message")
    return continues


# ---- guards: who may ask, and what the server reads ---------------------------------------
def check_key(request: Request, key: str | None) -> None:
    if key is None:
        return
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    fix = "send the header 'Authorization: Bearer <key>' with the key the server was started with (--api-key)"
    if scheme.lower() != "bearer" or not given.strip():
        raise ApiError(401, f"this server needs an API key: {fix}", code="missing_api_key",
                       headers={"WWW-Authenticate": "Bearer"})
    if not hmac.compare_digest(given.strip().encode(), key.encode()):  # constant time: no guessing by timing
        raise ApiError(401, f"the API key is wrong: {fix}", code="invalid_api_key",
                       headers={"WWW-Authenticate": "Bearer"})


async def read_json(request: Request, limit: int):
    """The body as JSON: only `application/json` (a cross-site page can send text/plain or a form
    without a CORS preflight, never JSON), and at most `limit` bytes, counted as they arrive."""
    kind = request.headers.get("content-type", "")
    if kind.split(";")[0].strip().lower() != "application/json":
        raise ApiError(415, f"the request body must be JSON sent with 'Content-Type: application/json', got "
                       f"{repr(kind) if kind else 'no Content-Type'}; set that header", code="unsupported_media_type")
    too_big = f"bytes but this server accepts at most {limit} (its --max-body-bytes); send a shorter request"
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise ApiError(413, f"the request body is {int(length)} {too_big}", code="request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():  # a chunked upload has no length to check up front
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"the request body is over {limit} {too_big}", code="request_too_large")
        chunks.append(chunk)
    try:
        return json.loads(b"".join(chunks))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}") from e


async def _disconnected(request: Request) -> None:
    """Returns when the client hangs up (the body is read by now, so only that message is left)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


# ---- statistics -------------------------------------------------------------------------
class Metrics:
    """Prometheus counters over the server's life, plus tau of the latest answer."""

    HELP = {"requests": ("counter", "Answers started."),
            "generated_tokens": ("counter", "Tokens generated."),
            "accepted_draft_tokens": ("counter", "Drafted tokens the target accepted."),
            "target_forwards": ("counter", "Target forward passes (prefill included)."),
            "disconnected": ("counter", "Answers stopped early because the client disconnected."),
            "refused_busy": ("counter", "Requests refused with 429 because the queue was full."),
            "tau": ("gauge", "Tokens per target forward in the latest answer.")}

    def __init__(self):
        self.values = dict.fromkeys(self.HELP, 0.0)

    def step(self, ev: StepEvent, forwards_before: int) -> None:
        v = self.values
        v["generated_tokens"] += len(ev.token_ids)
        v["accepted_draft_tokens"] += ev.draft_tokens
        v["target_forwards"] += ev.target_forwards - forwards_before
        v["tau"] = ev.total_tokens / ev.target_forwards

    def render(self) -> str:
        lines = []
        for key, (kind, text) in self.HELP.items():
            name = f"eagle_chat_{key}" + ("_total" if kind == "counter" else "")
            lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}", f"{name} {self.values[key]:g}"]
        return "\n".join(lines) + "\n"


class Tally:
    """Running speculation totals of one answer -> the `eagle` extension field."""

    def __init__(self, metrics: Metrics):
        self.metrics, self.accepted, self.forwards, self.eagle = metrics, 0, 0, None

    def add(self, ev: StepEvent) -> dict:
        self.metrics.step(ev, self.forwards)
        self.accepted, self.forwards = self.accepted + ev.draft_tokens, ev.target_forwards
        self.eagle = {"tokens": ev.total_tokens, "accepted_draft_tokens": self.accepted,
                      "target_forwards": ev.target_forwards, "tau": round(ev.total_tokens / ev.target_forwards, 4),
                      "step_tokens": len(ev.token_ids), "step_draft_tokens": ev.draft_tokens}
        return self.eagle

    def usage(self, prompt_tokens: int) -> dict:
        e = self.eagle or {"tokens": 0}
        return {"prompt_tokens": prompt_tokens, "completion_tokens": e["tokens"],
                "total_tokens": prompt_tokens + e["tokens"],
                "eagle": {k: e[k] for k in ("accepted_draft_tokens", "target_forwards", "tau") if k in e}}


# ---- the engine worker ------------------------------------------------------------------
def _step(gen) -> StepEvent | None:
    with torch.inference_mode():
        return next(gen, None)


class Worker:
    """The one thread that runs the engine; `lock` queues whole answers in arrival order, and at
    most `max_queue` may wait behind the running one (429 beyond that)."""

    def __init__(self, engine: Engine, max_queue: int, threads: int | None = None):
        self.engine, self.max_queue = engine, max_queue
        if threads:  # torch keeps a thread count per thread: the engine thread's own
            core.threads.on_engine_thread(torch.set_num_threads, threads)
        self.lock = asyncio.Lock()
        self.admitted = 0       # answers running or waiting
        self.answer_s = 1.0     # the last answer's wall time: how soon a place frees up

    async def call(self, fn, *args):
        """fn(*args) on the process's one engine thread, which also loaded the model
        (core.threads.on_engine_thread: a second thread running OpenMP work halves the speed)."""
        return await asyncio.get_running_loop().run_in_executor(core.threads.engine_executor(), fn, *args)

    def admit(self) -> None:
        if self.admitted > self.max_queue:
            retry = min(600, max(1, math.ceil(self.answer_s)))
            raise ApiError(429, f"the server is busy: one answer runs and {self.admitted - 1} wait, the most it "
                           f"queues (its --max-queue); retry in about {retry} s", code="queue_full",
                           headers={"Retry-After": str(retry)})
        self.admitted += 1


class Answer:
    """One admitted answer: a queue place from creation (429 if there is none), the engine lock
    from its first step; close() gives both back (idempotent) and, while a long prompt is still
    being read, stops the reading before its next chunk (the client is gone: nobody reads on)."""

    def __init__(self, worker: Worker):
        worker.admit()
        self.worker, self.gen, self.queued, self.locked, self.started = worker, None, True, False, 0.0
        self.stop = threading.Event()

    async def events(self, job: Job):
        await self.worker.lock.acquire()
        self.locked, self.started = True, time.perf_counter()
        self.gen = self.worker.engine.generate(list(job.ids), job.config, should_stop=self.stop.is_set,
                                               continue_final=job.continues)
        while (ev := await self.worker.call(_step, self.gen)) is not None:
            yield ev

    def close(self) -> None:
        self.stop.set()  # asked between a prompt's chunks, in the engine's thread
        if self.gen is not None:
            core.threads.engine_executor().submit(self.gen.close)  # after any step in flight: it is FIFO
            self.gen = None
        if self.locked:
            self.locked = False
            self.worker.answer_s = time.perf_counter() - self.started
            self.worker.lock.release()
        if self.queued:
            self.queued = False
            self.worker.admitted -= 1


class SSE(StreamingResponse):
    """Server-sent events that run `on_close` however the stream ends (done, error, disconnect)."""

    def __init__(self, body, on_close):
        super().__init__(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


# ---- responses --------------------------------------------------------------------------
def _choice(job: Job, text: str, finish: str | None, delta: bool) -> dict:
    if not job.chat:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    message = {"content": text} if delta else {"role": "assistant", "content": text}
    return {"index": 0, "delta" if delta else "message": message, "logprobs": None, "finish_reason": finish}


def _data(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


class Api:
    """The endpoints' logic around one engine: check, parse, queue, answer, count."""

    def __init__(self, engine: Engine, model_id: str, limits: ServeConfig, threads: int | None = None):
        self.engine, self.model_id, self.limits = engine, model_id, limits
        self.worker, self.metrics = Worker(engine, limits.max_queue, threads), Metrics()

    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_id, "object": "model", "created": 0,
                                            "owned_by": "eagle-chat", "max_model_len": self.engine.max_context}]}

    def prometheus(self) -> PlainTextResponse:
        return PlainTextResponse(self.metrics.render(), media_type="text/plain; version=0.0.4")

    async def complete(self, request: Request, chat: bool):
        try:
            body = await read_json(request, self.limits.max_body_bytes)
        except ClientDisconnect:
            return Response(status_code=499)  # gone mid-upload: nobody reads a reply
        try:
            answer = Answer(self.worker)
        except ApiError:
            self.metrics.values["refused_busy"] += 1
            raise
        try:
            job = await asyncio.to_thread(parse, body, self.engine, self.model_id, chat, self.limits)
        except BaseException:
            answer.close()
            raise
        self.metrics.values["requests"] += 1
        head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", "created": int(time.time()),
                "model": self.model_id}
        if not job.stream:
            return await self.whole(request, job, answer,
                                    {**head, "object": "chat.completion" if chat else "text_completion"})
        chunk_head = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}
        return SSE(self.stream(job, answer, chunk_head), answer.close)

    async def whole(self, request: Request, job: Job, answer: Answer, head: dict):
        """One JSON answer, stopped within one step if the client disconnects while it waits."""
        tally, events = Tally(self.metrics), []

        async def run():
            async for ev in answer.events(job):
                tally.add(ev)
                events.append(ev)

        work, gone = asyncio.ensure_future(run()), asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (work, gone):
                task.cancel()
            answer.close()
            await asyncio.gather(work, gone, return_exceptions=True)
        if work.cancelled():  # the client went first
            self.metrics.values["disconnected"] += 1
            return Response(status_code=499)  # nginx's "client closed request": nobody reads it
        work.result()  # an engine error -> the 500 handler
        text = "".join(ev.text for ev in events)
        return {**head, "choices": [_choice(job, text, FINISH.get(events[-1].finish_reason), delta=False)],
                "usage": tally.usage(len(job.ids)), "eagle": tally.eagle}

    async def stream(self, job: Job, answer: Answer, head: dict):
        tally = Tally(self.metrics)
        try:
            if job.chat:
                yield _data({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                  "logprobs": None, "finish_reason": None}]})
            async for ev in answer.events(job):
                yield _data({**head, "choices": [_choice(job, ev.text, FINISH.get(ev.finish_reason), True)],
                             "eagle": tally.add(ev)})
            if job.include_usage:
                yield _data({**head, "choices": [], "usage": tally.usage(len(job.ids))})
            yield "data: [DONE]\n\n"
        except Exception as e:  # headers are sent: report in-band, as OpenAI-style servers do
            log.exception("streamed answer failed")
            yield _data({"error": {"message": f"the answer failed ({type(e).__name__}); see the server log",
                                   "type": "server_error", "param": None, "code": None}})
        finally:
            answer.close()


def build_app(engine: Engine, model_id: str | None = None, limits: ServeConfig = ServeConfig(),
              threads: int | None = None) -> FastAPI:
    """The API around a loaded engine (also used by tests and `launcher.py --api`). `threads`:
    torch threads of the engine's worker thread (None: the process's setting). No CORS
    middleware: browsers then refuse cross-site pages' JSON requests at the preflight."""
    api = Api(engine, model_id or engine.target.name, limits, threads)

    async def authorized(request: Request) -> None:
        check_key(request, limits.api_key)

    app = FastAPI(title="eagle-chat", docs_url=None, redoc_url=None, openapi_url=None,
                  dependencies=[Depends(authorized)])
    app.state.api = api

    @app.exception_handler(ApiError)
    async def api_error(_, e: ApiError):
        return e.response()

    @app.exception_handler(HTTPException)
    async def http_error(_, e: HTTPException):
        return ApiError(e.status_code, str(e.detail), headers=getattr(e, "headers", None)).response()

    @app.exception_handler(Exception)
    async def server_error(_, e: Exception):
        log.exception("request failed")
        return ApiError(500, f"internal error ({type(e).__name__}); see the server log").response()

    app.get("/v1/models")(api.models)
    app.get("/metrics")(api.prometheus)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await api.complete(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await api.complete(request, chat=False)

    return app


def parse_args(argv=None) -> argparse.Namespace:
    from core.models import EMBEDDED

    p = argparse.ArgumentParser(prog="python -m core.serve", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=EMBEDDED, help="'smollm2' (embedded), a hub id, owner/name:QUANT (a hub "
                   "repo's GGUF file), a local folder or a .gguf file")
    p.add_argument("--head", default="default", help="head folder or hub id; 'default' = the model's "
                   "shipped or catalogue head; 'none' = plain decoding")
    p.add_argument("--served-model-name", default=None, help="the model id clients send [default: --model]")
    add_runtime_args(p, dtype_help=': as core.generate and the app')
    add_tree_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on; any but a loopback one "
                   "(127.0.0.1, ::1, localhost) needs --api-key")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--adaptive", action="store_true", help="each step runs the mode measured faster "
                   "in the answer (speculative or plain; the app's default), where otherwise the tree's long-context "
                   "caps decide alone")
    p.add_argument("--api-key", default=None, metavar="KEY", help="clients must send 'Authorization: Bearer "
                   f"KEY' [default: ${API_KEY_ENV}, which keeps the key out of the process list]")
    d = ServeConfig()
    p.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes, help="413 above [%(default)s]")
    p.add_argument("--max-prompt-tokens", type=int, default=d.max_prompt_tokens, help="400 above [%(default)s]")
    p.add_argument("--default-max-tokens", type=int, default=d.default_max_tokens,
                   help="max_tokens of a chat request that gives none [%(default)s]")
    p.add_argument("--max-queue", type=int, default=d.max_queue,
                   help="answers that may wait behind the running one; 429 beyond [%(default)s]")
    return p.parse_args(argv)


def check_args(a: argparse.Namespace) -> ServeConfig:
    """Everything that can be refused without the model, refused before it loads (seconds)."""
    if a.threads is not None and a.threads < 1:
        raise ConfigError(f"--threads must be >= 1, got {a.threads}")
    if a.dtype not in DTYPE_NAMES:
        raise ConfigError(f"unknown --dtype {a.dtype!r}; choose one of {', '.join(DTYPE_NAMES)}")
    if not 0 <= a.port <= 65535:
        raise ConfigError(f"--port must be in 0..65535, got {a.port}")
    key = a.api_key if a.api_key is not None else os.environ.get(API_KEY_ENV) or None
    limits = ServeConfig(api_key=key, max_body_bytes=a.max_body_bytes, max_prompt_tokens=a.max_prompt_tokens,
                         default_max_tokens=a.default_max_tokens, max_queue=a.max_queue,
                         tree=tuple(tree_changes(a).items()), adaptive=a.adaptive)
    if key is None and not is_loopback(a.host):
        raise ConfigError(f"--host {a.host} is not a loopback address, so anyone who can reach this machine "
                          f"could use the API: give --api-key KEY (or set {API_KEY_ENV}; clients then send "
                          "'Authorization: Bearer KEY'), or serve on --host 127.0.0.1")
    return limits


def main(argv=None) -> int:
    core.threads.start()  # no-op where the command line (or the launcher) already did
    import uvicorn

    from core.decoding.head import HeadLoadError
    from core.models import ModelLoadError

    a = parse_args(argv)
    try:
        limits = check_args(a)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    threads = set_threads(a.threads)
    try:
        engine = core.threads.on_engine_thread(  # the thread every answer's steps run on (Worker.call)
            Engine.load, a.model, None if a.head == "none" else a.head, dtype=a.dtype, attention=a.attention,
            device=a.device, load_in_4bit=a.load_in_4bit, weights=a.weights)
    except (ModelLoadError, HeadLoadError, ConfigError, EngineError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    app = build_app(engine, a.served_model_name or a.model, limits, threads)
    print(f"[numerics] {engine.numerics.describe()}", file=sys.stderr)
    print(f"[threads] {threads} torch threads ({core.threads.policy().wait} wait)", file=sys.stderr, flush=True)
    print(f"eagle-chat API at http://{a.host}:{a.port}/v1 (model {a.served_model_name or a.model!r}, "
          f"{'EAGLE head' if engine.has_head else 'no EAGLE head: context lookup speculation'}"
          f"{', API key required' if limits.api_key else ''})", flush=True)
    uvicorn.run(app, host=a.host, port=a.port, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
