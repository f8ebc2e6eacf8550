"""Data: CIFAR-100 through torchvision, an offline synthetic stand-in, your own data set
(`own_datasets`, `num_classes`), the per-rank training sampler and the exact evaluation sampler.

A sample's augmentation depends on (--seed, epoch, index) alone. The training sampler yields
(index, epoch) keys: our CIFAR view crops and flips as augmentation_plan drew for that epoch, and
SeededSamples, the view of any other map-style data set, seeds the random number generators from
the key before it loads the sample, so that the data set's own random transforms (torchvision's
included) draw the same numbers wherever it is loaded; left alone, they would draw from whichever
worker loads it. So a sample is augmented the same way whatever the number of processes or loader
workers, after a resume in the middle of an epoch, and on the GPU (--data-on-gpu): runs compare
across strategies, and resumes are exact.

Loader workers hand their batches over in shared memory (/dev/shm), which Docker keeps at 64 MB
unless told otherwise; a worker that finds it full dies of a bus error. At the first batch of a
run, local rank 0 compares what the run's loaders may hold there with the free space, and warns
once if it is short (warn_if_shm_short).
"""

import fcntl
import math
import os
import pickle
import random
import sys
import weakref
from contextlib import contextmanager

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler, Subset

from .cli import UsageError, error_line, print_line
from .distributed import DistEnv, all_ranks_ok
from .lifecycle import SHM_DIR, ignore_stop_signals, shm_free_bytes, start_loader_workers

NUM_CLASSES = 100
IMAGE_SHAPE = (3, 32, 32)
# Per-channel statistics of the CIFAR-100 training set (0..1 scale).
CIFAR100_MEAN = (0.5071, 0.4865, 0.4409)
CIFAR100_STD = (0.2673, 0.2564, 0.2762)
PAD = 4  # random crop with 4 pixels of zero padding, as in the ResNet paper


# --- data sets --------------------------------------------------------------------

class SyntheticCIFAR(Dataset):
    """An offline stand-in for CIFAR-100 (32x32 RGB uint8 images, 100 classes, `.targets` like
    torchvision's): a sample is its class's smooth random prototype plus pixel noise, shifted by
    a few pixels, generated on demand from its index (`_image`), so building it costs nothing.
    A CNN learns it in a few hundred steps but not instantly: loss curves and accuracies mean something."""

    def __init__(self, train: bool, size: int = None, seed: int = 1234):
        self.train = train
        self.size = size if size is not None else (50_000 if train else 10_000)
        # Low-frequency prototypes: 4x4 random colours upsampled to 40x40, so that a 32x32 window can shift.
        coarse = np.random.default_rng(seed).uniform(-1, 1, size=(NUM_CLASSES, 3, 4, 4)).astype(np.float32)
        self._prototypes = torch.nn.functional.interpolate(torch.from_numpy(coarse), size=(40, 40),
                                                           mode="bicubic", align_corners=False).numpy()
        self._noise_seed = seed + (1 if train else 2)
        self.targets = [i % NUM_CLASSES for i in range(self.size)]
        self.classes = [f"class {c}" for c in range(NUM_CLASSES)]

    def __len__(self):
        return self.size

    def _image(self, index: int) -> np.ndarray:
        rng = np.random.default_rng((self._noise_seed, index))
        dy, dx = rng.integers(0, 9, size=2)
        proto = self._prototypes[self.targets[index], :, dy:dy + 32, dx:dx + 32]
        pixels = 128 + 70 * proto + rng.normal(0, 40, size=proto.shape)
        return np.clip(pixels, 0, 255).astype(np.uint8).transpose(1, 2, 0)  # HWC like CIFAR

    def __getitem__(self, index):
        return self._image(index), self.targets[index]


