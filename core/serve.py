"""OpenAI-compatible HTTP server for the engine: `python -m core.serve [--model M --head H --port P]`.

Endpoints: GET /v1/models, POST /v1/chat/completions, POST /v1/completions (server-sent
events with `"stream": true`, one JSON body otherwise), GET /metrics (Prometheus text).
Request fields: messages | prompt, max_tokens, temperature, top_p, stop, seed, stream,
stream_options.include_usage, n (1 only); other fields are ignored.

Extension field `eagle` (every chunk, and the final `usage`), running totals of this answer:
  tokens                 tokens generated so far
  accepted_draft_tokens  tokens that came from the draft head and the target accepted
  target_forwards        target forward passes so far (prefill included)
  tau                    tokens / target_forwards (1.0 = no speed-up from speculation)
  step_tokens, step_draft_tokens   this chunk's tokens and how many of them were drafted

Answers queue on the one engine (a lock held for a whole answer) and every step runs on one
worker thread inside `torch.inference_mode()`, so the event loop stays free. A client that
disconnects mid-stream stops its answer within one step.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException

from core.config import ConfigError, GenerationConfig, SamplingConfig
from core.engine import Engine, EngineError, StepEvent

log = logging.getLogger("eagle_chat.serve")
FINISH = {"eos": "stop", "stop": "stop", "length": "length", "context": "length"}
ROLES = ("system", "user", "assistant")


class ApiError(Exception):
    """A request the API refuses; rendered as OpenAI's {"error": {...}} object."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def response(self) -> JSONResponse:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return JSONResponse({"error": {"message": self.message, "type": kind, "param": self.param,
                                       "code": self.code}}, status_code=self.status)


@dataclass(frozen=True)
class Job:
    """One parsed request: prompt token ids and the engine settings for the answer."""

    chat: bool
    ids: tuple[int, ...]
    config: GenerationConfig
    stream: bool
    include_usage: bool


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


def parse(body, engine: Engine, model_id: str, chat: bool) -> Job:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    if body.get("model") not in (None, model_id):
        raise ApiError(404, f"the model {body['model']!r} does not exist; this server serves {model_id!r}",
                       "model", "model_not_found")
    if body.get("n") not in (None, 1):
        raise ApiError(400, "only n=1 is supported", "n")
    if not isinstance(body.get("stream", False), bool):
        raise ApiError(400, "stream must be true or false", "stream")
    try:
        ids = engine.encode(_messages(body.get("messages"))) if chat else _prompt_ids(engine, body.get("prompt"))
    except EngineError as e:
        raise ApiError(400, str(e), "messages" if chat else "prompt") from e
    except ValueError as e:  # e.g. a tokenizer without a chat template, or a template that refuses roles
        raise ApiError(400, f"cannot build the prompt with the model's chat template: {e}", "messages") from e
    room = engine.max_context - len(ids)
    if room <= 0:
        raise ApiError(400, f"the prompt is {len(ids)} tokens but the model's context is {engine.max_context} "
                       "tokens; shorten it", "messages" if chat else "prompt", "context_length_exceeded")
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
        config = GenerationConfig(max_new_tokens=max_tokens or (room if chat else min(16, room)),
                                  speculative=engine.has_head, tree=engine.default_tree, sampling=sampling,
                                  stop_strings=_stops(body.get("stop")), seed=seed)
    except ConfigError as e:
        raise ApiError(400, str(e)) from e
    return Job(chat, tuple(ids), config, body.get("stream", False),
               isinstance(options, dict) and options.get("include_usage") is True)


