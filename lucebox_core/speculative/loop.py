"""One speculative step: draft, build the candidate set, verify it in one target pass, walk it.

`SpeculativeDecoder.step` does not commit: it returns a `SpeculativeBlock` whose tokens the engine
emits one by one (honouring stops inside the block) and then commits exactly the emitted ones
(`SpeculativeBlock.commit(m)`), so the engine keeps one decode loop.

The two parts come from hooks. A *drafter* (`lucebox_drafters`, chosen by the draft GGUF's architecture)
has `block_size`, `describe()`, `prepare_target(target, target_state, ctx_size)` (ask the target for what
it needs, e.g. captured features), `new_state()` (its per-sequence state, with `crop(length)`) and
`draft(target, target_state, draft_state, tokens, block_size)` -> logits `[block_size - 1, vocab]` for
the positions after `tokens[-1]` (the sequence so far, the pending root last). A *verifier*
(`lucebox_verifiers`, chosen by `--spec-type NAME`) has `name`, `max_nodes(block_size)`, `describe()`
and `verify(target, state, root, draft_logits, sampler, history)` -> a `Verdict`; `TreeVerifier` below
implements `verify` as candidates -> one target pass (`target.verify`) -> walk, for subclasses to fill in.

Acceptance:
- temperature 0: each node's next token is the target's (penalised) argmax there; the walk follows the
  child holding it. The output equals plain greedy decoding. The draft logits and the logits of the
  target's verify pass come to the verifier with the ids the sampler never picks (padding) at -inf.
- temperature > 0, `chain`: speculative sampling (accept with min(1, p/q), else resample from the
  residual), with the drafted tokens sampled from the drafter's distribution q.
- temperature > 0, `ddtree`: the sampled walk (draw from the target at each node, follow the child that
  holds the draw), which keeps the target's distribution for any tree.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch

from ..errors import LuceboxError
from . import trees
from .governor import SpeculationGovernor

AUTO_BUDGETS = (4, 8, 12, 15, 18, 22, 26, 30, 36, 44, 52, 64)


@attrs.define
class SpeculativeBlock:
    """The outcome of one verified step: `tokens` = accepted drafted tokens then the bonus."""

    tokens: list[int]
    path: list[int]  # accepted node indices, root first
    verification: Any
    target: Any
    state: Any
    committed: bool = False

    @property
    def accepted(self) -> int:
        """Drafted tokens the target accepted (the bonus not counted)."""
        return len(self.path) - 1

    def commit(self, emitted: int) -> None:
        """Keep the root and the first `emitted - 1` accepted nodes; token `emitted - 1` is the next pending."""
        if not 1 <= emitted <= len(self.tokens):
            raise ValueError(f"cannot commit {emitted} of {len(self.tokens)} tokens")
        self.target.commit(self.state, self.verification, self.path[:emitted])
        self.committed = True


@attrs.frozen
class ForcedStep:
    """`--force-accept`: the target's own continuation after the root, and how many drafts to replace."""

    reference: tuple[int, ...]
    accept: int


class VerifyCostCurve:
    """Seconds of one verify pass against the node count, measured once on a scratch state.

    `synchronize`: waits for the target's device (its backend's), so the clock times the work, not its
    launch (a replayed graph returns at once)."""

    def __init__(self, target: Any, synchronize: Callable[[], None],
                 sizes: Sequence[int] = (1, 8, 16, 24, 32, 48, 65)):
        state = target.new_state(256)
        target.forward(state, torch.arange(16) + 100)
        self.sizes, self.seconds = [], []
        for n in sizes:
            parents = list(range(-1, n - 1))
            target.verify(state, [100] * n, parents)  # warm-up (on a GPU: records the pass)
            synchronize()
            start = time.perf_counter()
            target.verify(state, [100] * n, parents)
            synchronize()
            self.sizes.append(n)
            self.seconds.append(time.perf_counter() - start)

    def __call__(self, nodes: int) -> float:
        for (n0, t0), (n1, t1) in zip(zip(self.sizes, self.seconds), zip(self.sizes[1:], self.seconds[1:])):
            if nodes <= n1:
                return t0 + (t1 - t0) * (nodes - n0) / (n1 - n0)
        return self.seconds[-1] * nodes / self.sizes[-1]


