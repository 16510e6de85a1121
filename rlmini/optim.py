"""The optimizer: fused AdamW over the trainable parameters (the policy's, PPO's critic's), and the lr
schedule over the run's optimizer steps."""
import math

import torch


def adamw(parameters, lr: float, weight_decay: float):
    """AdamW (betas 0.9, 0.999), fused: one kernel for every parameter."""
    return torch.optim.AdamW(parameters, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.999), fused=True)


def schedule(optimizer, args):
    """--warmup, then --lr_schedule, over the run's optimizer steps (steps x updates_per_rollout x
    minibatches)."""
    total = args.steps * args.updates_per_rollout * args.minibatches
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(args.warmup, args.lr_schedule, total))


def lr_lambda(warmup: int, schedule: str = "constant", total: int = 0):
    """The lr's multiplier at optimizer step k: linear warm-up, then constant, or decaying to 0 at step
    `total` (linear: nanochat's warm-down; cosine: Loshchilov & Hutter 2017, TRL's "cosine")."""
    def multiplier(k: int) -> float:
        if k < warmup:
            return (k + 1) / warmup
        if schedule == "constant" or total <= warmup:
            return 1.0
        t = min(1.0, (k - warmup) / (total - warmup))
        return 1.0 - t if schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * t))
    return multiplier
