"""When an answer speculates: by the speed it measures, with the tuned caps as the start.

How much a step accepts depends on the text far more than on the chat's length. Deep in a chat
that the answer quotes or edits (code to change, text to summarise) the head and context lookup
accept 3-4 tokens a step, and speculation runs 1.3-1.9x plain decoding there; in a free answer
after the same chat they accept under 2, and plain decoding is faster (measured on the Intel VM,
docs/long-context.md). The tree's long-context caps (TreeConfig.long_context) come from calibration
prompts: right on average, wrong for either kind of answer; so does its hot pause
(TreeConfig.plain_from_temperature): an answer sampled that hot that copies from the chat still
accepts long chains. Both only choose where an adaptive answer starts. An adaptive answer keeps
each mode's measured speed (tokens per second over its recent steps, older steps weighing less),
runs the faster one, and now and then runs a few steps of the other to keep that figure current;
while the probes confirm the choice they come less often.

Its tokens are the same whichever mode writes them (by construction, core.decoding.engine: a greedy
token is the argmax, a sampled one a function of the seed and its position, core.decoding.gumbel),
so the choice changes only the time, and a seed reproduces a sampled answer whatever the timings.

State passes as arguments: `record` returns the next `Speeds`, the policy's settings are a
frozen `Policy`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Policy:
    first_probe: int = 8    # steps before the first probe of the other mode
    probe_steps: int = 4    # steps one probe runs
    max_gap: int = 128      # the most steps between probes (the gap doubles each time a probe confirms)
    decay: float = 0.8      # weight of a mode's figure from one step of that mode earlier
    margin: float = 0.05    # plain decoding must measure this much faster (0.05: 5%) to be chosen; in a hot answer
    #                         (Speeds.hot) speculation must measure this much faster than plain instead
    give_up: float = 0.7    # a probe ends early once, after 2 of its steps, its mode measures below this share of the other


@dataclass(frozen=True)
class Speeds:
    """Both modes' decayed sums (tokens, seconds) and where the probing schedule stands."""

    speculative: bool                 # the mode the next step runs
    spec: tuple[float, float] = (0.0, 0.0)
    plain: tuple[float, float] = (0.0, 0.0)
    steps: int = 0                    # steps since the last probe ended (or the answer began)
    gap: int = 8                      # steps between probes now
    probing: int = 0                  # steps left in the running probe, 0 when none runs
    hot: bool = False                 # sampled past the tree's hot pause: the margin favours plain decoding

    def rate(self, speculative: bool) -> float | None:
        """Measured tokens per second of a mode, None before it ran."""
        tokens, seconds = self.spec if speculative else self.plain
        return tokens / seconds if seconds > 0 else None

    def speculation_wins(self, margin: float) -> bool:
        """Whether speculation is the mode to run by the figures so far: within `margin` of plain
        decoding it wins, except in a hot answer, where it must beat plain by the margin (a tie
        there goes to plain, which the tuned tree measured faster at that temperature)."""
        spec, plain = self.rate(True) or 0.0, self.rate(False) or 0.0
        return spec >= plain * (1 + margin) if self.hot else spec * (1 + margin) >= plain


def start(speculative: bool, policy: Policy = Policy(), patient: bool = False) -> Speeds:
    """An answer's schedule, starting in the mode the tuned tree chooses at its prompt's length.
    `patient`: the start is plain because the answer samples at or past the tree's hot pause, where
    speculation measured slower on free answers: scheduled probes wait the longest gap, and a
    repeat in the context (`probe_now`) is what probes speculation sooner, and speculation must then
    measure `policy.margin` faster than plain to take over (on AVX2 at temperature 0.7 the two measured
    within 5% of each other, speculation behind, and the other way round it kept the answer: 0.95x)."""
    return Speeds(speculative=speculative, gap=policy.max_gap if patient else policy.first_probe, hot=patient)


def record(s: Speeds, policy: Policy, ran_speculative: bool, tokens: int, seconds: float) -> Speeds:
    """The step that just ran (its mode, tokens, wall seconds) -> the schedule for the next step."""
    old = s.spec if ran_speculative else s.plain
    summed = (policy.decay * old[0] + tokens, policy.decay * old[1] + max(seconds, 0.0))
    s = replace(s, spec=summed) if ran_speculative else replace(s, plain=summed)
    if s.probing:
        left = s.probing - 1
        ran, other = s.rate(s.speculative), s.rate(not s.speculative)
        hopeless = policy.probe_steps - left >= 2 and ran is not None and other is not None \
            and ran < policy.give_up * other
        if left and not hopeless:
            return replace(s, probing=left)
        # the probe ended: keep the faster mode; a probe that changed nothing waits longer next time
        probed = s.speculative
        faster = s.speculation_wins(policy.margin)
        confirmed = faster != probed
        gap = min(2 * s.gap, policy.max_gap) if confirmed else policy.first_probe
        return replace(s, speculative=faster, probing=0, steps=0, gap=gap)
    if s.steps + 1 >= s.gap:  # probe the other mode
        return replace(s, speculative=not s.speculative, probing=policy.probe_steps, steps=0)
    return replace(s, steps=s.steps + 1)


def probe_now(s: Speeds, policy: Policy) -> Speeds:
    """Probe speculation from this step on, out of schedule: the caller saw the context repeat
    (context lookup has a long chain to verify: an answer that copies from the chat). Unchanged
    while speculation runs or a probe does, within 2 steps of the last probe's end, and, where
    speculation last lost to plain (`Speeds.speculation_wins`), before half the gap to the next
    scheduled probe has passed (repeats that speculation did not turn into speed: a
    sampled answer's draws leave the copied text more often than a greedy one's)."""
    if s.speculative or s.probing or s.steps < 2:
        return s
    measured = s.rate(True) is not None and s.rate(False) is not None
    if measured and not s.speculation_wins(policy.margin) and 2 * s.steps < s.gap:
        return s
    return replace(s, speculative=True, probing=policy.probe_steps, steps=0)
