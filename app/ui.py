"""The Blocks layout and its wiring. Handlers live in app.session; rendering in app.chat."""

from __future__ import annotations

import json

import gradio as gr

from app.chat import BONUS, DRAFT, PLAIN, empty_frame
from app.chats_ui import CHATS_VIEW, chat_list, stores, versions_row
from app.controls import control_props, tree_updates
from app.manager import CUSTOM, ModelManager, catalogue_frame
from app.models_tab import LOCKED
from app.session import Handlers
from app.state import TREE_LIMIT_JS, Access, ChatSettings, follow_depth_js, tree_limit
from core.config import GenerationConfig, TreeConfig
from core.models import CATALOGUE

# every column of the catalogue fits the page; long ids wrap inside their cell
CATALOGUE_WIDTHS = ["17%", "19%", "20%", "8%", "9%", "9%", "9%", "9%"]
COLORS = {DRAFT: "#16a34a", BONUS: "#f97316", PLAIN: "#6b7280"}
CSS = """
.tok-view { max-height: 320px; overflow-y: auto; white-space: pre-wrap; font-family: ui-monospace, monospace; font-size: 0.9em; line-height: 1.6; }
.tok-draft { background: #bbf7d0; color: #14532d; border-radius: 3px; }
.tok-bonus { background: #fed7aa; color: #7c2d12; border-radius: 3px; }
.tok-plain { background: #e5e7eb; color: #111827; border-radius: 3px; }
.tok-legend span { padding: 1px 6px; margin-right: 6px; font-size: 0.85em; }
#notice p, #tree-limit p { color: #b45309; }
#versions { flex-wrap: nowrap; }  /* back, "Answer 2 of 3", forward: one line, also on a phone */
#versions-label { text-align: center; min-width: 0; white-space: nowrap; }
@media (max-width: 480px) { #versions-label, #versions-label * { font-size: 13px !important; } }
/* toasts repeat a message shown in place; at the bottom they do not cover the catalogue's columns */
.toast-wrap { top: auto !important; bottom: var(--size-4) !important; }
[data-testid="toast-body"] { max-height: 30vh; overflow-y: auto; }  /* Gradio groups warnings into one */
/* long messages (a refused pickle's reason, a path) wrap instead of running off or being cut */
#notice, #model-result, #compare-summary, [data-testid="toast-text"] { overflow-wrap: anywhere; }
/* an unchecked box that can be checked looks clickable; a disabled one looks disabled */
input[type=checkbox]:not(:checked):not(:disabled) { background-color: #ffffff; border: 2px solid #6366f1; }
input[type=checkbox]:disabled { opacity: 0.45; cursor: not-allowed; }
label:has(> input[type=checkbox]:disabled) { cursor: not-allowed; }
/* a number outside its slider's range is marked while typed; see PAGE_JS for the note */
input[type=number]:invalid { outline: 2px solid #dc2626; }
.range-note { color: #b45309; font-size: 0.85em; margin-top: 2px; }
/* an accordion built open so its controls mount with the page (MOUNTED_CLOSED), until the page closes it */
.mounted-closed:not([data-closed]) [data-testid="accordion-content"] { display: none !important; }
"""
# Gradio mounts a closed accordion's controls only when it opens, and an update that arrives while
# they mount can be lost: a control then shows its first value (CI: max new tokens 256 where the
# browser kept 60, about 1 run in 8), and the next save keeps that. The accordions whose controls
# the page load sets (the kept settings) are built open, so their controls mount with the page
# before any event, and PAGE_JS closes them at once (CSS hides their content until then).
MOUNTED_CLOSED = ("advanced", "sampling")  # elem_ids
# uploads (an attached text file, an imported chat) are refused past this by Gradio, before they are stored: a
# visitor through the share link cannot fill the disk (an attached file is read up to 4 bytes a character of the
# message limit, an exported chat of thousands of turns is a few MB)
MAX_UPLOAD = "20mb"
MAX_DEPTH = 16  # the depth slider's range is 1..MAX_DEPTH; the tree size slider reaches 96 > MAX_DEPTH + 1

