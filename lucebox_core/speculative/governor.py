"""Whether the next step drafts at all: speculative decoding that never loses to plain decoding.

A drafted step pays for the drafter's pass, a verify pass over the candidates and the commit; it wins only
when the target accepts enough of the draft. `SpeculationGovernor` measures both kinds of step as they
really run on this device (the engine's decode clock: model, sampler and host work, the consumer not
counted) and what each yields:

- drafting: tokens per second = tokens the steps emitted / their seconds;
- plain: tokens per second = tokens / seconds of plain steps (each a forward of the one pending token).

Both are decayed sums (`RATE_DECAY` per step), so a few steps move the estimate and one odd step does not.
When plain decoding is ahead, the next `run` steps are plain; then one drafted step probes again. A probe
that loses doubles the run (up to `max_run`), and a run is never shorter than what repays a probe's extra time
at `PROBE_OVERHEAD` of the run's, so a drafter that accepts nothing costs one drafted step per hundreds of plain
ones; a probe that wins returns to drafting (a probe weighs more than the drafted steps before the run: the text,
and so the acceptance, may have changed meanwhile). Before any plain step was measured, a short run of plain
steps measures one. The first step of each kind (kernels compiled, graphs recorded, the
verify cost curve measured) and any step far slower than the estimate (a graph recorded on a new sequence
state, a page-in) are left out.

The governor belongs to the engine's `SpeculativeDecoder`, not to one request: what a step costs is the
device's, and the acceptance it has seen is the best guess for the next request too. The engine asks
`draft_next()` before a step whose root is pending, `plain_ahead()` when deciding whether the token it
samples may be fed before it is read (only when the next step is plain as well), and `record` after it.
"""

from __future__ import annotations

import math
from typing import Any

import attrs

RATE_DECAY = 0.85  # per recorded step: the estimate follows the last ~7 steps of each kind
OUTLIER_FACTOR = 5.0  # a step this many times slower than its kind's mean is not a measurement of it
PROBE_FADE = 0.3  # the weight left to earlier drafted steps when a probe follows a plain run
# What a losing probe may cost, as a share of the plain run after it: the run is at least long enough for that
# (a drafter that accepts nothing on the 27B: a drafted step 26.4 ms for one token against 8.9 ms plain, so ~99
# plain steps), and a drafter that loses narrowly keeps short runs (its probes cost little, and find a recovery
# sooner).
PROBE_OVERHEAD = 0.02


@attrs.define
class StepRate:
    """Decayed sums of tokens and seconds of one kind of step."""

    tokens: float = 0.0
    seconds: float = 0.0
    steps: float = 0.0  # decayed step count: seconds / steps is the mean step time
    recorded: int = 0  # steps recorded, not decayed
    discarded: int = 0  # steps left out as outliers

    warm_up: int = 1  # first steps never counted: they record graphs, compile kernels, measure verify costs

    def add(self, tokens: int, seconds: float, steps: int = 1) -> bool:
        """Add one step (or `steps` steps measured together); False (and nothing added) if it is a warm-up step or
        an outlier against the mean."""
        if self.warm_up > 0:
            self.warm_up -= 1
            self.discarded += 1
            return False
        if self.steps > 0 and seconds / steps > OUTLIER_FACTOR * (self.seconds / self.steps):
            self.discarded += 1
            return False
        self.tokens = RATE_DECAY * self.tokens + tokens
        self.seconds = RATE_DECAY * self.seconds + seconds
        self.steps = RATE_DECAY * self.steps + steps
        self.recorded += 1
        return True

    def fade(self, factor: float) -> None:
        """Weigh what was recorded so far by `factor` (the mean step time is kept)."""
        self.tokens, self.seconds, self.steps = factor * self.tokens, factor * self.seconds, factor * self.steps

    @property
    def tokens_per_s(self) -> float | None:
        return self.tokens / self.seconds if self.recorded and self.seconds > 0 else None

    @property
    def step_seconds(self) -> float | None:
        return self.seconds / self.steps if self.recorded else None