@attrs.frozen
class Verdict:
    """What a verifier decided for one drafted block."""

    tokens: list[int]  # the accepted drafted tokens, then the bonus (the target's own next token)
    path: list[int]  # the accepted candidates' node indices, the root first
    verification: Any  # the target's verification, for `target.commit`


class SpeculativeDecoder:
    """A drafter and a verifier bound to a target model.

    `verifier`: a verifier object, or the name of one (`--spec-type`), made through the verification hook
    with `budget` and `top_k`. `backend`: the target's ops (default `target.ops`), whose device the
    verifiers' timings wait for."""

    def __init__(self, target: Any, drafter: Any, verifier: Any = "ddtree", *, budget: int | str = trees.DEFAULT_BUDGET,
                 block_size: int | None = None, top_k: int = trees.DEFAULT_TOP_K, backend: Any = None,
                 spec_type: str | None = None, adaptive: bool | None = None) -> None:
        block = block_size or drafter.block_size
        if not 2 <= block <= 64:
            raise LuceboxError(f"--draft-block-size must be between 2 and 64, got {block}")
        backend = backend if backend is not None else getattr(target, "ops", None)
        if spec_type is not None:  # the flag's name for it
            if not isinstance(verifier, str):
                raise TypeError("give the verifier as an object or by name (spec_type), not both")
            verifier = spec_type
        if isinstance(verifier, str):
            from ..plugins import registry

            verifier = registry().verifier(verifier).create(target, budget=budget, top_k=top_k, backend=backend)
        self.target, self.drafter, self.verifier = target, drafter, verifier
        self.block_size = block
        # `adaptive` (default: with `--tree-budget auto`): a governor decides, step by step, whether drafting
        # pays at all on this device with this drafter, and decodes plainly while it does not.
        if adaptive is None:
            adaptive = self.budget == "auto"
        self.governor = SpeculationGovernor() if adaptive else None

    @property
    def spec_type(self) -> str:
        return self.verifier.name

    @property
    def budget(self) -> int | str | None:
        """The verifier's node budget (`--tree-budget`), where it has one."""
        return getattr(self.verifier, "budget", None)

    @property
    def max_nodes(self) -> int:
        """The most candidates one verify pass can hold (the root included): what must fit in the context."""
        return int(self.verifier.max_nodes(self.block_size))

    def describe(self) -> dict[str, Any]:
        described = {**self.drafter.describe(), "spec_type": self.spec_type, "tree_budget": self.budget,
                     **self.verifier.describe(), "draft_block_size": self.block_size}
        if self.governor is not None:
            described["speculation"] = self.governor.describe()
        return described

    def prepare(self, state: Any, ctx_size: int) -> Any:
        """Enable feature capture on a fresh target state; return the drafter's state for it."""
        self.drafter.prepare_target(self.target, state, ctx_size)
        return self.drafter.new_state()

    def recycle(self, state: Any, draft_state: Any, ctx_size: int) -> Any:
        """`prepare` for a target state emptied for reuse: capture into its feature ring again (the same
        buffer where it fits, which its recorded decode steps write into), and empty the drafter's state (its
        buffers and recorded block forwards kept) or make one if it had none."""
        self.drafter.prepare_target(self.target, state, ctx_size)
        if draft_state is None:
            return self.drafter.new_state()
        draft_state.crop(0)
        return draft_state

    # -- one step ------------------------------------------------------------------------------------

    def step(self, state: Any, draft_state: Any, root: int, history: list[int], sampler: Any,
             forced: ForcedStep | None = None) -> SpeculativeBlock:
        """Draft after `root` (the pending token at position `state.length`), verify, walk; no commit.

        `history`: every token before the root plus the root (what the drafter and penalties look at)."""
        # Ids the sampler never picks (padding) are never drafted either.
        logits = sampler.suppress(self.drafter.draft(self.target, state, draft_state, history, self.block_size))
        if forced is not None:
            logits = _force(logits, forced)
        verdict = self.verifier.verify(_Suppressing(self.target, sampler), state, root, logits, sampler, history)
        return SpeculativeBlock(list(verdict.tokens), list(verdict.path), verdict.verification, self.target, state)


