"""Start the eagle-chat UI: `python launcher.py` (see --help).

Loads the embedded SmolLM2 with its EAGLE head (or the model used last time), serves the
Gradio app on 127.0.0.1 and opens the browser. A public share link is created only with
--share; with --share and no --auth, visitors through the link cannot download or switch models
and each of their answers is capped (--remote-max-new-tokens, --remote-max-seconds,
--remote-max-prompt-tokens, --remote-max-message-chars; one answer at a time).
--backend URL chats through an OpenAI-compatible server instead of a local model; --api serves
the loaded model as an OpenAI-compatible API (core.serve) instead of the UI.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys

import core.threads  # noqa: I001
from core.config import WEIGHTS, WEIGHTS_HELP

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="launcher.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", help="target: 'smollm2' (embedded), a hub id (owner/name), a hub repo's GGUF "
                   "file (owner/name:Q4_K_M), a local folder or a .gguf file [default: the last model used, else "
                   "smollm2]")
    p.add_argument("--head", help="EAGLE head: hub id or local folder; 'default' = our head for the "
                   "embedded model, the catalogue's head for a catalogue model; 'none' = plain decoding "
                   "only [default: 'default']")
    p.add_argument("--port", type=int, default=None, help="local port [default: 7860 or the next free one]")
    p.add_argument("--no-browser", action="store_true",
                   help="do not open a browser tab (for headless machines: a server, SSH, a container)")
    p.add_argument("--share", action="store_true", help="also create a public Gradio link (off by default)")
    p.add_argument("--auth", metavar="USER:PASS", help="require this login (recommended with --share)")
    p.add_argument("--remote-max-new-tokens", type=int, default=256, metavar="N",
                   help="without --auth, the most new tokens one answer may have for a visitor through the "
                   "public link")
    p.add_argument("--remote-max-seconds", type=float, default=60.0, metavar="S",
                   help="without --auth, the most seconds one answer may take for a visitor through the "
                   "public link")
    p.add_argument("--remote-max-prompt-tokens", type=int, default=2048, metavar="N",
                   help="without --auth, the most prompt tokens one answer may prefill for a visitor through the "
                   "public link (the oldest exchanges are left out to fit; a longer message is refused), so the "
                   "prefill fits --remote-max-seconds too")
    p.add_argument("--max-message-chars", type=int, default=32_000, metavar="N",
                   help="the longest message (and system prompt) in characters, for every visitor")
    p.add_argument("--remote-max-message-chars", type=int, default=4_000, metavar="N",
                   help="without --auth, the longest message in characters for a visitor through the public link")
    p.add_argument("--load-in-4bit", action="store_true", help="load the target in 4-bit nf4 (bitsandbytes)")
    p.add_argument("--device", default=None, help="cpu or cuda [default: cpu, or the last one used]")
    p.add_argument("--dtype", default=None, help="auto, float32, bfloat16 or float16; auto = bf16 with exact "
                   "(batch-invariant) kernels on a CPU where the load-time check passes, else float32 "
                   "[default: auto, or the last one used]")
    p.add_argument("--attention", default=None, choices=["auto", "exact", "sdpa", "eager"],
                   help="attention kernels of the target; exact = batch-invariant (speculation bit-identical "
                   "to plain decoding in bf16) [default: auto, or the last one used]")
    p.add_argument("--weights", default=None, choices=WEIGHTS,
                   help=WEIGHTS_HELP + " [default: auto, or the last one used]")
    p.add_argument("--threads", type=int, default=None, metavar="N",
                   help="torch threads [default: OMP_NUM_THREADS if set, else every core on a quiet machine and "
                   "the idle ones on a busy one]")
    p.add_argument("--backend", metavar="URL", help="chat through this OpenAI-compatible server (our "
                   "`python -m core.serve`, vLLM, SGLang, ...) instead of loading a local model")
    p.add_argument("--api-key", metavar="KEY", help="bearer token for --backend, if the server wants one")
    p.add_argument("--api", action="store_true", help="serve the model as an OpenAI-compatible API "
                   "(/v1/chat/completions, /v1/completions, /v1/models, /metrics) instead of the UI")
    p.add_argument("--api-port", type=int, default=None, metavar="N", help="port of --api [default: 8000]")
    args = p.parse_args(argv)
    if args.auth is not None:
        user, sep, password = args.auth.partition(":")
        if not (user and sep and password):
            p.error("--auth must look like USER:PASS (both non-empty)")
        args.auth = (user, password)
    if args.port is not None and not 1 <= args.port <= 65535:
        p.error(f"--port must be in 1..65535, got {args.port}")
    if args.remote_max_new_tokens < 1:
        p.error(f"--remote-max-new-tokens must be at least 1, got {args.remote_max_new_tokens}")
    if not args.remote_max_seconds > 0:
        p.error(f"--remote-max-seconds must be positive, got {args.remote_max_seconds}")
    for flag in ("remote_max_prompt_tokens", "max_message_chars", "remote_max_message_chars"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    if args.threads is not None and args.threads < 1:
        p.error(f"--threads must be at least 1, got {args.threads}")
    refuse_combinations(p, args)
    return args


def refuse_combinations(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--backend loads no local model; --api serves no UI."""
    if args.backend is not None:
        local = [f for f, v in (("--model", args.model), ("--head", args.head), ("--load-in-4bit", args.load_in_4bit),
                                ("--api", args.api)) if v]
        if local:
            p.error(f"--backend chats through a remote server and loads no local model: drop {', '.join(local)}")
    elif args.api_key is not None:
        p.error("--api-key goes with --backend URL")
    if args.api:
        ui = [f for f, v in (("--port", args.port is not None), ("--share", args.share), ("--auth", args.auth))
              if v]
        if ui:
            p.error(f"--api serves the API instead of the UI: drop {', '.join(ui)} (the API's port is --api-port)")
    elif args.api_port is not None:
        p.error("--api-port goes with --api")
    if args.api_port is not None and not 1 <= args.api_port <= 65535:
        p.error(f"--api-port must be in 1..65535, got {args.api_port}")