@attrs.define
class SpeculationGovernor:
    """Drafts while drafting is faster than plain decoding, measured; see the module's docstring.

    `min_run` / `max_run`: plain steps after a losing drafted step (doubling while probes lose);
    `measure_run`: plain steps taken once to measure plain decoding."""

    min_run: int = 16
    max_run: int = 256
    measure_run: int = 4
    drafted: StepRate = attrs.Factory(StepRate)
    plain: StepRate = attrs.Factory(StepRate)
    plain_left: int = 0  # plain steps decided ahead
    run: int = 0  # the length of the last plain run decided after a losing drafted step (0: none yet)
    fallbacks: int = 0  # times drafting was judged slower and a plain run began
    plain_tokens: int = 0  # tokens decoded plainly on the governor's decision
    drafted_steps: int = 0  # drafted steps recorded (warm-ups and outliers included)
    probes: int = 0  # drafted steps right after a plain run
    last_probe_seconds: float | None = None  # what the last probe cost on the decode clock
    _probing: bool = False  # the last drafted step came right after a plain run
    # The plain steps since the last drafted one, measured together: a step whose token was fed ahead returns
    # before its kernels end and the next step waits for them, so single steps split one step's time unevenly
    # (H100, session 31: 1.1 ms "steps" of a 8.9 ms step, the long waits then left out as outliers).
    _run_tokens: int = 0
    _run_seconds: float = 0.0
    _run_steps: int = 0

    def draft_next(self) -> bool:
        """Whether the next step (whose root is pending) drafts; a plain one is taken from the run."""
        if self.plain_left > 0:
            self.plain_left -= 1
            return False
        return True

    def plain_ahead(self) -> bool:
        """Whether the step after the current plain one is plain too (its token may be fed ahead)."""
        return self.plain_left > 0

    def take_plain(self) -> None:
        """A plain step the engine took without asking `draft_next` (its token was fed ahead)."""
        self.plain_left = max(0, self.plain_left - 1)

    def record(self, drafted: bool, tokens: int, seconds: float) -> None:
        """One step's outcome: whether it drafted, tokens it emitted, its seconds on the decode clock."""
        if not drafted:
            self.plain_tokens += tokens
            if self.plain.warm_up > 0:  # the first plain step (graphs recorded): never measured
                self.plain.add(tokens, seconds)
            else:
                self._run_tokens, self._run_seconds = self._run_tokens + tokens, self._run_seconds + seconds
                self._run_steps += 1
            return
        self._close_plain_run()
        probing, self._probing = self._probing, False
        self.drafted_steps += 1
        if probing:  # what drafting yielded before the plain run is old news: the probe counts most
            self.drafted.fade(PROBE_FADE)
            self.probes, self.last_probe_seconds = self.probes + 1, seconds
        self.drafted.add(tokens, seconds)
        if self.plain_left:
            return
        drafting, plain = self.drafted.tokens_per_s, self.plain.tokens_per_s
        if drafting is None:
            return
        if plain is None:
            self.plain_left = self.measure_run
            self._probing = True
            return
        if drafting < plain:
            doubled = min(self.max_run, 2 * self.run) if probing and self.run else self.min_run
            self.run = max(doubled, self._run_to_repay_a_probe())
            self.plain_left = self.run
            self.fallbacks += 1
            self._probing = True
        else:
            self.run = 0

    def _close_plain_run(self) -> None:
        """Measure the plain steps since the last drafted one as one entry."""
        if self._run_steps:
            self.plain.add(self._run_tokens, self._run_seconds, self._run_steps)
        self._run_tokens, self._run_seconds, self._run_steps = 0, 0.0, 0

    def _run_to_repay_a_probe(self) -> int:
        """The plain steps over which a drafted step's extra time (against the same tokens decoded plainly) is
        `PROBE_OVERHEAD` of the run's time, within `max_run`."""
        drafted_step = self.drafted.step_seconds
        if not drafted_step or not self.plain.tokens:
            return 0
        tokens_per_drafted_step = self.drafted.tokens / self.drafted.steps
        plain_per_token = self.plain.seconds / self.plain.tokens  # a plain step decodes one token
        extra = drafted_step - tokens_per_drafted_step * plain_per_token
        return min(self.max_run, max(0, math.ceil(extra / (PROBE_OVERHEAD * plain_per_token))))

    @property
    def mode(self) -> str:
        return "plain" if self.plain_left > 0 else "drafting"

    def describe(self) -> dict[str, Any]:
        """For `/props`, `/metrics` and `generate --json`: the decision and the measurements behind it."""
        def rate(value: float | None) -> float | None:
            return None if value is None else round(value, 2)

        return {"mode": self.mode, "drafting_tokens_per_s": rate(self.drafted.tokens_per_s),
                "plain_tokens_per_s": rate(self.plain.tokens_per_s),
                "drafting_step_ms": rate(None if self.drafted.step_seconds is None
                                         else 1e3 * self.drafted.step_seconds),
                "plain_step_ms": rate(None if self.plain.step_seconds is None else 1e3 * self.plain.step_seconds),
                "plain_run": self.run, "fallbacks": self.fallbacks, "plain_tokens": self.plain_tokens,
                "drafted_steps": self.drafted_steps, "probes": self.probes,
                "last_probe_ms": rate(None if self.last_probe_seconds is None else 1e3 * self.last_probe_seconds),
                "steps_left_out": self.drafted.discarded + self.plain.discarded}  # warm-ups and outliers