class _CifarUnpickler(pickle.Unpickler):
    """Unpickles what the CIFAR files hold and nothing else (dicts, lists, strings, bytes,
    numbers, numpy arrays rebuilt from their bytes): pickle.load would import and call whatever
    a file names (a `__reduce__` that names os.system, say), so a crafted file in --data-dir could run code."""

    ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
        ("numpy.core.numeric", "_frombuffer"), ("numpy._core.numeric", "_frombuffer"),
        ("numpy", "ndarray"), ("numpy", "dtype"),
        ("_codecs", "encode"),  # how Python 3 pickles bytes with protocol 2
    }

    def find_class(self, module, name):
        if (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it names {module}.{name}, which a CIFAR file never holds")


def read_cifar_file(path: str) -> dict:
    """One file of cifar-100-python/, read safely; UsageError naming the file otherwise."""
    try:
        with open(path, "rb") as f:
            entry = _CifarUnpickler(f, encoding="latin1").load()
    except Exception as exc:  # refused global, truncated file, not a pickle at all, ...
        detail = (str(exc).splitlines() or [""])[0][:200]
        raise UsageError(f"cannot read CIFAR-100 file {path}: {type(exc).__name__}: {detail}") from None
    if not isinstance(entry, dict):
        raise UsageError(f"cannot read CIFAR-100 file {path}: it holds a {type(entry).__name__}, not a dict")
    data = entry.get("data")
    if data is not None and not (isinstance(data, np.ndarray) and data.dtype == np.uint8):
        raise UsageError(f"cannot read CIFAR-100 file {path}: its 'data' is not an array of bytes")
    return entry


def _cifar100(data_dir: str, train: bool, download: bool):
    """torchvision's CIFAR-100 (its layout, its download with the archive's md5 check), read by
    read_cifar_file and trusting files already on disk: torchvision checks every file's md5 at
    every load, which rejects any copy not byte-identical to the release (a subset, a re-pickled
    copy, the tests' small data sets). torchvision is imported here: it costs seconds that synthetic runs skip."""
    import torchvision

    base = torchvision.datasets.CIFAR100

    class CIFAR100(base):
        train_list = [[name, None] for name, _ in base.train_list]
        test_list = [[name, None] for name, _ in base.test_list]
        meta = dict(base.meta, md5=None)

        def __init__(self, root, train, download):
            torchvision.datasets.VisionDataset.__init__(self, root)
            self.train = train
            if download:
                self.download()  # torchvision's: skipped when the files are there
            folder = os.path.join(self.root, self.base_folder)
            files = [name for name, _ in (self.train_list if train else self.test_list)]
            missing = [name for name in [*files, self.meta["filename"]]
                       if not os.path.isfile(os.path.join(folder, name))]
            if missing:
                raise FileNotFoundError(f"{os.path.join(folder, missing[0])} does not exist")
            entries = [read_cifar_file(os.path.join(folder, name)) for name in files]
            try:
                self.data = np.vstack([e["data"] for e in entries]).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
                self.targets = [int(t) for e in entries for t in e["fine_labels"]]
                self.classes = read_cifar_file(os.path.join(folder, self.meta["filename"]))[self.meta["key"]]
            except (KeyError, ValueError, TypeError) as exc:
                raise UsageError(f"the CIFAR-100 files in {folder} do not have the expected layout "
                                 f"({type(exc).__name__}: {exc})") from None
            if len(self.targets) != len(self.data):
                raise UsageError(f"the CIFAR-100 files in {folder} hold {len(self.data)} images but "
                                 f"{len(self.targets)} labels")

        def __getitem__(self, index):
            return self.data[index], self.targets[index]  # as stored: no PIL image to turn back into an array

    return CIFAR100(data_dir, train=train, download=download)


@contextmanager
def _download_lock(data_dir: str):
    """One download into `data_dir` at a time, however many processes share it (the ranks of a
    node, or of several nodes on a shared file system); the others then find the files. A folder
    where no lock can be taken (read-only, holding the files already) is read without one."""
    try:
        os.makedirs(data_dir, exist_ok=True)
        fd = os.open(os.path.join(data_dir, ".download.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
    except OSError:
        yield
        return
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _load_cifar100(args):
    """CIFAR-100 from --data-dir, downloaded there if missing. Every rank learns whether every
    rank has it: one that failed alone would leave the others waiting."""
    splits = error = None
    try:
        with _download_lock(args.data_dir):
            splits = _cifar100(args.data_dir, True, download=True), _cifar100(args.data_dir, False, download=True)
    except Exception as exc:  # no network, disk full, corrupt archive, unreadable file, ...
        error = exc
    if all_ranks_ok(error is None, "data.build_datasets(), agreeing that every rank has CIFAR-100"):
        return splits
    if isinstance(error, UsageError):  # the files are there but cannot be read: say which
        raise error
    detail = f" ({type(error).__name__}: {(str(error).splitlines() or [''])[0]})" if error else ""
    raise UsageError(f"CIFAR-100 is not in --data-dir {args.data_dir} and could not be downloaded{detail}; "
                     "put cifar-100-python/ there or use --dataset synthetic for an offline run")


def _first(dataset, n, flag):
    if n is not None and n > len(dataset):
        # A silently smaller run would report figures for data it never saw.
        raise UsageError(f"{flag} {n} is more than the {len(dataset)} samples the data set has")
    return dataset if n is None or n == len(dataset) else Subset(dataset, range(n))


def build_datasets(args, env: DistEnv):
    """(train, test) data sets of (HWC uint8 image, label) pairs, cut to --train-samples/--test-samples."""
    train, test = ((SyntheticCIFAR(True, args.train_samples), SyntheticCIFAR(False, args.test_samples))
                   if args.dataset == "synthetic" else _load_cifar100(args))
    train = _first(train, args.train_samples, "--train-samples")
    test = _first(test, args.test_samples, "--test-samples")
    return TrainImages(train, args.seed), TestImages(test)


def own_datasets(args, train, test):
    """Your own (train, test) data sets for train_loader and eval_loader: any map-style data sets
    of (input, label) pairs with their own transforms, cut to --train-samples/--test-samples; the
    training set is seen through SeededSamples. What the data is ("ImageFolder") goes into
    args.dataset, which config.json and the checkpoints record and a resume must match."""
    # Refuse the flags that choose or hold our CIFAR data (build_parser(own_data=True) offers none).
    dataset = getattr(args, "dataset", None)
    if dataset not in (None, "cifar100"):  # the parser's default, when it has the flag
        raise UsageError(f"--dataset {dataset} chooses one of our CIFAR data sets; "
                         "this script trains on its own (leave --dataset out)")
    if getattr(args, "data_on_gpu", False):
        raise UsageError("--data-on-gpu holds the CIFAR images in device memory and augments "
                         "them there; it does not apply to another data set (leave it out)")
    train = _first(train, args.train_samples, "--train-samples")
    test = _first(test, args.test_samples, "--test-samples")
    args.dataset = describe(train)
    return SeededSamples(train, args.seed), test


def _inner(dataset):
    """What one of our views (.base) or torch's Subset (.dataset) looks at; None for anything else."""
    inner = getattr(dataset, "base", None)
    return inner if inner is not None else getattr(dataset, "dataset", None)


def describe(dataset) -> str:
    """The class name of the data set under our views and torch's Subset ("ImageFolder")."""
    while isinstance(inner := _inner(dataset), Dataset):
        dataset = inner
    return type(dataset).__name__


def num_classes(dataset) -> int:
    """The length of the `classes` list that torchvision's data sets and ours carry, looked for
    through views and subsets."""
    seen = innermost = dataset
    while seen is not None:
        if hasattr(seen, "classes"):
            return len(seen.classes)
        innermost, seen = seen, _inner(seen)
    raise UsageError(f"cannot tell how many classes {type(innermost).__name__} has: give it a "
                     "`classes` list (as torchvision's data sets have), or pass the number to the model")


def _to_uint8_chw(image) -> torch.Tensor:
    if not isinstance(image, np.ndarray):  # a PIL image from another torchvision data set
        image = np.array(image)  # a writable copy: np.asarray of a PIL image is read-only
    return torch.from_numpy(np.ascontiguousarray(image)).permute(2, 0, 1)


def _normalize(pixels: torch.Tensor) -> torch.Tensor:
    mean, std = (torch.tensor(stats).view(3, 1, 1) for stats in (CIFAR100_MEAN, CIFAR100_STD))
    return (pixels.float() / 255 - mean) / std


def crop_flip(pixels: torch.Tensor, dy: int, dx: int, flip: int) -> torch.Tensor:
    """One CHW uint8 image: crop 32x32 at (dy, dx) of the zero-padded image, flip if asked."""
    crop = torch.nn.functional.pad(pixels, (PAD, PAD, PAD, PAD))[:, dy:dy + 32, dx:dx + 32]
    return crop.flip(2) if flip else crop


def crop_flip_batch(padded: torch.Tensor, dy, dx, flip) -> torch.Tensor:
    """The same for a batch of already padded B x C x 40 x 40 images (two gathers and a
    select, on whatever device they live): bitwise what crop_flip gives image by image."""
    b, c = padded.shape[:2]
    window = torch.arange(32, device=padded.device)
    rows = (dy.view(b, 1) + window).view(b, 1, 32, 1).expand(b, c, 32, padded.shape[3])
    cols = (dx.view(b, 1) + window).view(b, 1, 1, 32).expand(b, c, 32, 32)
    out = padded.gather(2, rows).gather(3, cols)
    return torch.where(flip.view(b, 1, 1, 1).bool(), out.flip(3), out)


def augmentation_plan(seed: int, epoch: int, num_samples: int) -> torch.Tensor:
    """num_samples x 3 int64: crop offsets dy, dx in 0..8 and flip in {0, 1} for every
    sample index, drawn from (seed, epoch) only."""
    g = torch.Generator().manual_seed((seed * 1_000_003 + epoch) & 0x7FFF_FFFF_FFFF_FFFF)
    shifts = torch.randint(0, 2 * PAD + 1, (num_samples, 2), generator=g)
    flips = torch.randint(0, 2, (num_samples, 1), generator=g)
    return torch.cat([shifts, flips], dim=1)


class _View(Dataset):
    """`base` seen another way, sample by sample (describe and num_classes look through it)."""

    def __init__(self, base, seed: int = None):
        self.base, self.seed = base, seed

    def __len__(self):
        return len(self.base)


class TrainImages(_View):
    """Training view of our CIFAR data: (index, epoch) keys from TrainSampler, each
    image cropped and flipped as augmentation_plan(seed, epoch) says for its index."""

    takes_sample_keys = True  # train_loader hands it (index, epoch), not a bare index
    _plan_epoch, _plan = None, None  # one epoch's plan, drawn once per process

    def plan(self, epoch: int) -> torch.Tensor:
        if self._plan_epoch != epoch:
            self._plan, self._plan_epoch = augmentation_plan(self.seed, epoch, len(self.base)), epoch
        return self._plan

    def __getitem__(self, key):
        index, epoch = key
        dy, dx, flip = self.plan(epoch)[index].tolist()
        image, target = self.base[index]
        return _normalize(crop_flip(_to_uint8_chw(image), dy, dx, flip)), target


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """A 64-bit seed for one sample in one epoch, from (seed, epoch, index) alone: the three
    mixed, then splitmix64's finaliser, so that neighbouring indices or epochs get unrelated seeds."""
    mask = 2**64 - 1
    x = (seed * 0x9E3779B97F4A7C15 + (epoch + 1) * 0xD1B54A32D192ED03 + index * 0xABC98388FB8FAC03) & mask
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
    return x ^ (x >> 31)


class SeededSamples(_View):
    """Training view of any map-style data set: key (index, epoch) loads `base[index]` with torch's
    CPU generator, Python's `random` and NumPy's global generator seeded by sample_seed(seed, epoch,
    index), so that the data set's own random transforms (torchvision's RandomResizedCrop, its flips,
    ...) draw the same numbers for that sample in that epoch wherever it is loaded. The generators are
    put back afterwards, so that loading in the training process itself (--workers 0) leaves the
    training's random numbers alone. Data transforms run on the CPU: the CUDA generators are not touched."""

    takes_sample_keys = True

    def __getitem__(self, key):
        index, epoch = key
        seed = sample_seed(self.seed, epoch, index)
        torch_state, python_state, numpy_state = torch.get_rng_state(), random.getstate(), np.random.get_state()
        try:
            torch.default_generator.manual_seed(seed)
            random.seed(seed)
            np.random.seed(seed & 0xFFFF_FFFF)  # NumPy's legacy seed is 32-bit
            return self.base[index]
        finally:
            torch.set_rng_state(torch_state)
            random.setstate(python_state)
            np.random.set_state(numpy_state)


class TestImages(_View):
    """Evaluation view: no augmentation."""

    def __getitem__(self, index):
        image, target = self.base[index]
        return _normalize(_to_uint8_chw(image)), target


# --- samplers ----------------------------------------------------------------------

def steps_per_epoch(num_samples: int, global_batch: int) -> int:
    """Optimizer steps per epoch: whole global batches only, so every step sees exactly
    --batch-size images (the permutation's remainder, a different one each epoch, is dropped)."""
    return num_samples // global_batch


class TrainSampler(Sampler):
    """DistributedSampler's semantics (one permutation per epoch from seed + epoch, rank r takes
    positions r, r+W, r+2W, ...) plus what exact resume needs. Step s of the epoch uses positions
    [s*B, (s+1)*B) of the permutation, the global batch B split over the ranks, so N processes see
    exactly the samples that one process sees. Yields (index, epoch) keys: the sample, and the epoch
    its augmentation is drawn for (see TrainImages, SeededSamples)."""

    def __init__(self, num_samples: int, global_batch: int, rank: int, world_size: int, seed: int):
        if steps_per_epoch(num_samples, global_batch) == 0:
            raise UsageError(f"the training set has {num_samples} samples, fewer than one global "
                             f"batch of {global_batch}: lower --batch-size or raise --train-samples")
        self.num_samples, self.global_batch = num_samples, global_batch
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.set_epoch(0)

    def set_epoch(self, epoch: int, start_step: int = 0):
        """Call before every epoch, as with DistributedSampler, or every epoch repeats epoch 0's order.
        start_step skips the steps a resumed epoch has taken, without loading their images."""
        self.epoch, self.start_step = epoch, start_step
        self.skip = 0  # further samples of this rank to skip (a loader restarted mid-epoch)

    def _per_rank(self) -> int:
        return steps_per_epoch(self.num_samples, self.global_batch) * self.global_batch // self.world_size

    def _start(self) -> int:
        return self.start_step * self.global_batch // self.world_size + self.skip

    def __len__(self):
        return self._per_rank() - self._start()

    def epoch_indices(self) -> torch.Tensor:
        """This rank's remaining sample indices of the epoch, in order."""
        g = torch.Generator().manual_seed((self.seed + self.epoch) % 2**64)  # seeds are 64-bit
        mine = torch.randperm(self.num_samples, generator=g)[self.rank::self.world_size][:self._per_rank()]
        return mine[self._start():]

    def __iter__(self):
        return iter([(index, self.epoch) for index in self.epoch_indices().tolist()])


class ShardSampler(Sampler):
    """Evaluation: rank r takes samples r, r+W, r+2W, ... and nothing else. DistributedSampler pads
    the last shard with repeated samples, which the accuracy would count twice; here shards differ
    in length by at most one, each sample counts once, and evaluate() all-reduces sums and counts."""

    def __init__(self, num_samples: int, rank: int, world_size: int):
        self.indices = range(rank, num_samples, world_size)

    def __len__(self):
        return len(self.indices)

    def __iter__(self):
        return iter(self.indices)


# --- loaders -----------------------------------------------------------------------

def _worker_init(_):
    # Stop signals reach the workers too (sent to the process group or job step): their rank
    # decides when to stop, see utils/lifecycle.py. One thread per worker process: no oversubscription.
    ignore_stop_signals()
    torch.set_num_threads(1)


def loader_workers(args, env: DistEnv) -> int:
    """--workers, or what this node can feed: the smaller of 4 and its CPU cores per process (at
    least 1). More workers than cores only add processes that wait for a core (and PyTorch's warning)."""
    if args.workers is not None:
        return args.workers
    try:
        cores = len(os.sched_getaffinity(0))  # the cores this process may use (containers, taskset)
    except AttributeError:  # macOS
        cores = os.cpu_count() or 1
    return max(1, min(4, cores // max(1, env.local_world_size)))


class Loader(DataLoader):
    """A DataLoader whose workers are forked, and started early (`start_workers`) as utils/lifecycle.py's
    start_loader_workers starts them (stop signals blocked, killed at exit). Given `env`, the first batch
    of a run's first loader checks the shared memory for all of them: warn_if_shm_short."""

    def __init__(self, *args, env: DistEnv = None, purpose: str = "loader", **kwargs):
        super().__init__(*args, **kwargs)
        if self.num_workers and self.multiprocessing_context is None and sys.platform == "linux":
            # Forked, whatever started this process. DataLoader's default is the process's start method:
            # "spawn" in a process that mp.spawn started ("forkserver" on Linux from Python 3.14), every
            # worker a new interpreter importing PyTorch again for work that never touches the GPU
            # (measured, one worker under mp.spawn: 1.1 s to the first batch and 283 MB of its own memory
            # spawned; 0.05 s and 15 MB forked). Ask for another with multiprocessing_context.
            self.multiprocessing_context = "fork"
        self.env, self.purpose = env, purpose
        if env is not None and env.local_rank == 0 and self.num_workers:  # once per node
            _shm_unchecked.add(self)

    def start_workers(self):
        """Fork the persistent workers now, before the model's first collective (DDP's broadcast),
        not at the first batch. After a collective a thread of the process group may still let go
        of the tensor it carried, taking the GIL; Python 3.11.9 and older (CPython gh-112275, fixed
        in 3.11.10 and 3.12) can leave a child forked at that instant waiting forever on the
        thread-state lock: a worker that never starts. The batches prefetched early are dropped at
        the first iteration. Workers started by exec ("spawn", "forkserver") start at the first batch."""
        if not (self.num_workers and self.persistent_workers):
            return
        # Without a context (not on Linux), DataLoader uses torch.multiprocessing's start method.
        if (self.multiprocessing_context or torch.multiprocessing).get_start_method() == "fork":
            # A new iterator draws its workers' base seed from PyTorch's global generator: put it back,
            # so that the model is initialised as with --workers 0 (samples are seeded on their own).
            with torch.random.fork_rng(devices=[]):
                self._batches()  # DataLoader keeps a persistent-worker iterator for the next iter()

    def _batches(self):
        return start_loader_workers(super().__iter__) if self.num_workers else super().__iter__()

    def __iter__(self):
        batches = self._batches()
        return self._check_shm_at_first_batch(batches) if self in _shm_unchecked else batches

    def _check_shm_at_first_batch(self, batches):
        # At the first batch, when the script has built all its loaders, the sample size measured on
        # what a worker delivered: loading a sample here, in the training process, would open what a
        # user's data set opens on first access (an HDF5 file, say) before the workers fork and share it.
        for batch in batches:
            siblings = sorted((loader for loader in list(_shm_unchecked) if loader.env is self.env),
                              key=lambda loader: loader.purpose != "training")  # training first
            _shm_unchecked.difference_update(siblings)
            warn_if_shm_short(siblings, self.env, batch_sample_bytes(batch))
            yield batch
            break
        yield from batches


def _loader(dataset, sampler, batch_size: int, env: DistEnv, args, purpose: str) -> Loader:
    workers = loader_workers(args, env)
    # Pinned (page-locked) host memory lets the copy to the device run asynchronously
    # (non_blocking=True); Apple's MPS shares memory with the CPU and has nothing to pin.
    loader = Loader(dataset, batch_size=batch_size, sampler=sampler, num_workers=workers,
                    pin_memory=env.device.type not in ("cpu", "mps"), persistent_workers=workers > 0,
                    worker_init_fn=_worker_init, env=env, purpose=purpose)
    loader.start_workers()  # both loaders' before the model's first collective: see Loader.start_workers
    return loader


def train_loader(train_set, per_device_batch: int, global_batch: int, env: DistEnv, args) -> DataLoader:
    """The training loader: whole global batches split over the ranks (TrainSampler). `train_set` is a
    view from build_datasets or own_datasets; any other map-style data set is seen through SeededSamples."""
    if not getattr(train_set, "takes_sample_keys", False):
        train_set = SeededSamples(train_set, args.seed)
    sampler = TrainSampler(len(train_set), global_batch, env.rank, env.world_size, args.seed)
    return _loader(train_set, sampler, per_device_batch, env, args, "training")


def eval_loader(test_set, batch_size: int, env: DistEnv, args) -> DataLoader:
    return _loader(test_set, ShardSampler(len(test_set), env.rank, env.world_size), batch_size, env, args, "evaluation")


# --- shared memory -------------------------------------------------------------------

_shm_unchecked = weakref.WeakSet()  # loaders with workers whose shared memory is not checked yet


def shm_bytes(workers: int, prefetch_factor: int, batch_size: int, sample_bytes: int) -> int:
    """Shared memory one process's loader may hold at once: each worker keeps up to prefetch_factor
    batches (DataLoader's default: 2) ready for its process. Also the formula of scripts/preflight.py."""
    return workers * prefetch_factor * batch_size * sample_bytes


def shm_size_gib(need: int) -> int:
    """The --shm-size (GiB) to suggest for `need` bytes, with room for the training process's own shared tensors."""
    return max(1, math.ceil(need * 1.5 / 2**30))


def _tensor_bytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.nbytes
    if isinstance(value, (list, tuple, dict)):
        return sum(_tensor_bytes(v) for v in (value.values() if isinstance(value, dict) else value))
    return 0  # strings and other objects travel pickled, not in shared memory


def batch_sample_bytes(batch) -> int:
    """Bytes of one sample as the workers hand it over: the batch's tensors (labels included) over
    its length, measured rather than assumed, so that data of other shapes or types counts right."""
    first = batch
    while isinstance(first, (list, tuple, dict)) and len(first):
        first = next(iter(first.values())) if isinstance(first, dict) else first[0]
    length = first.shape[0] if isinstance(first, torch.Tensor) and first.dim() else 1
    return math.ceil(_tensor_bytes(batch) / max(length, 1))


def shm_estimate(loaders, local_world_size: int, sample_bytes: int):
    """(bytes, formula): the shared memory that `loaders` (one process's) and their like in the other
    processes of this node, which share its /dev/shm, may hold at once, for samples of `sample_bytes`
    (a training sample's; an evaluation sample, cropped and flipped images of the same size, is taken to
    be as large). Their sum, not the largest: both loaders keep their workers between epochs, and a
    training epoch cut short (--max-steps, a stop signal) leaves its prefetched batches in shared memory
    until the next epoch starts, while evaluation fills its own."""
    terms = [(loader.purpose, loader.num_workers, loader.prefetch_factor, loader.batch_size,
              sample_bytes) for loader in loaders if loader.num_workers]
    need = sum(shm_bytes(*term[1:]) for term in terms) * local_world_size
    formula = " + ".join(f"{purpose} {workers} worker{'s' if workers != 1 else ''} x {prefetch} prefetched batches "
                         f"x {batch} samples x {nbytes:,} B" for purpose, workers, prefetch, batch, nbytes in terms)
    processes = f"{local_world_size} process{'es' if local_world_size != 1 else ''}"
    return need, f"({formula}) x {processes} on this node"


def shm_dir() -> str:
    # TRAIN_SHM_DIR: check another folder instead. The workers themselves always use
    # /dev/shm (shm_open); the tests point it at a small tmpfs of their own.
    return os.environ.get("TRAIN_SHM_DIR") or SHM_DIR


def warn_if_shm_short(loaders, env: DistEnv, sample_bytes: int):
    """One warning on stderr when the shared-memory folder has less free space than `loaders` may
    hold (shm_estimate). Training goes on: the estimate is an upper bound."""
    path = shm_dir()
    free = shm_free_bytes(path)
    if free is None or not any(loader.num_workers for loader in loaders):
        return  # no such folder (not Linux), or nothing goes through it
    need, formula = shm_estimate(loaders, env.local_world_size, sample_bytes)
    if need <= free:
        return
    print_line(error_line(
        f"{path} has {free / 2**20:,.1f} MiB free, less than the {need / 2**20:,.1f} MiB that the "
        f"DataLoader workers of this node may hold there at once: {formula}. A worker that finds it full "
        f"dies of a bus error. In Docker: docker run --ipc=host (or --shm-size={shm_size_gib(need)}g); "
        "otherwise lower --workers or --batch-size. Training goes on: the estimate is an upper bound, "
        "the run may still fit.", kind="warning"))
