"""The training loops of `train_demo.py`: the target on random windows of the corpus, the drafter on the target's
own greedy continuations, each for a wall-clock share of the budget, and their held-out measures.

A phase's step count is fixed by a flag or measured: after a few warm steps the time per step gives how many
fit in the phase's seconds, and the schedule (linear warm-up, cosine to `min_lr_ratio`) runs over that count,
which is recorded; the phase still stops at its deadline if steps turn out slower.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import attrs
import numpy as np
import torch

import demo_models

CALIBRATION_STEPS = (3, 13)  # steps between which the time per step is measured
STEP_MARGIN = 0.97  # of the measured step count: room for the quick evaluations in the phase


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _param_groups(module: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Matrices decay (the embedding and the projections); norms, per-head scalars and conv taps do not."""
    decay, keep = [], []
    for name, p in module.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() == 2 and "conv1d" not in name else keep).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": keep, "weight_decay": 0.0}]


@attrs.define
class PoolChunk:
    """Target continuations of prompts of one length: tokens `[n, P + G]` and the captured features."""

    tokens: torch.Tensor
    features: torch.Tensor  # [n, P + G, taps * hidden]
    prompt_len: int

    @property
    def count(self) -> int:
        return int(self.tokens.shape[0])


class BestWeights:
    """The weights at the best score offered so far (a copy on the device: the models are small)."""

    def __init__(self, module: torch.nn.Module, *, lower_is_better: bool) -> None:
        self.module = module
        self.sign = 1.0 if lower_is_better else -1.0
        self.score: float | None = None
        self.step = 0
        self.state: dict[str, torch.Tensor] | None = None

    def offer(self, score: float, step: int) -> bool:
        if not math.isfinite(score) or (self.score is not None and self.sign * score >= self.sign * self.score):
            return False
        self.score, self.step = score, step
        self.state = {k: v.detach().clone() for k, v in self.module.state_dict().items()}
        return True

    def restore(self) -> int:
        """Load the kept weights back; returns the step they are from."""
        if self.state is not None:
            self.module.load_state_dict(self.state)
        return self.step


