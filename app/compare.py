"""Side by side as a race: a plain and a speculative answer to one prompt, on the one engine.

The two answers take turns step by step, and the one whose own clock is behind goes next.
An answer's clock counts only the compute time of its own steps (draft + verify + other of
its StepEvents), so both columns advance as if each ran alone on the machine, and the live
speed-up compares how far each got in its own time. The final figures are each run's own
measurements. Both answers get one seed, so sampled answers must agree token for token as
greedy ones do (a sampled token is a function of the seed and its position: core.decoding.gumbel).
"""

from __future__ import annotations

from typing import Iterator

from app.chat import AnswerView


def race(plain: AnswerView, plain_events: Iterator, spec: AnswerView, spec_events: Iterator) -> Iterator[None]:
    """Feed each answer's events into its view, the one with the smaller clock first; yields
    after every step."""
    running = [(plain, plain_events), (spec, spec_events)]
    while running:
        view, events = min(running, key=lambda run: run[0].clock_s)
        event = next(events, None)
        if event is not None:
            view.add(event)
        if event is None or event.finished:
            running.remove((view, events))
        yield


def speedup(plain: AnswerView, spec: AnswerView) -> float:
    return spec.own_tokens_per_s / plain.own_tokens_per_s if plain.own_tokens_per_s > 0 else 0.0


def identical(plain: AnswerView, spec: AnswerView) -> bool:
    """The answers must agree token for token (a stopped race: as far as both got)."""
    a, b = plain.token_ids(), spec.token_ids()
    n = min(len(a), len(b)) if plain.stopped or spec.stopped else max(len(a), len(b))
    return a[:n] == b[:n]


def compare_markdown(plain: AnswerView, spec: AnswerView, greedy: bool, seed: int | None = None) -> str:
    how = "" if greedy else f" (sampled with seed {seed}, one for both)" if seed is not None else \
        " (sampled, one seed for both)"
    verdict = (f"**identical** token for token{how} ✓" if identical(plain, spec) else
               f"**different**{how} ✗: speculation changed the answer, a bug; please report it")
    return (f"| | plain | speculative |\n|---|---|---|\n"
            f"| tokens/s | {plain.own_tokens_per_s:.1f} | {spec.own_tokens_per_s:.1f} |\n"
            f"| target forwards | {plain.target_forwards} | {spec.target_forwards} |\n"
            f"| τ | {plain.tau:.2f} | {spec.tau:.2f} |\n\n"
            f"**Speed-up: {speedup(plain, spec):.2f}×** · answers: {verdict}")


def column(view: AnswerView, title: str) -> str:
    tau = f" · τ {view.tau:.2f}" if view.mode == "speculative" else ""
    return (f"**{title}** · {view.own_tokens_per_s:.1f} tok/s{tau} · {view.total_tokens} tokens in "
            f"{view.clock_s:.2f} s\n\n{view.text}")


def figures(view: AnswerView) -> dict:
    data = view.summary()
    data.pop("per_step")
    data.update(tokens_per_s=round(view.own_tokens_per_s, 2), clock_s=round(view.clock_s, 3))
    return data


def compare_outputs(plain: AnswerView, spec: AnswerView, greedy: bool, notices: list[str], final: bool,
                    seed: int | None = None):
    """(plain column, speculative column, summary, raw numbers) for the Side by side tab."""
    if final:
        summary = compare_markdown(plain, spec, greedy, seed)
    else:
        summary = (f"Racing… **speed-up so far {speedup(plain, spec):.2f}×** (each column's clock counts "
                   "only its own steps)")
    data = {"plain": figures(plain), "speculative": figures(spec), "speedup": round(speedup(plain, spec), 3),
            "identical": identical(plain, spec), "final": final, **({"seed": seed} if seed is not None else {})}
    return (column(plain, "Plain"), column(spec, "Speculative"), "\n\n".join([summary, *notices]), data)
