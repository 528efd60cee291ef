"""The optimisation loop shared by every kind of heads, and starting from heads already trained.

:func:`fit` is AdamW with warm-up and cosine decay, resumable from a checkpoint (a run stopped for
time goes on where it was, batch for batch); :func:`warm_start` loads saved heads of the same kind
and target into a module, widening an EAGLE drafter's MLP where asked (:func:`widened_mlp`).
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from verispec.errors import VerispecError
from verispec.heads.eagle import EagleConfig
from verispec.heads.io import WEIGHTS_FILE, file_sha256, load_heads
from verispec.training.config import TrainSettings


def fit(
    module: nn.Module,
    batches: Callable[[int], list[Any]],
    loss_fn: Callable[[Any], torch.Tensor],
    settings: TrainSettings,
    checkpoint: Path | None = None,
    *,
    resume: bool = False,
    progress: bool = True,
    checkpoint_every_s: float = 120.0,
) -> dict[str, Any]:
    """AdamW, 3% warm-up then cosine decay to a tenth, under bf16 autocast where ``settings`` says;
    ``batches(epoch)`` must be deterministic, so a resumed run skips exactly the batches it already
    took. Returns loss and step statistics, with wall seconds (which include any time the process
    was stopped) and process CPU seconds."""
    from tqdm import tqdm

    params = [p for p in module.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=settings.lr, weight_decay=0.0)
    per_epoch = len(batches(0))
    total = max(1, per_epoch * settings.epochs)
    warmup = max(1, total // 33)

    def lr_at(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_at)
    step, seconds, cpu_seconds, losses = 0, 0.0, 0.0, []
    if resume and checkpoint is not None and checkpoint.is_file():
        state = torch.load(checkpoint, weights_only=False)
        module.load_state_dict(state["module"])
        optimizer.load_state_dict(state["optimizer"])
        step, seconds, losses = state["step"], state["seconds"], state["losses"]
        cpu_seconds = state.get("cpu_seconds", 0.0)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_at, last_epoch=step - 1)
        print(f"resuming from {checkpoint} at step {step}/{total}", file=sys.stderr)

    def save() -> None:
        if checkpoint is None:
            return
        checkpoint.parent.mkdir(parents=True, exist_ok=True)
        tmp = checkpoint.with_suffix(".tmp")
        state = {"module": module.state_dict(), "optimizer": optimizer.state_dict(), "step": step}
        times = {"seconds": seconds, "cpu_seconds": cpu_seconds}
        torch.save({**state, **times, "losses": losses, "settings": asdict(settings)}, tmp)
        tmp.replace(checkpoint)

    module.train()
    bar = tqdm(total=total, initial=min(step, total), unit="step", desc=f"training {settings.kind}",
               disable=not progress)  # fmt: skip
    began = last_save = time.perf_counter()
    base_seconds, base_cpu, began_cpu = seconds, cpu_seconds, time.process_time()
    smooth = None
    for epoch in range(step // per_epoch if per_epoch else 0, settings.epochs):
        for index, batch in enumerate(batches(epoch)):
            if epoch * per_epoch + index < step:
                continue
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=settings.precision == "bf16"):
                loss = loss_fn(batch)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            scheduler.step()
            step += 1
            value = float(loss.detach())
            smooth = value if smooth is None else 0.98 * smooth + 0.02 * value
            if step % 50 == 0 or step == total:
                losses.append((step, round(smooth, 4)))
            bar.update(1)
            bar.set_postfix(loss=f"{smooth:.3f}", lr=f"{scheduler.get_last_lr()[0]:.1e}")
            seconds = base_seconds + time.perf_counter() - began
            cpu_seconds = base_cpu + time.process_time() - began_cpu
            if time.perf_counter() - last_save > checkpoint_every_s:
                save()
                last_save = time.perf_counter()
    bar.close()
    seconds = base_seconds + time.perf_counter() - began
    cpu_seconds = base_cpu + time.process_time() - began_cpu
    save()
    module.eval()
    return {"steps": step, "seconds": round(seconds, 1), "cpu_seconds": round(cpu_seconds, 1),
            "final_loss": losses[-1][1] if losses else None, "loss_curve": losses[-20:]}  # fmt: skip


def warm_start(module: nn.Module, settings: TrainSettings, target: Any) -> str:
    """Load ``settings.init_from``'s weights into ``module``; refused for another kind, target or
    size. Returns the sha256 of the weights file, for the training record (heads are retrained and
    shipped again, so a path alone does not say which weights a run started from)."""
    folder = Path(settings.init_from or "")
    loaded = load_heads(folder, target, kind=settings.kind)
    want, have = module.config, loaded.module.config  # type: ignore[union-attr]
    state = loaded.module.state_dict()
    if isinstance(want, EagleConfig):
        # A drafter without feature layers may start one with them: its taps' projection starts at
        # zero. A wider MLP starts as the narrower one plus units that add nothing yet.
        if not have.feature_layers:
            want = replace(want, feature_layers=())
        if want.intermediate_size > have.intermediate_size:
            state = widened_mlp(state, module.state_dict(), have.intermediate_size)
            want = replace(want, intermediate_size=have.intermediate_size)
    if want != have:
        raise VerispecError(
            f"--init-from {folder}: its sizes {have.to_dict()} differ from this run's "
            f"{module.config.to_dict()} (only a wider MLP or added feature layers can start from them)"
        )
    missing, unexpected = module.load_state_dict(state, strict=False)
    if unexpected or any(not name.startswith("tap_") for name in missing):
        raise VerispecError(f"--init-from {folder}: weights do not match ({missing + unexpected})")
    return file_sha256(folder / WEIGHTS_FILE)


def widened_mlp(
    state: dict[str, torch.Tensor], fresh: dict[str, torch.Tensor], width: int
) -> dict[str, torch.Tensor]:
    """``state`` (an EAGLE drafter whose MLP has ``width`` units) with the MLP of ``fresh`` (a wider
    drafter's freshly initialised weights) holding it: the old units are copied, the new ones keep
    their random gate/up rows and get zero down-projection columns. The widened drafter computes
    exactly what the narrow one did (a new unit's output is multiplied by zero) and its new units
    still learn (their gate/up rows are not zero, so the down columns get gradients): net2net-style
    growth, so a capacity test starts from trained heads instead of from scratch."""
    out = dict(state)
    for name in ("gate_proj", "up_proj", "down_proj"):
        key = f"layers.0.mlp.{name}.weight"
        grown = fresh[key].detach().clone()
        if name == "down_proj":
            grown[:, width:] = 0
            grown[:, :width] = state[key]
        else:
            grown[:width] = state[key]
        out[key] = grown
    return out
