"""--data-on-gpu: the training set lives in device memory and is augmented there.

CIFAR's training set is 50,000 x 3 x 32 x 32 bytes, about 150 MB as uint8: it fits
on any GPU many times over. Kept there, a training step needs no loader workers,
no host-to-device copy and no per-image Python; the crop, flip and normalisation
of a whole batch are a handful of GPU kernels.

The samples and their augmentation are exactly those of the template path
(utils/data.py): the same TrainSampler decides which indices each rank takes at
each step and the same per-epoch table gives each sample its crop offset and
flip, so the two paths produce bitwise the same batches and can be tested
against each other.
"""
import numpy as np
import torch
from torch.utils.data import Subset

from . import data


def _uint8_images(dataset) -> tuple:
    """(N x 32 x 32 x 3 uint8 array, N labels) of a data set built by data.build_datasets."""
    if isinstance(dataset, Subset):
        images, targets = _uint8_images(dataset.dataset)
        keep = np.asarray(dataset.indices)
        return images[keep], [targets[i] for i in keep]
    if isinstance(dataset, data.SyntheticCIFAR):
        return np.stack([dataset._image(i) for i in range(len(dataset))]), list(dataset.targets)
    return np.asarray(dataset.data), list(dataset.targets)  # torchvision's CIFAR100


class DeviceTrainLoader:
    """Iterates (images, targets) batches already on `device`, like the DataLoader
    built by data.train_loader, with the same `sampler.set_epoch(epoch, start_step)`."""

    def __init__(self, train_set: data.TrainImages, per_device_batch: int, global_batch: int, env, args):
        images, targets = _uint8_images(train_set.base)
        self.device = env.device
        pixels = torch.from_numpy(images).to(env.device).permute(0, 3, 1, 2)
        # Padded once for the whole run: each batch's crop is then a gather.
        self.padded = torch.nn.functional.pad(pixels, (data.PAD,) * 4).contiguous()
        self.targets = torch.tensor(targets, device=env.device)
        self.batch = per_device_batch
        self.sampler = data.TrainSampler(len(targets), global_batch, env.rank, env.world_size, args.seed)
        self.mean = torch.tensor(data.CIFAR100_MEAN, device=env.device).view(1, 3, 1, 1)
        self.std = torch.tensor(data.CIFAR100_STD, device=env.device).view(1, 3, 1, 1)

    def __len__(self):
        return len(self.sampler) // self.batch

    def __iter__(self):
        # The sampler's (index, dy, dx, flip) rows for the rest of this epoch, as one tensor.
        plan = self.sampler.epoch_plan().to(self.device)
        for start in range(0, len(plan) - self.batch + 1, self.batch):
            index, dy, dx, flip = plan[start:start + self.batch].unbind(1)
            crops = data.crop_flip_batch(self.padded[index], dy, dx, flip)
            yield (crops.float() / 255 - self.mean) / self.std, self.targets[index]
