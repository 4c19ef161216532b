"""Candidate trees for speculative verification: building them, indexing them, walking them.

A candidate set is a tree whose root is the pending token (sampled, not yet fed to the target) and whose
other nodes are drafted tokens; a chain is the tree with parents `[-1, 0, 1, ...]`. Node indices are in
insertion order, so a parent always precedes its children. The target verifies every node in one
forward pass (`TreeIndex` is what a model needs for that: parents, depths, the ancestor-only attention
mask); an acceptance walk then picks the path to commit and the bonus
token that follows it.

DDTree (Ringel & Romano, arXiv 2604.12989): best-first on the cumulative draft log-probability of the
path, from per-position top-K candidates, under a node budget, with the top-1 chain inserted first.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence

import attrs
import torch

DEFAULT_BUDGET = 22
DEFAULT_TOP_K = 8


@attrs.frozen
class TreeIndex:
    """The shape of a candidate tree as tensors a model's verify pass uses."""

    parents: torch.Tensor  # [N] long, -1 for the root
    depths: torch.Tensor  # [N] long, 0 for the root
    max_depth: int  # the deepest node's depth (host value)
    _parent_list: tuple[int, ...]

    @classmethod
    def build(cls, parents: Sequence[int], device: torch.device | str = "cpu") -> TreeIndex:
        parent_list = tuple(int(p) for p in parents)
        if not parent_list or parent_list[0] != -1:
            raise ValueError(f"node 0 must be the root (parent -1), got parents {list(parent_list)}")
        depths = [0]
        for i, p in enumerate(parent_list[1:], start=1):
            if not 0 <= p < i:
                raise ValueError(f"node {i} has parent {p}: parents must precede their children")
            depths.append(depths[p] + 1)
        return cls(
            torch.tensor(parent_list, dtype=torch.long, device=device),
            torch.tensor(depths, dtype=torch.long, device=device),
            max(depths),
            parent_list,
        )

    @property
    def size(self) -> int:
        return len(self._parent_list)

    @property
    def parent_list(self) -> tuple[int, ...]:
        """The parents as host integers (reading `parents` would wait for the device)."""
        return self._parent_list

    def visibility(self) -> torch.Tensor:
        """Bool `[N, N]`: row i is True at node i and at each of its ancestors."""
        n = self.size
        visible = torch.zeros(n, n, dtype=torch.bool)
        for i, p in enumerate(self._parent_list):
            if p >= 0:
                visible[i] = visible[p]
            visible[i, i] = True
        return visible.to(self.parents.device)



@attrs.define
class DraftTree:
    """Tokens and parents of a candidate tree (root first), with a child lookup for the walks."""

    tokens: list[int]
    parents: list[int]
    scores: list[float] = attrs.Factory(list)  # cumulative draft log-probability of each node's path
    children: dict[tuple[int, int], int] = attrs.Factory(dict)  # (parent, token) -> node
    expected_accepted: float | None = None  # what the drafter's own probabilities predict (auto budget)

    def __attrs_post_init__(self) -> None:
        if not self.scores:
            self.scores = [0.0] * len(self.tokens)
        for i, (token, parent) in enumerate(zip(self.tokens, self.parents)):
            if parent >= 0:
                self.children.setdefault((parent, token), i)

    def __len__(self) -> int:
        return len(self.tokens)

    def depth(self, node: int) -> int:
        d = 0
        while self.parents[node] >= 0:
            node, d = self.parents[node], d + 1
        return d


def chain(root: int, drafted: Sequence[int]) -> DraftTree:
    """The chain root -> drafted[0] -> drafted[1] -> ..."""
    tokens = [int(root), *(int(t) for t in drafted)]
    return DraftTree(tokens, list(range(-1, len(tokens) - 1)))


def top_k_log_probs(logits: torch.Tensor, k: int = DEFAULT_TOP_K, temperature: float = 1.0) -> tuple[list, list]:
    """Per draft position (rows of `logits` `[L, vocab]`), the `k` best log-probabilities and their ids,
    best first, as Python lists."""
    log_probs = torch.log_softmax(logits.float() / temperature, dim=-1)
    values, ids = torch.topk(log_probs, min(k, log_probs.shape[-1]), dim=-1)
    return values.tolist(), ids.tolist()