# ---- statistics -------------------------------------------------------------------------
class Metrics:
    """Prometheus counters over the server's life, plus tau of the latest answer."""

    HELP = {"requests": ("counter", "Answers started."),
            "generated_tokens": ("counter", "Tokens generated."),
            "accepted_draft_tokens": ("counter", "Drafted tokens the target accepted."),
            "target_forwards": ("counter", "Target forward passes (prefill included)."),
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


def _collect(gen) -> list[StepEvent]:
    with torch.inference_mode():
        return list(gen)


class Worker:
    """The one thread that runs the engine; `lock` queues whole answers in arrival order."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self.lock = asyncio.Lock()

    async def call(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)


class Answer:
    """One streamed answer: holds the lock from its first step until close() (idempotent)."""

    def __init__(self, worker: Worker, job: Job):
        self.worker, self.job, self.gen, self.locked = worker, job, None, False

    async def events(self):
        await self.worker.lock.acquire()
        self.locked = True
        self.gen = self.worker.engine.generate(list(self.job.ids), self.job.config)
        while (ev := await self.worker.call(_step, self.gen)) is not None:
            yield ev

    def close(self) -> None:
        if self.gen is not None:
            self.worker.pool.submit(self.gen.close)  # after any step in flight: the pool is FIFO
            self.gen = None
        if self.locked:
            self.locked = False
            self.worker.lock.release()


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
    """The endpoints' logic around one engine: parse, queue, answer, count."""

    def __init__(self, engine: Engine, model_id: str):
        self.engine, self.model_id = engine, model_id
        self.worker, self.metrics = Worker(engine), Metrics()

    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_id, "object": "model", "created": 0,
                                            "owned_by": "eagle-chat", "max_model_len": self.engine.max_context}]}

    def prometheus(self) -> PlainTextResponse:
        return PlainTextResponse(self.metrics.render(), media_type="text/plain; version=0.0.4")

    async def complete(self, request: Request, chat: bool):
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the request body is not valid JSON: {e}") from e
        job = parse(body, self.engine, self.model_id, chat)
        self.metrics.values["requests"] += 1
        head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", "created": int(time.time()),
                "model": self.model_id}
        if not job.stream:
            return await self.whole(job, {**head, "object": "chat.completion" if chat else "text_completion"})
        answer = Answer(self.worker, job)
        chunk_head = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}
        return SSE(self.stream(job, answer, chunk_head), answer.close)

    async def whole(self, job: Job, head: dict) -> dict:
        async with self.worker.lock:
            events = await self.worker.call(_collect, self.engine.generate(list(job.ids), job.config))
        tally = Tally(self.metrics)
        for ev in events:
            tally.add(ev)
        text = "".join(ev.text for ev in events)
        return {**head, "choices": [_choice(job, text, FINISH.get(events[-1].finish_reason), delta=False)],
                "usage": tally.usage(len(job.ids)), "eagle": tally.eagle}

    async def stream(self, job: Job, answer: Answer, head: dict):
        tally = Tally(self.metrics)
        try:
            if job.chat:
                yield _data({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                  "logprobs": None, "finish_reason": None}]})
            async for ev in answer.events():
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


def build_app(engine: Engine, model_id: str | None = None) -> FastAPI:
    """The API around a loaded engine (also used by tests and `launcher.py --api`)."""
    api = Api(engine, model_id or engine.target.name)
    app = FastAPI(title="eagle-chat", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.api = api

    @app.exception_handler(ApiError)
    async def api_error(_, e: ApiError):
        return e.response()

    @app.exception_handler(HTTPException)
    async def http_error(_, e: HTTPException):
        return ApiError(e.status_code, str(e.detail)).response()

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


def main(argv=None) -> int:
    import uvicorn

    from core.head import HeadLoadError
    from core.models import EMBEDDED, ModelLoadError

    p = argparse.ArgumentParser(prog="python -m core.serve", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=EMBEDDED, help="'smollm2' (embedded), a hub id or a local folder")
    p.add_argument("--head", default="default", help="head folder or hub id; 'default' = the model's "
                   "shipped or catalogue head; 'none' = plain decoding")
    p.add_argument("--served-model-name", default=None, help="the model id clients send [default: --model]")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--load-in-4bit", action="store_true")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    a = p.parse_args(argv)
    try:
        engine = Engine.load(a.model, None if a.head == "none" else a.head, dtype=a.dtype, device=a.device,
                             load_in_4bit=a.load_in_4bit)
    except (ModelLoadError, HeadLoadError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    app = build_app(engine, a.served_model_name or a.model)
    print(f"eagle-chat API at http://{a.host}:{a.port}/v1 (model {a.served_model_name or a.model!r}, "
          f"{'EAGLE head' if engine.has_head else 'plain decoding'})", flush=True)
    uvicorn.run(app, host=a.host, port=a.port, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