# Runs once when the page loads.
# The MOUNTED_CLOSED accordions are closed as soon as they are in the page.
# Esc stops the answer (or the race) being written, like the Stop button of the tab in view.
# Gradio clamps a typed number to its slider's range when the box loses focus, silently, and an
# empty box (or one holding no number) becomes the minimum. This says what was changed, under the
# slider (capture phase: before Gradio's own blur handler).
PAGE_JS = """
() => {
  const MOUNTED_CLOSED = __IDS__;
  const closeMounted = () => {  // true once every one is closed
    return MOUNTED_CLOSED.every((id) => {
      const box = document.getElementById(id), label = box?.querySelector("button.label-wrap");
      if (!label) return false;
      if (!box.dataset.closed) {
        if (label.classList.contains("open")) label.click();
        box.dataset.closed = "1";
      }
      return true;
    });
  };
  if (!closeMounted()) {
    const watch = new MutationObserver(() => { if (closeMounted()) watch.disconnect(); });
    watch.observe(document.body, {childList: true, subtree: true});
  }
  document.addEventListener("keydown", (event) => {
    if (event.key !== "Escape" || event.defaultPrevented) return;
    const stop = [...document.querySelectorAll("#stop, #compare-stop")].find((b) => b.offsetParent !== null);
    if (stop) stop.click();
  });
  document.addEventListener("blur", (event) => {
    const box = event.target;
    if (!(box instanceof HTMLInputElement) || box.type !== "number") return;
    const lo = box.min === "" ? null : Number(box.min), hi = box.max === "" ? null : Number(box.max);
    const typed = box.value === "" ? null : Number(box.value);
    const used = typed === null ? lo : lo !== null && typed < lo ? lo : hi !== null && typed > hi ? hi : null;
    const wrap = box.closest(".wrap") || box.parentElement;
    let note = wrap.querySelector(":scope > .range-note");
    if (used === null) { if (note) note.remove(); return; }
    if (!note) { note = document.createElement("div"); note.className = "range-note"; wrap.appendChild(note); }
    const name = (box.getAttribute("aria-label") || "").replace("number input for ", "");
    const what = typed === null ? "no number was typed" : `${typed} is outside ${lo}–${hi}`;
    note.textContent = `${name}: ${what}, so ${used} is used.`;
  }, true);
}
""".replace("__IDS__", json.dumps(MOUNTED_CLOSED))
HEADER = "## eagle-chat"
ABOUT = ("Local chat with lossless EAGLE speculative decoding: a small draft head guesses a tree of tokens, "
         "the model checks them all in one pass, and the answer is exactly what the model alone would write — "
         "only faster. **τ (tau)** is the number of tokens each model pass adds to the answer.")


def in_range_js(components: list) -> str:
    """JavaScript that runs in the page before the settings are kept: each slider's value brought into
    its range as Gradio does when its box loses focus (no number: the minimum). A slider's input
    event carries its number as typed, and Gradio's Slider refuses a value outside its range (HTTP
    500 and an "Error" toast); PAGE_JS's note says which value is used instead."""
    ranges = [[c.minimum, c.maximum] if isinstance(c, gr.Slider) else None for c in components]
    return f"""(...values) => {{
  const ranges = {json.dumps(ranges)};
  return values.map((value, i) => {{
    if (!ranges[i]) return value;
    const [lo, hi] = ranges[i], n = value === null || value === "" ? NaN : Number(value);
    return Number.isFinite(n) ? Math.min(Math.max(n, lo), hi) : lo;
  }});
}}"""


class App:
    """The built demo plus a banner the launcher can set after launch (share-link status)."""

    def __init__(self, demo: gr.Blocks, handlers: Handlers):
        self.demo = demo
        self.handlers = handlers
        self.banner = ""