def choose(args):
    """The model to start with: flags win; otherwise the last model used; otherwise SmolLM2."""
    from app.state import ModelChoice, recall

    from core.models import EMBEDDED, catalogue_entry

    base = recall() if args.model is None else None
    base = base or ModelChoice()
    head = args.head if args.head is not None else ("default" if args.model is not None else base.head)
    entry = catalogue_entry(args.model or base.model)
    if head == "default" and entry is not None and entry.target != EMBEDDED:
        head = entry.head  # a catalogue target comes with its published EAGLE head
    return ModelChoice(model=args.model or base.model, head=None if head == "none" else head,
                       dtype=args.dtype or base.dtype, device=args.device or base.device,
                       load_in_4bit=args.load_in_4bit or (base.load_in_4bit and args.model is None),
                       attention=args.attention or base.attention, weights=args.weights or base.weights)


def start_manager(args):
    from app.manager import ModelManager
    from app.models_tab import LOAD_ERRORS
    from app.state import ModelChoice, remember
    from core.decoding.engine import Engine

    choice = choose(args)
    if args.backend is not None:
        return remote_manager(args, choice)
    if choice.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            sys.exit("error: --device cuda was asked for but no CUDA GPU is available; use --device cpu")
    print(f"Loading {choice.describe()} …", flush=True)
    try:
        manager = ModelManager(Engine.load, choice)
    except LOAD_ERRORS as e:
        if args.model is not None or args.head is not None or choice == ModelChoice():
            sys.exit(f"error: {e}")
        print(f"The last model used could not be loaded ({e}); starting the embedded SmolLM2.", flush=True)
        try:
            manager = ModelManager(Engine.load, ModelChoice())
        except LOAD_ERRORS as e2:
            sys.exit(f"error: {e2}")
    remember(manager.choice)
    print(f"Numerics: {manager.engine.numerics.describe()}", flush=True)
    return manager


def remote_manager(args, choice):
    """A manager that chats through --backend; the local model (`choice`) loads only on demand."""
    from app.manager import ModelManager
    from app.remote import RemoteBackend, RemoteError
    from core.decoding.engine import Engine

    backend = RemoteBackend(args.backend, api_key=args.api_key)
    try:
        info = backend.connect()
    except RemoteError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    print(f"Chatting through {info.url} — {info.kind} server, model `{info.model}`", flush=True)
    return ModelManager(Engine.load, choice, backend=backend)


def serve_api(args, manager) -> None:
    """The loaded engine as an OpenAI-compatible API (core.serve), in place of the UI: the API
    then owns the engine and queues its answers itself, so no lane is shared with a UI."""
    import uvicorn

    from core.serve import build_app

    port = 8000 if args.api_port is None else args.api_port
    try:  # uvicorn would only log a failed bind; say it as the UI does
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))
    except OSError as e:
        sys.exit(f"error: cannot serve the API on port {port}: {e}")
    model_id = manager.choice.model
    print(f"eagle-chat API at http://127.0.0.1:{port}/v1 (model {model_id!r}, "
          f"{'EAGLE head' if manager.engine.has_head else 'no EAGLE head: context lookup speculation'})", flush=True)
    uvicorn.run(build_app(manager.engine, model_id), host="127.0.0.1", port=port, log_level="warning")


def access(args):
    from app.state import Access

    return Access(authenticated=args.auth is not None, remote_max_new_tokens=args.remote_max_new_tokens,
                  remote_max_seconds=args.remote_max_seconds, remote_max_prompt_tokens=args.remote_max_prompt_tokens,
                  max_message_chars=args.max_message_chars, remote_max_message_chars=args.remote_max_message_chars)


def main(argv=None) -> None:
    core.threads.start()  # OpenMP's wait policy, before anything imports torch (core.threads)
    args = parse_args(argv)
    if args.threads is not None or "OMP_NUM_THREADS" not in os.environ:  # an explicit setting wins
        core.threads.set_threads(args.threads)
    if args.threads is None and "OMP_NUM_THREADS" not in os.environ:
        core.threads.govern()  # refit the thread count per answer to the cores others leave idle
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    manager = start_manager(args)
    if args.api:
        serve_api(args, manager)
        return
    from app.ui import build, launch

    app = build(manager, access(args))
    try:
        local_url, share_url = launch(app, port=args.port, share=args.share, auth=args.auth,
                                      inbrowser=not args.no_browser)
    except OSError as e:
        sys.exit(f"error: cannot serve on port {args.port}: {e}")
    print(f"eagle-chat is running at {local_url}", flush=True)
    if args.share and share_url:
        print(f"Public link: {share_url}", flush=True)
        if args.auth is None:
            print(f"Anyone with the link can chat, up to {args.remote_max_new_tokens} new tokens and "
                  f"{args.remote_max_seconds:g} s per answer, prompts of {args.remote_max_prompt_tokens} tokens, "
                  f"messages of {args.remote_max_message_chars} characters, one answer at a time; downloads and model switching are disabled for "
                  "them (use --auth USER:PASS to allow everything).", flush=True)
    elif args.share:
        app.banner = ("Notice: the public share link could not be created (no internet connection to Gradio's "
                      "share servers?). The app is serving locally only.")
        print("Notice: could not create a public share link (offline?). Serving locally only at "
              f"{local_url}", flush=True)
    try:
        app.demo.block_thread()
    except KeyboardInterrupt:
        pass
    finally:
        app.demo.close()


if __name__ == "__main__":
    main()