class Trainer:
    def __init__(self, args: Any, device: torch.device, log: Callable[[str], None]) -> None:
        self.args = args
        self.device = device
        self.log = log
        self.autocast_dtype = torch.bfloat16 if device.type == "cuda" else None
        self.heldout_pool: list[PoolChunk] = []
        self.steps_done = 0  # of the phase running: what a quick evaluation's kept weights are recorded as

    def autocast(self) -> Any:
        if self.autocast_dtype is None:
            return torch.autocast("cpu", enabled=False)
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    # -- the shared loop ------------------------------------------------------------------------------

    def run_phase(self, name: str, step: Callable[[int], torch.Tensor], optimizer: torch.optim.Optimizer,
                  seconds: float, fixed_steps: int, peak_lr: float, tokens_per_step: int,
                  every: Callable[[], str] | None = None) -> dict:
        args = self.args
        start = time.perf_counter()
        deadline = start + seconds
        total = fixed_steps or None
        last_log = last_eval = start
        done, losses, logged = 0, [], 0
        timed_from = None
        stopped_by_deadline = False
        while total is None or done < total:
            if time.perf_counter() >= deadline:
                stopped_by_deadline = total is not None and done < total
                break
            warm = min(1.0, (done + 1) / max(1, args.warmup))
            progress = 0.0 if total is None else min(1.0, max(0, done - args.warmup) / max(1, total - args.warmup))
            cosine = args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
            for group in optimizer.param_groups:
                group["lr"] = peak_lr * warm * cosine
            losses.append(step(done))
            done += 1
            self.steps_done = done
            if total is None and done == CALIBRATION_STEPS[0]:
                _sync(self.device)
                timed_from = time.perf_counter()
            elif total is None and done == CALIBRATION_STEPS[1] and timed_from is not None:
                _sync(self.device)
                per_step = (time.perf_counter() - timed_from) / (CALIBRATION_STEPS[1] - CALIBRATION_STEPS[0])
                total = done + int(STEP_MARGIN * (deadline - time.perf_counter()) / per_step)
                self.log(f"{name}: {per_step * 1e3:.1f} ms a step -> {total} steps in {seconds:.0f} s")
            now = time.perf_counter()
            if now - last_log >= 10 or done == total:
                recent = torch.stack(losses[logged:]).float().mean().item()
                logged = len(losses)
                extra = ""
                if every is not None and now - last_eval >= args.eval_every_s:
                    extra, last_eval = "; " + every(), time.perf_counter()
                elapsed = time.perf_counter() - start
                self.log(f"{name} step {done}/{total or '?'}: loss {recent:.4f}, lr {optimizer.param_groups[0]['lr']:.2e}, "
                         f"{done * tokens_per_step / elapsed:,.0f} tok/s{extra}")
                last_log = time.perf_counter()
        _sync(self.device)
        seconds_taken = time.perf_counter() - start
        final = torch.stack(losses[-max(1, min(50, len(losses))):]).float().mean().item() if losses else float("nan")
        if stopped_by_deadline:
            self.log(f"{name}: the deadline came at step {done} of {total} (steps slower than measured)")
        return {"steps": done, "planned_steps": total or done, "seconds": seconds_taken, "final_train_loss": final,
                "tokens_seen": done * tokens_per_step, "stopped_by_deadline": stopped_by_deadline}

    # -- the target -----------------------------------------------------------------------------------

    def train_target(self, model: demo_models.Qwen35Trainable, corpus: Any, seconds: float) -> dict:
        args, device = self.args, self.device
        stream = torch.from_numpy(corpus.train.astype(np.int64)).to(device)
        window = torch.arange(args.seq_len + 1, device=device)
        rng = np.random.default_rng(args.seed)
        fused = device.type == "cuda"
        optimizer = torch.optim.AdamW(_param_groups(model, args.weight_decay), lr=args.lr, betas=(0.9, 0.95),
                                      eps=1e-8, fused=fused)
        params = [p for p in model.parameters() if p.requires_grad]
        model.train()

        def step(_: int) -> torch.Tensor:
            offsets = torch.from_numpy(rng.integers(0, stream.numel() - args.seq_len - 1, size=args.batch))
            batch = stream[offsets.to(device)[:, None] + window]
            with self.autocast():
                total, count = model.loss(batch[:, :-1], batch[:, 1:])
                loss = total / count
            return _optimizer_step(loss, params, optimizer)

        best = BestWeights(model, lower_is_better=True)

        def quick_eval() -> str:
            measured = self.heldout_loss(model, corpus.heldout, args.quick_eval_tokens)
            model.train()
            kept = best.offer(measured["loss"], self.steps_done)
            return f"held-out {measured['loss']:.4f}" + (" (best so far: kept)" if kept else "")

        report = self.run_phase("target", step, optimizer, seconds, args.target_steps, args.lr,
                                args.batch * args.seq_len, quick_eval)
        # The small corpus is seen for many epochs: the held-out loss turns up before the schedule ends, so the
        # weights of the best quick measure are the ones kept (early stopping), when one was kept.
        final = self.heldout_loss(model, corpus.heldout, args.quick_eval_tokens)
        best.offer(final["loss"], report["steps"])
        report["kept_step"] = best.restore()
        self.log(f"target: keeping the weights of step {report['kept_step']} (quick held-out {best.score:.4f})")
        report["epochs"] = report["tokens_seen"] / max(1, corpus.train.size)
        report["heldout_trained"] = self.heldout_loss(model, corpus.heldout, args.eval_tokens)
        self.log(f"target: {report['steps']} steps, {report['epochs']:.1f} epochs, held-out loss "
                 f"{report['heldout_trained']['loss']:.4f} before the file's rounding")
        return report

    @torch.no_grad()
    def heldout_loss(self, model: demo_models.Qwen35Trainable, tokens: np.ndarray, max_tokens: int) -> dict:
        """Mean next-token loss over consecutive windows of the held-out stream (up to `max_tokens`)."""
        args = self.args
        model.eval()
        windows = max(1, min(max_tokens, tokens.size - 1) // args.seq_len)
        length = min(args.seq_len, tokens.size - 1)
        stream = torch.from_numpy(tokens[: windows * length + 1].astype(np.int64)).to(self.device)
        starts = torch.arange(windows, device=self.device) * length
        window = torch.arange(length + 1, device=self.device)
        total = count = 0.0
        for first in range(0, windows, args.batch):
            batch = stream[starts[first:first + args.batch, None] + window]
            with self.autocast():
                loss, n = model.loss(batch[:, :-1], batch[:, 1:], exact=True)
            total, count = total + loss.item(), count + n.item()
        mean = total / count
        return {"loss": mean, "perplexity": math.exp(mean), "tokens": int(count)}

    # -- the drafter ----------------------------------------------------------------------------------

    @torch.no_grad()
    def make_pool(self, target: demo_models.Qwen35Trainable, tokens: np.ndarray, count: int, seed: int,
                  deadline: float, capture: tuple[int, ...], batch: int,
                  prompt_ends: np.ndarray | None = None) -> list[PoolChunk]:
        """The target's greedy continuations of `count` prompts cut from `tokens`, `batch` at a time (the
        prompt length taking turns through `--prompt-lens`), with its captured layers over each whole
        sequence; stops at `deadline`."""
        args, device = self.args, self.device
        stream = torch.from_numpy(tokens.astype(np.int64)).to(device)
        rng = np.random.default_rng(seed)
        feature_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        chunks: list[PoolChunk] = []
        made = index = 0
        target.eval()
        while made < count and time.perf_counter() < deadline:
            prompt_len = args.prompt_lens[index % len(args.prompt_lens)]
            index += 1
            size = min(batch, count - made)
            starts = rng.integers(0, stream.numel() - prompt_len, size=size)
            ends = prompt_ends[prompt_ends >= prompt_len] if prompt_ends is not None else np.zeros(0, dtype=np.int64)
            if ends.size and args.function_prompt_share > 0:
                # A share of the prompts end just after a training function's docstring (the benchmark's kind of
                # prompt: the body comes next), the rest at random positions of the stream.
                chosen = rng.random(size) < args.function_prompt_share
                starts[chosen] = rng.choice(ends, size=int(chosen.sum())) - prompt_len
            offsets = torch.from_numpy(starts).to(device)
            prompts = stream[offsets[:, None] + torch.arange(prompt_len, device=device)]
            began = time.perf_counter()
            with self.autocast():
                continuation = target.generate_greedy(prompts, args.gen_tokens)
                sequences = torch.cat([prompts, continuation], dim=1)
                _, taps = target.hidden_states(sequences, capture=capture)
            chunks.append(PoolChunk(sequences, torch.cat(taps, dim=-1).to(feature_dtype), prompt_len))
            made += size
            _sync(device)
            self.log(f"continuations: {size} of prompt length {prompt_len} in {time.perf_counter() - began:.1f} s")
        return chunks

    def _blocks(self, chunk: PoolChunk, rows: torch.Tensor, anchors: np.ndarray, target: Any, mask_id: int):
        """Inputs and labels of the blocks anchored at `anchors` `[b, N]` of sequences `rows` of `chunk`."""
        size = self.args.block_size
        device = self.device
        sequences = chunk.tokens[rows.to(device)]
        anchor = torch.from_numpy(anchors).to(device)
        batch, blocks = anchors.shape
        block_ids = torch.full((batch, blocks, size), mask_id, dtype=torch.long, device=device)
        block_ids[:, :, 0] = sequences.gather(1, anchor)
        label_positions = (anchor[:, :, None] + torch.arange(1, size, device=device)).reshape(batch, -1)
        labels = sequences.gather(1, label_positions).reshape(batch, blocks, size - 1)
        embeddings = target.embed_tokens.weight.detach()[block_ids]
        context = int(anchors.max())
        features = chunk.features[rows.to(device), :max(1, context)]
        return features, embeddings, anchor, labels

    def train_drafter(self, drafter: demo_models.DFlashTrainable, target: demo_models.Qwen35Trainable, corpus: Any,
                      seconds: float) -> dict:
        args, device = self.args, self.device
        start = time.perf_counter()
        target.requires_grad_(False)
        capture = tuple(drafter.config.target_layer_ids)
        mask_id = int(drafter.config.mask_token_id)
        # At most a third of the phase for the continuations; the held-out ones first (few).
        # The held-out continuations in one batch per prompt length, so that every length is measured.
        heldout_batch = max(1, -(-args.heldout_gen_seqs // len(args.prompt_lens)))
        self.heldout_pool = self.make_pool(target, corpus.heldout, args.heldout_gen_seqs, args.seed + 2,
                                           start + seconds / 6, capture, heldout_batch)
        pool = self.make_pool(target, corpus.train, args.gen_seqs, args.seed + 3, start + seconds / 3, capture,
                              args.gen_batch, prompt_ends=corpus.docstring_ends)
        generated = sum(c.count for c in pool)
        gen_seconds = time.perf_counter() - start
        self.log(f"drafter data: {generated} continuations of {args.gen_tokens} tokens ({len(pool)} batches) and "
                 f"{sum(c.count for c in self.heldout_pool)} held-out ones in {gen_seconds:.0f} s")
        untrained = self.drafter_accuracy(drafter, target, self.heldout_pool)
        self.log(f"drafter untrained: held-out mean chain acceptance {untrained['chain_length']:.2f}")
        weights = demo_models.block_weights(args.block_size, args.gamma, device)
        embed = target.embed_tokens.weight.detach()
        rng = np.random.default_rng(args.seed + 4)
        optimizer = torch.optim.AdamW(_param_groups(drafter, args.weight_decay), lr=args.draft_lr, betas=(0.9, 0.95),
                                      eps=1e-8, fused=device.type == "cuda")
        params = [p for p in drafter.parameters() if p.requires_grad]
        drafter.train()

        def step(_: int) -> torch.Tensor:
            chunk = pool[int(rng.integers(len(pool)))]
            rows = torch.from_numpy(rng.choice(chunk.count, size=args.draft_batch, replace=chunk.count < args.draft_batch))
            anchors = self.sample_anchors(chunk, len(rows), rng)
            features, embeddings, anchor, labels = self._blocks(chunk, rows, anchors, target, mask_id)
            with self.autocast():
                hidden = drafter.block_hidden(features, embeddings, anchor)[:, :, 1:]
                total, weight = demo_models.chunked_cross_entropy(hidden, embed, labels, weights.expand_as(labels),
                                                                   vocabulary=target.vocabulary, skip_outside=True)
                loss = total / weight
            return _optimizer_step(loss, params, optimizer)

        best = BestWeights(drafter, lower_is_better=False)
        quick_pool = self.heldout_pool[::2]  # every other prompt length: half the cost of the whole pool

        def quick_eval() -> str:
            measured = self.drafter_accuracy(drafter, target, quick_pool)
            drafter.train()
            kept = best.offer(measured["chain_length"], self.steps_done)
            return f"held-out chain acceptance {measured['chain_length']:.2f}" + (" (best so far: kept)" if kept else "")

        remaining = seconds - (time.perf_counter() - start)
        report = self.run_phase("drafter", step, optimizer, remaining, args.draft_steps, args.draft_lr,
                                args.draft_batch * args.anchors * (args.block_size - 1), quick_eval)
        best.offer(self.drafter_accuracy(drafter, target, quick_pool)["chain_length"], report["steps"])
        report["kept_step"] = best.restore()
        self.log(f"drafter: keeping the weights of step {report['kept_step']} (quick held-out chain {best.score:.2f})")
        report.update(continuations=generated, generation_seconds=gen_seconds, untrained=untrained)
        report["heldout_trained"] = self.drafter_accuracy(drafter, target, self.heldout_pool)
        self.log(f"drafter: {report['steps']} steps, held-out mean chain acceptance "
                 f"{report['heldout_trained']['chain_length']:.2f} (untrained {untrained['chain_length']:.2f})")
        return report

    def sample_anchors(self, chunk: PoolChunk, rows: int, rng: np.random.Generator) -> np.ndarray:
        """`--anchors` distinct block starts per row, from the prompt's last token to the last full block: every
        label is then a token the target generated."""
        low, high = chunk.prompt_len - 1, chunk.tokens.shape[1] - self.args.block_size
        span = high - low + 1
        count = min(self.args.anchors, span)
        return np.stack([rng.choice(span, size=count, replace=False) for _ in range(rows)]) + low

    @torch.no_grad()
    def drafter_accuracy(self, drafter: demo_models.DFlashTrainable, target: demo_models.Qwen35Trainable,
                         pool: list[PoolChunk], rows_per_pass: int = 8) -> dict:
        """Greedy drafts against the target's continuation at every 4th position of the held-out pool: the
        accuracy per block position and the mean accepted length of a chain verify (leading hits + the bonus)."""
        args = self.args
        drafter.eval()
        embed = target.embed_tokens.weight.detach()
        hits = torch.zeros(args.block_size - 1, dtype=torch.float64)
        lengths: list[torch.Tensor] = []
        for chunk in pool:
            low, high = chunk.prompt_len - 1, chunk.tokens.shape[1] - args.block_size
            positions = np.arange(low, high + 1, 4)[:64]
            for first in range(0, chunk.count, rows_per_pass):
                rows = torch.arange(first, min(first + rows_per_pass, chunk.count))
                anchors = np.tile(positions, (len(rows), 1))
                features, embeddings, anchor, labels = self._blocks(chunk, rows, anchors, target,
                                                                    int(drafter.config.mask_token_id))
                with self.autocast():
                    hidden = drafter.block_hidden(features, embeddings, anchor)[:, :, 1:]
                flat = hidden.reshape(-1, hidden.shape[-1])
                predicted = torch.cat([(part @ embed.T.to(part.dtype)).argmax(-1) for part in flat.split(4096)])
                correct = (predicted.reshape(labels.shape) == labels).cpu()
                hits += correct.double().sum(dim=(0, 1))
                lengths.append(correct.long().cumprod(-1).sum(-1).flatten() + 1)
        if not lengths:
            return {"chain_length": float("nan"), "accuracy_by_position": [], "blocks": 0}
        lengths_all = torch.cat(lengths).double()
        return {"chain_length": lengths_all.mean().item(), "accuracy_by_position": (hits / len(lengths_all)).tolist(),
                "blocks": int(len(lengths_all))}


def _optimizer_step(loss: torch.Tensor, params: list, optimizer: Any) -> torch.Tensor:
    """Back-propagate `loss`, clip the gradients' norm to 1, step and clear: one training step's end."""
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()
