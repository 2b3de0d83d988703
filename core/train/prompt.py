"""The prompt record every prompt source produces (templates, installed corpora, follow-ups,
self-written prompts) and every consumer reads (distillation, evaluation). It has a module of
its own so that the sources (core.train.templates) and the prompt set that gathers them
(core.train.data) import it without importing each other."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Prompt:
    id: str
    category: str
    turns: tuple[str, ...]
    group: str = ""  # held-out split unit (topic or source item)
    history: tuple[tuple[str, str], ...] = ()  # (role, content) messages before turns[0]

    def to_json(self) -> dict:
        out = {"id": self.id, "category": self.category, "turns": list(self.turns)}
        if self.history:
            out["history"] = [{"role": r, "content": c} for r, c in self.history]
        return out

    def messages(self) -> list[dict]:
        """The conversation the target answers: the history, then the first turn."""
        return [{"role": r, "content": c} for r, c in self.history] + [{"role": "user", "content": self.turns[0]}]
