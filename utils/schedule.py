"""The learning-rate recipe: linear scaling with the global batch, linear warm-up,
then x0.2 at 30%, 60% and 80% of training (epochs 60/120/160 of 200, as in
weiaicunzai/pytorch-cifar100). Stepped once per optimizer step."""
import torch

REFERENCE_BATCH = 128  # --lr is the learning rate for this many images per step
MILESTONES = (0.3, 0.6, 0.8)
GAMMA = 0.2


def scaled_lr(args) -> float:
    """Linear scaling rule (Goyal et al., 2017): the step size grows with the batch."""
    return args.lr * args.batch_size / REFERENCE_BATCH


def warmup_multistep(optimizer, args, steps_per_epoch: int) -> torch.optim.lr_scheduler.LambdaLR:
    warmup = round(args.warmup_epochs * steps_per_epoch)
    milestones = [round(m * args.epochs * steps_per_epoch) for m in MILESTONES]

    def factor(step: int) -> float:  # step = optimizer steps taken so far
        if step < warmup:
            return (step + 1) / warmup
        return GAMMA ** sum(step >= m for m in milestones)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
