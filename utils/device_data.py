"""--data-on-gpu: the training and test sets live in device memory and are
augmented and normalised there.

CIFAR's training set is 50,000 x 3 x 32 x 32 bytes, about 150 MB as uint8: it fits
on any GPU many times over. Kept there, a training step needs no loader workers,
no host-to-device copy and no per-image Python; the crop, flip and normalisation
of a whole batch are a handful of GPU kernels.

The samples and their augmentation are exactly those of the template path
(utils/data.py): the same TrainSampler decides which indices each rank takes at
each step and the same per-epoch table gives each sample its crop offset and
flip. The batches are uint8, as the loader's are, and the training loop
normalises both alike (data.model_inputs): bitwise the same model input.
"""
import numpy as np
import torch
from torch.utils.data import Subset

from . import data
from .metrics import PAD_TARGET


def crop_flip_batch(padded: torch.Tensor, dy, dx, flip) -> torch.Tensor:
    """data.crop_flip for padded B x C x 40 x 40 images on any device, bitwise what it gives one by one."""
    b, c = padded.shape[:2]
    window = torch.arange(32, device=padded.device)
    rows = (dy.view(b, 1) + window).view(b, 1, 32, 1).expand(b, c, 32, padded.shape[3])
    cols = (dx.view(b, 1) + window).view(b, 1, 1, 32).expand(b, c, 32, 32)
    out = padded.gather(2, rows).gather(3, cols)
    return torch.where(flip.view(b, 1, 1, 1).bool(), out.flip(3), out)


def uint8_images(dataset) -> tuple:
    """(N x 32 x 32 x 3 uint8 array, N labels) of a data set built by data.build_datasets."""
    if isinstance(dataset, Subset):
        images, targets = uint8_images(dataset.dataset)
        keep = np.asarray(dataset.indices)
        return images[keep], [targets[i] for i in keep]
    if isinstance(dataset, data.SyntheticCIFAR):
        return np.stack([dataset[i][0] for i in range(len(dataset))]), list(dataset.targets)
    return np.asarray(dataset.data), list(dataset.targets)  # data.CIFAR100


class DeviceTrainLoader:
    """Iterates (uint8 images, targets) batches already on `device`, like the DataLoader
    built by data.train_loader, with the same `sampler.set_epoch(epoch, start_step)`."""

    def __init__(self, train_set: data.TrainImages, per_device_batch: int, global_batch: int, env, args):
        images, targets = uint8_images(train_set.base)
        self.device = env.device
        pixels = torch.from_numpy(images).to(env.device).permute(0, 3, 1, 2)
        # Padded once for the whole run: each batch's crop is then a gather.
        self.padded = torch.nn.functional.pad(pixels, (data.PAD,) * 4).contiguous()
        self.targets = torch.tensor(targets, device=env.device)
        self.batch = per_device_batch
        self.sampler = data.TrainSampler(len(targets), global_batch, env.rank, env.world_size, args.seed)
        self.seed = args.seed

    def __len__(self):
        return len(self.sampler) // self.batch

    def __iter__(self):
        # (index, dy, dx, flip) rows for the rest of this epoch, as one tensor: the sampler's
        # indices with augmentation_plan's draws for them, as data.TrainImages crops them.
        index = self.sampler.epoch_indices()
        plan = data.augmentation_plan(self.seed, self.sampler.epoch, self.sampler.num_samples)[index]
        plan = torch.cat([index.unsqueeze(1), plan], dim=1).to(self.device)
        for start in range(0, len(plan) - self.batch + 1, self.batch):
            index, dy, dx, flip = plan[start:start + self.batch].unbind(1)
            crops = crop_flip_batch(self.padded[index], dy, dx, flip)
            yield crops, self.targets[index]


class DeviceEvalLoader:
    """This rank's shard of the test set (samples rank, rank + W, ..., as
    data.eval_loader), resident on the device, in batches of one fixed shape.

    The last batch is filled up with zero images whose target is PAD_TARGET, which
    metrics.evaluate leaves out of every sum: each sample is still counted once, and
    cudnn's algorithm choice never meets a second batch shape.
    """

    def __init__(self, test_set: data.TestImages, batch_size: int, env):
        images, targets = uint8_images(test_set.base)
        mine = slice(env.rank, len(targets), env.world_size)
        self.pixels = torch.from_numpy(images[mine]).to(env.device).permute(0, 3, 1, 2).contiguous()
        self.targets = torch.tensor(targets[mine], dtype=torch.long, device=env.device)
        self.batch = batch_size

    def __len__(self):
        return -(-len(self.targets) // self.batch)

    def __iter__(self):
        for start in range(0, len(self.targets), self.batch):
            pixels, targets = self.pixels[start:start + self.batch], self.targets[start:start + self.batch]
            missing = self.batch - len(targets)
            if missing:
                pixels = torch.cat([pixels, pixels.new_zeros((missing, *pixels.shape[1:]))])
                targets = torch.cat([targets, targets.new_full((missing,), PAD_TARGET)])
            yield pixels, targets