class _Suppressing:
    """The target as a verifier sees it: its verify pass's logits come with the ids the sampler never picks
    (padding) at -inf, so any verifier, even one that takes a plain argmax as the protocol allows, accepts
    and emits exactly what plain decoding could. Everything else is the target's own."""

    def __init__(self, target: Any, sampler: Any):
        self._target, self._sampler = target, sampler

    def verify(self, *args: Any, **kwargs: Any) -> Any:
        verification = self._target.verify(*args, **kwargs)
        if attrs.has(type(verification)) and hasattr(verification, "logits"):
            return attrs.evolve(verification, logits=self._sampler.suppress(verification.logits))
        return verification

    def __getattr__(self, name: str) -> Any:
        return getattr(self._target, name)


def _greedy_or_sampled_walk(tree: trees.DraftTree, node_logits: torch.Tensor, sampler: Any,
                            history: list[int]) -> tuple[list[int], int]:
    if sampler.params.greedy and not sampler.penalizes:
        # Every node's greedy token in one device reduction and one small copy (not a sync per node).
        best = node_logits.argmax(dim=-1).tolist()
        return trees.sampled_walk(tree, lambda node, accepted: best[node])

    def draw(node: int, accepted: list[int]) -> int:
        return sampler.sample(node_logits[node], history + accepted)

    return trees.sampled_walk(tree, draw)


class TreeVerifier:
    """A verifier that builds a candidate tree from the draft, verifies it in one target pass and walks it.

    Subclasses give `candidates(root, draft_logits, sampler, history)` -> (a `trees.DraftTree`, the
    drafter's per-position probabilities or []), `walk(tree, node_logits, draft_probs, sampler, history)`
    -> (accepted path, bonus token), `max_nodes(block_size)`, and may `learn` from each outcome."""

    name = "tree"

    def verify(self, target: Any, state: Any, root: int, draft_logits: torch.Tensor, sampler: Any,
               history: list[int]) -> Verdict:
        tree, draft_probs = self.candidates(root, draft_logits, sampler, history)
        verification = target.verify(state, tree.tokens, tree.parents)
        path, bonus = self.walk(tree, verification.logits, draft_probs, sampler, history)
        self.learn(tree, len(path) - 1)
        return Verdict([tree.tokens[i] for i in path[1:]] + [bonus], path, verification)

    def learn(self, tree: trees.DraftTree, accepted: int) -> None:
        """Hear how many drafted candidates of `tree` the target accepted (adaptive verifiers)."""

    def describe(self) -> dict[str, Any]:
        return {}


class ChainVerifier(TreeVerifier):
    """One drafted block as a chain. Temperature > 0: speculative sampling (min(1, p/q) and residual)."""

    name = "chain"

    def __init__(self, target: Any, **_: Any) -> None:
        self.target = target

    def max_nodes(self, block_size: int) -> int:
        return block_size

    def candidates(self, root: int, logits: torch.Tensor, sampler: Any, history: list[int]):
        if sampler.params.greedy:
            return trees.chain(root, logits.argmax(dim=-1).tolist()), []
        drafted: list[int] = []
        draft_probs: list[torch.Tensor] = []
        for row in logits:
            q = sampler.probabilities(row, history + drafted)
            draft_probs.append(q)
            drafted.append(int(torch.multinomial(q, 1, generator=sampler.generator)))
        return trees.chain(root, drafted), draft_probs

    def walk(self, tree, node_logits, draft_probs, sampler, history):
        if sampler.params.greedy:
            return _greedy_or_sampled_walk(tree, node_logits, sampler, history)

        def target_probs(node: int, accepted: list[int]) -> torch.Tensor:
            return sampler.probabilities(node_logits[node], history + accepted)

        return trees.chain_rejection_walk(tree, target_probs, draft_probs, sampler.generator)