def build(manager: ModelManager, access: Access = Access()) -> App:
    h = Handlers(manager, access)
    engine, gen = manager.engine, GenerationConfig()
    tree = engine.default_tree if engine is not None else TreeConfig()  # the tuned tree when cached
    props = control_props(manager)  # disabled, with a reason, while a remote backend answers
    with gr.Blocks(title="eagle-chat", analytics_enabled=False) as demo:
        app = App(demo, h)
        store, kept_settings = stores()  # the visitor's chats and settings, kept in their browser
        gr.Markdown(HEADER, elem_id="title")
        status = gr.Markdown(manager.status_markdown(), elem_id="status")
        with gr.Accordion("How it works, and the technical details (numerics, kernels, threads)", open=False,
                          elem_id="details"):
            gr.Markdown(ABOUT)
            details = gr.Markdown(manager.details_markdown(), elem_id="status-details")
        status.change(manager.details_markdown, None, details, api_visibility="private", queue=False,
                      show_progress="hidden")
        banner = gr.Markdown(elem_id="banner")
        with gr.Tabs():
            with gr.Tab("Chat"):
                with gr.Row():
                    with gr.Column(scale=3):
                        listing = chat_list()
                        chatbot = gr.Chatbot(label="Conversation", show_label=False, height=430, elem_id="chatbot",
                                             buttons=["copy"], feedback_options=None, editable="all",
                                             placeholder="Ask anything. Speculation settings are on the right. Hover over a "
                                                         "message to copy or edit it.")
                        nav = versions_row()  # what a Regenerate or an edit replaced (app.versions)
                        notice = gr.Markdown(elem_id="notice")
                        with gr.Row():
                            box = gr.Textbox(placeholder="Message (Enter to send)", label="Message", show_label=False,
                                             scale=6, elem_id="message", autofocus=True)
                            send = gr.Button("Send", variant="primary", scale=1, elem_id="send")
                            attach = gr.UploadButton("Attach file", scale=1, elem_id="attach", type="filepath",
                                                     variant="secondary")
                        with gr.Row():
                            stop = gr.Button("Stop (Esc)", elem_id="stop")
                            regen = gr.Button("Regenerate", elem_id="regenerate")
                            more = gr.Button("Continue", elem_id="continue")
                            clear = gr.Button("Clear", elem_id="clear")
                        system = gr.Textbox("You are a helpful assistant.", label="System prompt", lines=2,
                                            elem_id="system",
                                            info="Kept with each chat; a new chat starts with the one shown.")
                    with gr.Column(scale=2):
                        spec = gr.Checkbox(elem_id="speculative", **props["spec"])
                        depth = gr.Slider(1, MAX_DEPTH, tree.depth, step=1, label="Tree depth", elem_id="depth",
                                          **props["depth"])
                        tree_note = gr.Markdown(tree_limit(tree.depth, tree.total_tokens), elem_id="tree-limit")
                        tree_origin = gr.Markdown(manager.tree_markdown(), elem_id="tree-origin")
                        with gr.Accordion("Advanced speculation", open=True, elem_id="advanced", elem_classes=["mounted-closed"]):
                            top_k = gr.Slider(1, 16, tree.top_k, step=1, label="Top-k per node", elem_id="top-k",
                                              **props["top_k"])
                            tree_size = gr.Slider(2, 96, tree.total_tokens, step=1, label="Tree size (nodes verified)",
                                                  elem_id="tree-size", **props["tree_size"])
                        chart = gr.BarPlot(empty_frame(), x="step", y="tokens", color="kind", **props["chart"],
                                           y_lim=[0, tree.depth + 1], x_lim=[0.5, 1.5], height=230, elem_id="chart",
                                           color_map=COLORS, colors_in_legend=list(COLORS), x_axis_format="d")
                        stats = gr.Markdown(elem_id="stats")
                        highlight = gr.Checkbox(True, label="Show which tokens came from accepted drafts",
                                                elem_id="highlight", **props["highlight"])
                        tokens = gr.HTML(elem_id="tokens")
                        with gr.Accordion("Sampling", open=True, elem_id="sampling", elem_classes=["mounted-closed"]):
                            temperature = gr.Slider(0, 2, gen.sampling.temperature, step=0.05,
                                                    label="Temperature (0 = greedy)", elem_id="temperature")
                            top_p = gr.Slider(0.05, 1, gen.sampling.top_p, step=0.05, label="Top-p", elem_id="top-p")
                            max_new = gr.Slider(1, 2048, gen.max_new_tokens, step=1, label="Max new tokens",
                                                elem_id="max-new")
                            seed = gr.Number(ChatSettings().seed, precision=0, label="Seed (-1: a new one each answer)",
                                             info="One seed gives one sampled answer, speculation on or off: a "
                                                  "sampled token depends on the seed and its position only.",
                                             elem_id="seed")
                        with gr.Accordion("Raw numbers", open=False):
                            stats_json = gr.JSON(label="This answer", elem_id="stats-json")
            with gr.Tab("Side by side"):
                gr.Markdown("One prompt answered plain and with speculation on the same model, as a race: the "
                            "two runs take turns step by step and each column's clock counts only its own "
                            "steps. Sampling and tree settings come from the Chat tab.")
                with gr.Row():
                    prompt = gr.Textbox(label="Prompt", show_label=False, placeholder="Prompt", scale=6,
                                        elem_id="compare-prompt")
                    run = gr.Button("Compare", variant="primary", scale=1, elem_id="compare", **props["compare"])
                    stop2 = gr.Button("Stop", scale=1, elem_id="compare-stop")
                compare_note = gr.Markdown(elem_id="compare-note", **props["compare_note"])
                with gr.Row():
                    plain_out = gr.Markdown(elem_id="plain-answer")
                    spec_out = gr.Markdown(elem_id="spec-answer")
                summary = gr.Markdown(elem_id="compare-summary")
                with gr.Accordion("Raw numbers", open=False):
                    compare_json = gr.JSON(label="Numbers")
            controls = [spec, depth, top_k, tree_size, highlight, chart, run, compare_note]  # app.controls.CONTROLS
            with gr.Tab("Models"):
                models = models_tab(h, manager, status, tree_origin, controls)

        named = dict(temperature=temperature, top_p=top_p, max_new=max_new, spec=spec, depth=depth, top_k=top_k,
                     tree_size=tree_size, highlight=highlight, seed=seed)
        settings = [named[name] for name in ChatSettings.names()]  # the handlers' parameter order
        history = gr.State([])
        view = dict(store=store, chatbot=chatbot, history=history, system=system, **listing)
        chats_out = [view[name] for name in CHATS_VIEW]
        # versions of the chat from its latest turning point (app.versions), every chat's: loaded from the store with
        # the page and kept in it with the chat
        versions = gr.State({})
        save = dict(fn=h.chats_save, inputs=[history, store, versions, system], outputs=chats_out,
                    api_visibility="private", show_progress="hidden")
        outs = [chatbot, history, box, chart, stats, stats_json, tokens, notice]
        # one generation at a time on the shared engine, whichever button started it; the
        # validators run when a request joins the queue (see app.lane)
        lane = dict(concurrency_id="engine", concurrency_limit=1)
        # the buttons ask a gate first (app.session): a problem is shown in place and nothing is sent,
        # else the gate moves a hidden counter and its change sends the request ("once": not again
        # while one is pending, as a button's click)
        chat_go, regen_go, more_go, edit_go, compare_go = (
            gr.Number(0, visible="hidden", elem_id=f"{name}-go", precision=0)
            for name in ("chat", "regenerate", "continue", "edit", "compare"))
        pending_edit = gr.State(None)  # an edited message waiting for its answer (Handlers.gate_edit)
        gate = dict(queue=False, api_visibility="private", show_progress="hidden")
        gr.on([send.click, box.submit], h.gate_chat, [box, system], [notice, chat_go], **gate)
        regen.click(h.gate_regenerate, [history, system], [notice, regen_go], **gate)
        more.click(h.gate_continue, [history, system], [notice, more_go], **gate)
        attach.upload(h.attach_file, [attach, box], [box, notice], **gate)
        run.click(h.gate_compare, [prompt, system], [summary, compare_go], **gate)
        chatbot.edit(h.gate_edit, [box, history, system], [notice, pending_edit, edit_go, box], **gate)
        headline = dict(fn=manager.status_markdown, inputs=None, outputs=status, api_visibility="private",
                        queue=False, show_progress="hidden")  # the header's speed follows the last answer
        answers = (chat_go.change(h.respond, [box, history, system] + settings, outs, api_name="chat",
                                  validator=h.check_chat, trigger_mode="once", **lane),
                   regen_go.change(h.regenerate, [history, system] + settings, outs, api_name="regenerate",
                                   validator=h.check_regenerate, trigger_mode="once", **lane),
                   more_go.change(h.continue_answer, [history, system] + settings, outs, api_name="continue",
                                  validator=h.check_continue, trigger_mode="once", **lane),
                   edit_go.change(h.edit, [pending_edit, box, history, system] + settings, outs,
                                  api_visibility="private", validator=h.check_edit, trigger_mode="once", **lane))
        for answered in answers:
            answered.success(**headline)
        # after a Regenerate or an edit, what it replaced (in the chat it read when its turn came: gr.State is read on
        # the server when a handler runs, so nothing outside the queue can take it before an answer still being
        # written ends) and what it wrote are kept, then the chat is saved with them; the flip controls hide while
        # any answer is written and come back after it, where the chat has versions
        versioned = dict(inputs=[versions, history, store], api_visibility="private", show_progress="hidden",
                         queue=False)
        gr.on([go.change for go in (chat_go, regen_go, more_go, edit_go)], lambda: gr.update(visible=False), None,
              nav[0], **gate)
        for turned in (answers[1], answers[3]):  # Regenerate, and an edit: what they replace is kept as a version
            turned.then(h.versions_written, outputs=[versions, *nav], **versioned).then(**save)
        for answered in answers[:1] + answers[2:3]:
            answered.success(**save)
            answered.then(h.versions_view, outputs=nav, **versioned)
        for flip, fn in ((nav[2], h.versions_back), (nav[3], h.versions_forward)):
            flip.click(fn, outputs=[versions, notice, *nav, *chats_out], **versioned)  # shown and kept at once
        stop.click(h.stop, None, None, queue=False, api_name="stop")
        view_versions = dict(fn=h.versions_view, outputs=nav, **versioned)
        clear.click(h.clear, None, outs, api_name="clear", queue=False).then(**save).then(**view_versions)
        # the chat's own trash icon is the Clear button too (it emptied the view only: the next message
        # brought the whole conversation back)
        chatbot.clear(h.clear, None, outs, api_visibility="private", queue=False).then(**save).then(**view_versions)
        chat_events(h, listing, store, system, chats_out, view_versions)
        # every setting is kept with all the others, as they are when it runs; "always_last": a change
        # made while the last one is still being kept runs after it (Gradio's default for input
        # events, "once", drops it: a second setting typed quickly, a slider's last position)
        keep = dict(fn=h.settings_save, inputs=[system] + settings, outputs=kept_settings, queue=False,
                    api_visibility="private", js=in_range_js([system] + settings), trigger_mode="always_last")
        gr.on([c.input for c in [system] + settings], **keep)
        compare_go.change(h.compare, [prompt, system] + settings[:3] + [depth, top_k, tree_size, seed],
                          [plain_out, spec_out, summary, compare_json], api_name="compare",
                          validator=h.check_compare, trigger_mode="once", **lane)
        stop2.click(h.stop, None, None, queue=False, api_visibility="private")
        # a deeper tree needs room: the size follows the depth up, and a smaller size says what it caps
        # (in the page: two server round trips could land out of order and undo the newer value)
        depth.input(None, [depth, tree_size], [tree_size, tree_note], js=follow_depth_js(MAX_DEPTH),
                    api_visibility="private").then(**keep)  # the size it grew to is kept too
        tree_size.input(None, [depth, tree_size], tree_note, js=TREE_LIMIT_JS, api_visibility="private")
        spec.change(lambda on: tree_updates(manager, on), spec, [depth, top_k, tree_size], queue=False,
                    api_visibility="private", show_progress="hidden")

        def page_load(request: gr.Request):
            return h.page_load(app.banner, request)

        demo.load(page_load, None, [status, banner, tree_origin, *controls, *models], api_visibility="private") \
            .then(h.chats_load, [store, history], chats_out + [versions], api_visibility="private",
                  show_progress="hidden") \
            .then(h.versions_view, [versions, history, store], nav, api_visibility="private", show_progress="hidden") \
            .then(h.settings_load, [kept_settings, store, system] + settings, [system] + settings, api_visibility="private",
                  show_progress="hidden")
        demo.unload(h.session_end)
    return app