def ddtree(
    root: int, log_probs: Sequence[Sequence[float]], ids: Sequence[Sequence[int]], budget: int = DEFAULT_BUDGET,
    *, chain_seed: bool = True,
) -> DraftTree:
    """Best-first tree of at most `budget` drafted nodes (plus the root).

    `log_probs[d]`, `ids[d]`: the top-K candidates for depth `d + 1`, best first. A node's score is the
    sum of the log-probabilities chosen along its path. With `chain_seed`, the top-1 chain goes in first
    (its rank-1 siblings wait in the heap), which keeps the best single path whole under a small budget.
    """
    depth_limit = len(log_probs)
    tokens, parents, scores = [int(root)], [-1], [0.0]
    heap: list[tuple[float, int, int, int, int]] = []  # (-score, tiebreak, parent, depth, rank)
    counter = 0

    def push(score: float, parent: int, depth: int, rank: int) -> None:
        nonlocal counter
        if depth <= depth_limit and rank < len(ids[depth - 1]):
            heapq.heappush(heap, (-score, counter, parent, depth, rank))
            counter += 1

    def add(parent: int, depth: int, rank: int, score: float) -> int:
        tokens.append(int(ids[depth - 1][rank]))
        parents.append(parent)
        scores.append(score)
        return len(tokens) - 1

    if budget <= 0 or depth_limit == 0:
        return DraftTree(tokens, parents, scores)
    if chain_seed:
        parent = 0
        for depth in range(1, min(depth_limit, budget) + 1):
            base = scores[parent]
            push(base + log_probs[depth - 1][1] if len(ids[depth - 1]) > 1 else 0.0, parent, depth, 1)
            parent = add(parent, depth, 0, base + log_probs[depth - 1][0])
    else:
        push(log_probs[0][0], 0, 1, 0)
    while len(tokens) - 1 < budget and heap:
        negative, _, parent, depth, rank = heapq.heappop(heap)
        score = -negative
        node = add(parent, depth, rank, score)
        base = scores[parent]
        if rank + 1 < len(ids[depth - 1]):
            push(base + log_probs[depth - 1][rank + 1], parent, depth, rank + 1)
        if depth < depth_limit:
            push(score + log_probs[depth][0], node, depth + 1, 0)
    return DraftTree(tokens, parents, scores)


# -- acceptance walks ---------------------------------------------------------------------------------


def greedy_walk(tree: DraftTree, target_argmax: Sequence[int]) -> tuple[list[int], int]:
    """Temperature 0: follow the child whose token is the target's argmax at the current node.

    Returns the accepted path (node indices, root first) and the bonus token after it."""
    node, path = 0, [0]
    following = int(target_argmax[0])
    while (node, following) in tree.children:
        node = tree.children[(node, following)]
        path.append(node)
        following = int(target_argmax[node])
    return path, following


def sampled_walk(tree: DraftTree, draw: Callable[[int, list[int]], int]) -> tuple[list[int], int]:
    """Temperature > 0 on a tree: at each node draw the next token from the target's own distribution
    there (`draw(node, accepted_tokens_so_far)`), move to the child holding it if there is one, else it
    is the bonus. Every emitted token is a draw from the target, so the output distribution is exactly
    the target's, whatever the tree."""
    node, path = 0, [0]
    following = draw(0, [])
    while (node, following) in tree.children:
        node = tree.children[(node, following)]
        path.append(node)
        following = draw(node, [tree.tokens[i] for i in path[1:]])
    return path, following


def chain_rejection_walk(
    tree: DraftTree,
    target_probs: Callable[[int, list[int]], torch.Tensor],
    draft_probs: Sequence[torch.Tensor],
    generator: torch.Generator | None,
) -> tuple[list[int], int]:
    """Speculative sampling on a chain (Leviathan et al., Chen et al.): drafted token `x` at depth `d`,
    drawn from `draft_probs[d-1]` = q, is accepted with probability min(1, p(x) / q(x)) where p =
    `target_probs(parent node, accepted tokens so far)`; the first rejection resamples from the residual
    normalise(max(p - q, 0)); a fully accepted chain draws the bonus from p at the last node. The
    emitted tokens are distributed exactly as the target's."""
    node, path = 0, [0]
    accepted: list[int] = []
    for depth in range(1, len(tree)):
        p = target_probs(node, accepted)
        q = draft_probs[depth - 1].to(p.device)
        x = tree.tokens[depth]
        ratio = float(p[x]) / float(q[x]) if float(q[x]) > 0 else 0.0
        if float(torch.rand((), generator=generator, device=p.device)) < ratio:
            node = depth
            path.append(node)
            accepted.append(x)
            continue
        residual = (p - q).clamp(min=0)
        if float(residual.sum()) <= 0:  # p == q (within rounding): the residual is p itself
            residual = p
        return path, int(torch.multinomial(residual / residual.sum(), 1, generator=generator))
    p = target_probs(node, accepted)
    return path, int(torch.multinomial(p, 1, generator=generator))