class DDTreeVerifier(TreeVerifier):
    """A best-first draft tree from the drafter's per-position top-K, under a node budget (or 'auto')."""

    name = "ddtree"

    def __init__(self, target: Any, *, budget: int | str = trees.DEFAULT_BUDGET, top_k: int = trees.DEFAULT_TOP_K,
                 backend: Any = None, **_: Any) -> None:
        if budget != "auto" and (not isinstance(budget, int) or budget < 1):
            raise LuceboxError(f"--tree-budget must be a positive integer or 'auto', got {budget!r}")
        self.target, self.budget, self.top_k = target, budget, top_k
        self.backend = backend if backend is not None else getattr(target, "ops", None)
        self._cost: VerifyCostCurve | None = None
        self._calibration = 1.0  # running ratio of accepted drafts to what the drafter's probabilities predict
        self.last_budget: int | None = None

    def max_nodes(self, block_size: int) -> int:
        budget = AUTO_BUDGETS[-1] if self.budget == "auto" else int(self.budget)
        return max(block_size, budget + 1)

    def describe(self) -> dict[str, Any]:
        return {"tree_budget": self.budget}

    def candidates(self, root: int, logits: torch.Tensor, sampler: Any, history: list[int]):
        log_probs, ids = trees.top_k_log_probs(logits, self.top_k)
        if self.budget != "auto":
            return trees.ddtree(root, log_probs, ids, int(self.budget)), []
        if self._cost is None:
            self._cost = VerifyCostCurve(self.target, self.backend.synchronize if self.backend is not None
                                         else lambda: None)
        full = trees.ddtree(root, log_probs, ids, AUTO_BUDGETS[-1])
        # Best-first order makes every prefix of the node list the tree of that budget. Expected accepted
        # drafts with the first b nodes = the sum of their path probabilities under the drafter, scaled by
        # how well that belief matched the target so far; pick the b with the most tokens per second.
        expected = [0.0]
        for score in full.scores[1:]:
            expected.append(expected[-1] + math.exp(score))
        best = max(
            (b for b in AUTO_BUDGETS if b < len(full.tokens)),
            key=lambda b: (1 + self._calibration * expected[b]) / self._cost(b + 1),
            default=len(full.tokens) - 1,
        )
        self.last_budget = best
        tree = trees.DraftTree(full.tokens[: best + 1], full.parents[: best + 1], full.scores[: best + 1])
        tree.expected_accepted = expected[best]
        return tree, []

    def walk(self, tree, node_logits, draft_probs, sampler, history):
        return _greedy_or_sampled_walk(tree, node_logits, sampler, history)

    def learn(self, tree: trees.DraftTree, accepted: int) -> None:
        predicted = tree.expected_accepted
        if predicted:
            ratio = min(4.0, max(0.05, accepted / predicted))
            self._calibration = 0.9 * self._calibration + 0.1 * ratio


def _force(logits: torch.Tensor, forced: ForcedStep) -> torch.Tensor:
    """Make the first `forced.accept` drafts the reference tokens and keep the next reference token out of
    every candidate list, so the real verifier accepts exactly that many."""
    logits = logits.clone()
    reference = forced.reference
    k = min(forced.accept, logits.shape[0], len(reference))
    for d in range(k):
        logits[d, reference[d]] = logits[d].max() + 10.0
    if k < logits.shape[0] and k < len(reference):
        logits[k, reference[k]] = float("-inf")
    return logits


def forced_accept_counts(mean: float):
    """Per step the number of drafts to accept: floor and ceil of `mean` mixed to that mean."""
    step = 0
    while True:
        yield math.floor((step + 1) * mean + 1e-9) - math.floor(step * mean + 1e-9)
        step += 1
