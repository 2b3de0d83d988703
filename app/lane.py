"""The one generation lane, shared by every visitor, and what each visitor has asked of it.

Gradio's queue runs one generation at a time (the events share concurrency_id "engine") and
tells each waiting visitor their position. Stop and Clear reach the server outside that queue,
possibly while the visitor's request is still waiting in it, so every request gets a Ticket
when it joins the queue (its event's validator runs then, on the same HTTP request object the
handler later receives); Stop cancels every ticket of its session, waiting or running.

The lane itself is `ModelManager.lane`, a lock that a model switch takes too, so a switch
waits for the answer being generated instead of loading a second model beside one in use.
"""

from __future__ import annotations

import ipaddress
import threading
import time
from urllib.parse import urlsplit
from dataclasses import dataclass, field

@dataclass
class Ticket:
    """One request: Stop sets `stop`; Clear also asks for the empty chat to be shown."""

    stop: threading.Event = field(default_factory=threading.Event)
    clear_chat: bool = False
    running: bool = False  # its handler has started (it was not, or no longer, waiting in the queue)
    ended: threading.Event = field(default_factory=threading.Event)  # its handler has yielded its last update
    visitor: str = ""  # visitor_of(the request): bounds the requests one visitor holds
    joined: float = field(default_factory=time.monotonic)  # when Send was pressed: the visitor's clock

    def cancel(self, clear_chat: bool = False) -> None:
        self.clear_chat = self.clear_chat or clear_chat
        self.stop.set()


def session_of(request) -> str:
    return getattr(request, "session_hash", None) or "local"


def visitor_of(request) -> str:
    """Who sent this request, across their tabs and sessions: the address that the nearest proxy
    (the share tunnel) saw, i.e. the last X-Forwarded-For entry, which a visitor cannot forge by
    sending the header themselves; else the client's address; else the session."""
    headers = getattr(request, "headers", None) or {}
    forwarded = [a.strip() for a in (headers.get("x-forwarded-for") or "").split(",") if a.strip()]
    client = getattr(getattr(request, "client", None), "host", None)
    return (forwarded[-1] if forwarded else client) or session_of(request)


def http_request(request):
    """The underlying HTTP request of a gr.Request (the queue's join request for queued events)."""
    return getattr(request, "request", None) if request is not None else None


class Tickets:
    """The tickets of every session, from joining the queue until the request ends."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._tickets: dict[str, list[Ticket]] = {}

    def join(self, request) -> None:
        """A request joins the queue: give it a ticket that Stop can reach while it waits."""
        http = http_request(request)
        if http is not None and getattr(http.state, "ticket", None) is None:
            http.state.ticket = self._add(request)

    def ticket(self, request) -> Ticket:
        """The ticket given at join time (a fresh one for calls that did not join the queue)."""
        http = http_request(request)
        ticket = getattr(http.state, "ticket", None) if http is not None else None
        return ticket if ticket is not None else self._add(request)

    def done(self, request, ticket: Ticket) -> None:
        ticket.ended.set()
        session = session_of(request)
        with self._guard:
            tickets = self._tickets.get(session, [])
            if ticket in tickets:
                tickets.remove(ticket)
            if not tickets:
                self._tickets.pop(session, None)

    def cancel(self, request, clear_chat: bool = False) -> list[Ticket]:
        """Stop (or Clear) every request of this session, waiting or running; returns their tickets."""
        with self._guard:
            tickets = list(self._tickets.get(session_of(request), []))
        for t in tickets:
            t.cancel(clear_chat)
        return tickets

    @staticmethod
    def wait_running(tickets: list[Ticket], seconds: float) -> bool:
        """Wait (at most `seconds` in all) until those of `tickets` that were running have ended;
        whether they all did. Requests still waiting in the queue are not waited for."""
        deadline = time.monotonic() + seconds
        return all(t.ended.wait(max(0.0, deadline - time.monotonic())) for t in tickets if t.running)

    def forget(self, request) -> None:
        """The session ended (its browser tab closed): drop its state."""
        with self._guard:
            for t in self._tickets.pop(session_of(request), []):
                t.cancel()

    def held_by(self, visitor: str, besides: Ticket | None = None) -> int:
        """How many requests (waiting or running) this visitor holds, `besides` not counted."""
        with self._guard:
            return sum(t.visitor == visitor and t is not besides for ts in self._tickets.values() for t in ts)

    def sessions(self) -> set[str]:
        """Sessions that hold state here (a request waiting or running)."""
        with self._guard:
            return set(self._tickets)

    def _add(self, request) -> Ticket:
        ticket = Ticket(visitor=visitor_of(request))
        with self._guard:
            self._tickets.setdefault(session_of(request), []).append(ticket)
        return ticket


def is_remote(request) -> bool:
    """Did this request come from another machine? The app listens on 127.0.0.1 only, so a
    remote visitor arrives through Gradio's share tunnel, whose requests name the share host
    and carry X-Forwarded-For; a local visitor names a loopback host and address."""
    if request is None:
        return False
    headers = getattr(request, "headers", None) or {}
    host = urlsplit("//" + (headers.get("host") or "")).hostname
    forwarded = [a.strip() for a in (headers.get("x-forwarded-for") or "").split(",") if a.strip()]
    client = getattr(getattr(request, "client", None), "host", None)
    addresses = [a for a in (host, client, *forwarded) if a]
    return any(not _loopback(a) for a in addresses)


def _loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address.strip("[]")).is_loopback
    except ValueError:
        return address == "localhost"
