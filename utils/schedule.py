"""The recipe's learning rate: linear warm-up, then x0.2 at 30%, 60% and 80% of training (epochs 60/120/160 of 200,
as in weiaicunzai/pytorch-cifar100; one within the warm-up applies where it ends). Stepped once per optimizer step."""
import torch

MILESTONES = (0.3, 0.6, 0.8)
GAMMA = 0.2


def warmup_multistep(optimizer, args, steps_per_epoch: int) -> torch.optim.lr_scheduler.LambdaLR:
    warmup = round(args.warmup_epochs * steps_per_epoch)
    milestones = [round(m * args.epochs * steps_per_epoch) for m in MILESTONES]
    def factor(step: int) -> float:  # step = optimizer steps taken so far
        return (step + 1) / warmup if step < warmup else GAMMA ** sum(step >= m for m in milestones)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