def chat_events(h: Handlers, listing: dict, store, system, chats_out: list, then: dict) -> None:
    """The chat list's buttons; each shows its result through the same outputs (CHATS_VIEW), `then` after
    those that change the chat shown (the flip controls of its versions). Those that switch chats read
    the system prompt shown too: the chat left keeps it."""
    private = dict(outputs=chats_out, api_visibility="private", queue=False, show_progress="hidden")
    listing["new"].click(h.chats_new, [store, system], **private).then(**then)
    # a chat picked while the last pick is still loading loads after it ("once" would drop it and
    # leave the picker naming one chat over another's messages)
    listing["picker"].input(h.chats_select, [listing["picker"], store, system], trigger_mode="always_last",
                            **private).then(**then)
    listing["rename"].click(h.chats_rename, [listing["title"], store], **private)
    listing["title"].submit(h.chats_rename, [listing["title"], store], **private)
    listing["delete"].click(h.chats_delete, store, **private).then(**then)
    listing["upload"].upload(h.chats_import, [listing["upload"], store, system], **private).then(**then)


def models_tab(h: Handlers, manager: ModelManager, status, tree_origin, controls: list) -> list:
    """The Models tab; returns the lock notice and the controls that page load enables or not.
    `controls` are the backend-dependent ones of the other tabs (app.controls.CONTROLS)."""
    gr.Markdown("Targets with their EAGLE heads. One click downloads (resumable, with progress) and "
                "switches; the switch waits for the answer being generated, and answers wait for it.")
    locked = gr.Markdown(f"Locked: {LOCKED}", elem_id="locked", visible=False)
    table = gr.Dataframe(catalogue_frame(), interactive=False, label="Catalogue", wrap=True, elem_id="catalogue",
                         column_widths=CATALOGUE_WIDTHS)
    keys = [e.key for e in CATALOGUE] + [CUSTOM]
    with gr.Row():
        key = gr.Dropdown(keys, value=keys[0], label="Model", scale=2, elem_id="model-key")
        dtypes = ["auto", "float32", "bfloat16", "float16"]
        dtype = gr.Dropdown(dtypes + [d for d in [manager.choice.dtype] if d not in dtypes], value=manager.choice.dtype,
                            label="dtype", info="auto: bf16 with exact kernels where this CPU passes the check")
        device = gr.Dropdown(devices(), value=manager.choice.device, label="Device")
        four_bit = gr.Checkbox(manager.choice.load_in_4bit, label="4-bit (nf4)", info="Default for 7B+ models on CUDA")
    with gr.Row():
        target = gr.Textbox(label="Custom target: hub id (owner/name), a hub repo's GGUF file (owner/name:Q4_K_M), "
                                  "local folder or .gguf file", elem_id="custom-target")
        head = gr.Textbox(label="Custom EAGLE head: hub id or local folder (optional)")
    with gr.Row():
        dl = gr.Button("Download", elem_id="download")
        load = gr.Button("Download & switch", variant="primary")
    gr.Markdown("Or chat through a server: our `python -m core.serve`, vLLM, SGLang or any other "
                "OpenAI-compatible one. The local model stays loaded; features that need it are disabled meanwhile.")
    with gr.Row():
        url = gr.Textbox(manager.backend.url if manager.backend else "", label="Remote backend (OpenAI-compatible URL)",
                         placeholder="http://127.0.0.1:8000", scale=3, elem_id="backend-url")
        api_key = gr.Textbox(label="API key (optional)", type="password", scale=1, elem_id="api-key")
        connect = gr.Button("Connect", scale=1, elem_id="connect")
        use_local = gr.Button("Use local engine", scale=1, elem_id="use-local")
    result = gr.Markdown(elem_id="model-result")
    inputs = [key, target, head, dtype, device, four_bit]
    dl.click(h.download, inputs, [result, table], api_name="download")
    load.click(h.load, inputs, [result, status, table, tree_origin, *controls], api_name="load_model")
    connect.click(h.connect, [url, api_key], [result, status, tree_origin, *controls], api_name="connect")
    use_local.click(h.use_local, None, [result, status, tree_origin, *controls], api_name="use_local")
    key.change(lambda k, d: gr.Checkbox(value=d == "cuda" and k != keys[0]), [key, device], four_bit,
               api_visibility="private")
    return [locked, key, dtype, device, four_bit, target, head, dl, load, url, api_key, connect, use_local]


def devices() -> list[str]:
    import torch

    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def launch(app: App, *, port: int | None, share: bool, auth: tuple[str, str] | None, inbrowser: bool):
    """Start serving without blocking; returns (local_url, share_url or None)."""
    app.demo.queue(default_concurrency_limit=1)
    app.demo.launch(server_name="127.0.0.1", server_port=port, share=share, auth=auth, inbrowser=inbrowser,
                    prevent_thread_lock=True, css=CSS, js=PAGE_JS, theme=gr.themes.Soft(), quiet=True,
                    footer_links=["api", "settings"], max_file_size=MAX_UPLOAD)
    return app.demo.local_url, app.demo.share_url
