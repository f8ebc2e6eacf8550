"""Data: CIFAR-100 through torchvision, an offline synthetic stand-in, your own data set
(`own_datasets`, `num_classes`), the per-rank training sampler and the exact evaluation sampler.

A sample's augmentation depends on (--seed, epoch, index) alone, not on the loader worker that loads
it (TrainImages, SeededSamples): so runs compare across strategies and numbers of processes or
workers, resumes in the middle of an epoch are exact, and --data-on-gpu augments as the loader does."""
import contextlib
import fcntl
import os
import pathlib
import pickle
import random
import sys

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler, Subset

from .cli import UsageError, first_line
from .distributed import DistEnv, all_ranks_ok
from .lifecycle import ignore_stop_signals, start_loader_workers

NUM_CLASSES = 100
CIFAR100_MEAN = (0.5071, 0.4865, 0.4409)  # per channel, of the training set (0..1 scale)
CIFAR100_STD = (0.2673, 0.2564, 0.2762)
PAD = 4  # random crop with 4 pixels of zero padding, as in the ResNet paper
CGROUP = "/sys/fs/cgroup"  # where cpu_limits reads a container's CPU limit


# --- data sets --------------------------------------------------------------------

class SyntheticCIFAR(Dataset):
    """An offline stand-in for CIFAR-100 (32x32 RGB uint8, 100 classes), made on demand from the index: a
    class prototype plus noise, shifted. A CNN learns it in hundreds of steps, so its loss curves mean something."""

    def __init__(self, train: bool, size: int = None, seed: int = 1234):
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

    def __getitem__(self, index):
        rng = np.random.default_rng((self._noise_seed, index))
        dy, dx = rng.integers(0, 9, size=2)
        proto = self._prototypes[self.targets[index], :, dy:dy + 32, dx:dx + 32]
        pixels = 128 + 70 * proto + rng.normal(0, 40, size=proto.shape)
        return np.clip(pixels, 0, 255).astype(np.uint8).transpose(1, 2, 0), self.targets[index]  # HWC like CIFAR


class _CifarUnpickler(pickle.Unpickler):
    """Unpickles what the CIFAR files hold (dicts, lists, strings, bytes, numbers, numpy arrays) and
    nothing else: pickle.load would call whatever a file names (os.system, say) and run a crafted file."""

    ALLOWED = {("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
               ("numpy.core.numeric", "_frombuffer"), ("numpy._core.numeric", "_frombuffer"),
               ("numpy", "ndarray"), ("numpy", "dtype"), ("_codecs", "encode")}  # _codecs: bytes, protocol 2

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
        raise UsageError(f"cannot read CIFAR-100 file {path}: {first_line(exc, typed=True)}") from None
    if not isinstance(entry, dict):
        raise UsageError(f"cannot read CIFAR-100 file {path}: it holds a {type(entry).__name__}, not a dict")
    if (data := entry.get("data")) is not None and not (isinstance(data, np.ndarray) and data.dtype == np.uint8):
        raise UsageError(f"cannot read CIFAR-100 file {path}: its 'data' is not an array of bytes")
    return entry


class CIFAR100(Dataset):
    """CIFAR-100's images (N, 32, 32, 3 uint8), labels and class names. A class of the module, not of a function:
    loader workers started by spawn (not Linux's fork: Loader) are sent it pickled, found by module and name."""

    def __init__(self, data: np.ndarray, targets: list, classes: list):
        self.data, self.targets, self.classes = data, targets, classes

    def __len__(self):
        return len(self.data)

    def __getitem__(self, index):
        return self.data[index], self.targets[index]


def _cifar100(data_dir: str, train: bool) -> CIFAR100:
    """CIFAR-100 in torchvision's layout, downloaded by torchvision (the archive's md5 checked) if a file is missing.
    Files on disk are trusted: torchvision's data set checks every file's md5 at every load, which rejects any copy
    but the release (a subset, the tests' data). Imported here: seconds that synthetic runs skip."""
    from torchvision.datasets import cifar
    release = cifar.CIFAR100
    root = os.path.expanduser(data_dir)  # as torchvision's: --data-dir=~/data reaches the program unexpanded
    folder = os.path.join(root, release.base_folder)
    # The download alone: the ranks of a node then read the files at once. (Any file missing: the archive, as
    # torchvision's download does; a missing meta then says so below.)
    with _download_lock(root) as lock:
        if not all(os.path.isfile(os.path.join(folder, name)) for name, _ in release.train_list + release.test_list):
            if isinstance(lock, OSError):  # every process would download
                raise UsageError(f"CIFAR-100 is not in --data-dir {data_dir}, and no lock can be taken there "
                                 f"({lock.strerror or lock}) to download it once: put cifar-100-python/ there")
            cifar.download_and_extract_archive(release.url, root, filename=release.filename, md5=release.tgz_md5)
    entries = [read_cifar_file(os.path.join(folder, name)) for name, _ in
               (release.train_list if train else release.test_list)]
    try:
        data = np.vstack([e["data"] for e in entries]).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
        targets = [int(t) for e in entries for t in e["fine_labels"]]
        classes = read_cifar_file(os.path.join(folder, release.meta["filename"]))[release.meta["key"]]
    except (KeyError, ValueError, TypeError) as exc:
        raise UsageError(f"the CIFAR-100 files in {folder} do not have the expected layout "
                         f"({type(exc).__name__}: {exc})") from None
    if len(targets) != len(data):
        raise UsageError(f"the CIFAR-100 files in {folder} hold {len(data)} images but {len(targets)} labels")
    return CIFAR100(data, targets, classes)


def _download_lock(data_dir: str):
    """One download into `data_dir` at a time, however many processes (or nodes) share it; the others then find the
    files. A folder where no lock can be taken (read-only; no file locks: NFS without its lock daemon, ENOLCK; Lustre
    mounted noflock, ENOSYS) is read without one: the context is the OSError, and nothing may be downloaded there."""
    lock = None
    try:
        os.makedirs(data_dir, exist_ok=True)
        lock = open(os.path.join(data_dir, ".download.lock"), "a")
        fcntl.lockf(lock, fcntl.LOCK_EX)
        return lock  # leaving its `with` closes the file, which releases the lock
    except OSError as exc:
        if lock is not None:
            lock.close()
        return contextlib.nullcontext(exc)


def _load_cifar100(args):
    """CIFAR-100 from --data-dir, downloaded there if missing. Every rank learns whether every
    rank has it: one that failed alone would leave the others waiting."""
    splits = error = None
    try:
        splits = _cifar100(args.data_dir, True), _cifar100(args.data_dir, False)
    except Exception as exc:  # no network, disk full, corrupt archive, unreadable file, ...
        error = exc
    if all_ranks_ok(error is None, "data.build_datasets(), agreeing that every rank has CIFAR-100"):
        return splits
    if error is None:  # each node may have a --data-dir of its own: rank 0's may be fine
        raise UsageError("CIFAR-100 could not be loaded on another rank (its node says why)")
    if isinstance(error, ImportError):  # torchvision, which reads (and downloads) CIFAR-100, is not installed
        error = UsageError(f"--dataset cifar100 needs torchvision ({first_line(error, typed=True)}): pip install "
                           "torchvision, or use --dataset synthetic")
    elif not isinstance(error, UsageError):  # a UsageError: the files are there but cannot be read, it says which
        error = UsageError(f"CIFAR-100 is not in --data-dir {args.data_dir} and could not be downloaded "
                           f"({first_line(error, typed=True)}); put "
                           "cifar-100-python/ there or use --dataset synthetic for an offline run")
    error.met_by = "node"  # printed on the node that failed, not only by rank 0
    raise error


def _first(dataset, args, split: str):
    n = getattr(args, f"{split}_samples")  # --train-samples, --test-samples
    if n is not None and n > len(dataset):  # a silently smaller run would report figures for data it never saw
        raise UsageError(f"--{split}-samples {n} is more than the {len(dataset)} samples the data set has")
    return dataset if n is None or n == len(dataset) else Subset(dataset, range(n))


def build_datasets(args, env: DistEnv):
    """(train, test) data sets of (HWC uint8 image, label) pairs, cut to --train-samples/--test-samples."""
    train, test = ((SyntheticCIFAR(True, args.train_samples), SyntheticCIFAR(False, args.test_samples))
                   if args.dataset == "synthetic" else _load_cifar100(args))
    train, test = _first(train, args, "train"), _first(test, args, "test")
    return TrainImages(train, args.seed), TestImages(test)


def own_datasets(args, train, test):
    """Your own (train, test) map-style data sets of (input, label) pairs, with their own transforms,
    cut like ours. Their class ("ImageFolder") goes into args.dataset, which a resume must match."""
    dataset = getattr(args, "dataset", None)  # flags for our CIFAR data are refused (own_data parsers lack them)
    if dataset not in (None, "cifar100"):  # the parser's default, when it has the flag
        raise UsageError(f"--dataset {dataset} chooses one of our CIFAR data sets; "
                         "this script trains on its own (leave --dataset out)")
    if getattr(args, "data_on_gpu", False):
        raise UsageError("--data-on-gpu holds the CIFAR images in device memory and augments "
                         "them there; it does not apply to another data set (leave it out)")
    train, test = _first(train, args, "train"), _first(test, args, "test")
    inner = train  # args.dataset names the class under our views and torch's Subset
    while isinstance(deeper := _inner(inner), Dataset):
        inner = deeper
    args.dataset = type(inner).__name__
    return SeededSamples(train, args.seed), test


def _inner(dataset):
    """What one of our views (.base) or torch's Subset (.dataset) looks at; None for anything else."""
    inner = getattr(dataset, "base", None)
    return inner if inner is not None else getattr(dataset, "dataset", None)


def num_classes(dataset) -> int:
    """The length of the `classes` list that torchvision's data sets and ours carry, under views and subsets."""
    while not hasattr(dataset, "classes"):
        if (inner := _inner(dataset)) is None:
            raise UsageError(f"cannot tell how many classes {type(dataset).__name__} has: give it a "
                             "`classes` list (as torchvision's data sets have), or pass the number to the model")
        dataset = inner
    return len(dataset.classes)


class Normalize:
    """uint8 N x 3 x H x W images -> on `device`, normalised by table lookup: bitwise the CPU's (pixels / 255 - mean) /
    std on any device (on a GPU the formula is not: CUDA divides by a constant as a multiply by its reciprocal, one ulp
    off for about half the bytes). In `dtype` (autocast's, rounded once as its cast at the first convolution would;
    None: float32) and `memory_format`: the lookup is laid out like its index, made dense in that layout from bytes, so
    the model's input needs no copy afterwards."""

    def __init__(self, device, dtype=None, memory_format=torch.contiguous_format):
        self.device, self.memory_format = torch.device(device), memory_format
        every_byte = torch.arange(256, dtype=torch.uint8).expand(3, 1, 256)  # channel c's values at c * 256 on
        mean, std = (torch.tensor(stats).view(3, 1, 1) for stats in (CIFAR100_MEAN, CIFAR100_STD))
        self.table = ((every_byte.float() / 255 - mean) / std).reshape(-1).to(self.device, dtype or torch.float32)
        self.offsets = torch.arange(3, device=self.device).view(1, 3, 1, 1) * 256  # channel c's start

    def __call__(self, pixels: torch.Tensor) -> torch.Tensor:
        pixels = pixels.to(self.device, non_blocking=True)  # from pinned memory: no wait for the copy
        return self.table[pixels.contiguous(memory_format=self.memory_format).long() + self.offsets]


def memory_format(args, device) -> torch.memory_format:
    """--(no-)channels-last, else NHWC on NVIDIA GPUs of compute capability 8.0+ (not ROCm's: unmeasured), whose
    tensor-core convolutions read NHWC. The choice is kept in args, as config.json records it."""
    if args.channels_last is None:
        args.channels_last = (device.type == "cuda" and not torch.version.hip
                              and torch.cuda.get_device_capability(device) >= (8, 0))
    return torch.channels_last if args.channels_last else torch.contiguous_format


def model_inputs(dataset, device, memory_format=torch.contiguous_format, dtype=None):
    """What makes a batch of `dataset`'s images the model's input on `device`: Normalize there for our CIFAR views'
    uint8 (a quarter of float32's bytes through shared memory and to the device); any other's batches as loaded."""
    if isinstance(dataset, (TrainImages, TestImages)):
        return Normalize(device, dtype, memory_format)
    return lambda images: images.to(device, non_blocking=True, memory_format=memory_format)


def crop_flip(pixels: torch.Tensor, dy: int, dx: int, flip: int) -> torch.Tensor:
    """One CHW uint8 image: crop 32x32 at (dy, dx) of the zero-padded image, flip if asked."""
    crop = torch.nn.functional.pad(pixels, (PAD, PAD, PAD, PAD))[:, dy:dy + 32, dx:dx + 32]
    return crop.flip(2) if flip else crop


def augmentation_plan(seed: int, epoch: int, num_samples: int) -> torch.Tensor:
    """num_samples x 3 int64 from (seed, epoch) only: crop offsets dy, dx in 0..8, flip in {0, 1}."""
    g = torch.Generator().manual_seed((seed * 1_000_003 + epoch) & 0x7FFF_FFFF_FFFF_FFFF)
    shifts = torch.randint(0, 2 * PAD + 1, (num_samples, 2), generator=g)
    flips = torch.randint(0, 2, (num_samples, 1), generator=g)
    return torch.cat([shifts, flips], dim=1)


class _View(Dataset):
    """`base` seen another way, sample by sample (own_datasets and num_classes look through it)."""

    def __init__(self, base, seed: int = None):
        self.base, self.seed = base, seed

    def __len__(self):
        return len(self.base)


class TrainImages(_View):
    """Training view of our CIFAR data: key (index, epoch) crops and flips as augmentation_plan says,
    uint8 CHW (model_inputs normalises a batch on the device)."""

    _plan_epoch = None

    def __getitem__(self, key):
        index, epoch = key
        if self._plan_epoch != epoch:  # one epoch's plan, drawn once per process
            self._plan, self._plan_epoch = augmentation_plan(self.seed, epoch, len(self.base)), epoch
        dy, dx, flip = self._plan[index].tolist()
        image, target = self.base[index]
        return crop_flip(torch.from_numpy(image).permute(2, 0, 1), dy, dx, flip), target  # CHW, as TestImages


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """A 64-bit seed from (seed, epoch, index), through splitmix64's finaliser: neighbours get unrelated seeds."""
    mask = 2**64 - 1
    x = (seed * 0x9E3779B97F4A7C15 + (epoch + 1) * 0xD1B54A32D192ED03 + index * 0xABC98388FB8FAC03) & mask
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
    return x ^ (x >> 31)


class SeededSamples(_View):
    """Training view of any data set: key (index, epoch) loads `base[index]` with the global generators (torch CPU,
    Python, NumPy) seeded by sample_seed for its transforms, then restored: with --workers 0 they are the training's."""

    def __getitem__(self, key):
        index, epoch = key
        seed = sample_seed(self.seed, epoch, index)
        torch_state, python_state, numpy_state = torch.get_rng_state(), random.getstate(), np.random.get_state()
        try:
            torch.default_generator.manual_seed(seed)
            random.seed(seed)
            np.random.seed([seed & 0xFFFF_FFFF, seed >> 32])  # an int must fit in 32 bits; a list carries all 64
            return self.base[index]
        finally:
            torch.set_rng_state(torch_state)
            random.setstate(python_state)
            np.random.set_state(numpy_state)


class TestImages(_View):
    """Evaluation view: no augmentation; uint8 CHW, normalised on the device like TrainImages'."""

    def __getitem__(self, index):
        image, target = self.base[index]
        return torch.from_numpy(image).permute(2, 0, 1), target  # HWC views of CHW bytes: dense again, no copy


# --- samplers ----------------------------------------------------------------------

def steps_per_epoch(num_samples: int, global_batch: int) -> int:
    """Whole global batches only: every step sees --batch-size images (the remainder changes each epoch)."""
    return num_samples // global_batch


class TrainSampler(Sampler):
    """DistributedSampler's semantics (a permutation per epoch from seed + epoch, rank r takes positions
    r, r+W, ...) plus exact resume. Step s takes positions [s*B, (s+1)*B) for global batch B, so N
    processes see what one does. Yields (index, epoch): the sample and its augmentation's epoch."""

    def __init__(self, num_samples: int, global_batch: int, rank: int, world_size: int, seed: int):
        if (steps := steps_per_epoch(num_samples, global_batch)) == 0:
            raise UsageError(f"the training set has {num_samples} samples, fewer than one global "
                             f"batch of {global_batch}: lower --batch-size or raise --train-samples")
        self.num_samples, self.global_batch = num_samples, global_batch
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self._per_rank = steps * global_batch // world_size  # this rank's samples of a whole epoch
        self.set_epoch(0)

    def set_epoch(self, epoch: int, start_step: int = 0):
        """Call before every epoch, as with DistributedSampler; start_step skips steps already taken."""
        self.epoch, self._start = epoch, start_step * self.global_batch // self.world_size  # this rank's samples taken

    def __len__(self):
        return self._per_rank - self._start

    def epoch_indices(self) -> torch.Tensor:
        """This rank's remaining sample indices of the epoch, in order."""
        g = torch.Generator().manual_seed((self.seed + self.epoch) % 2**64)  # seeds are 64-bit
        return torch.randperm(self.num_samples, generator=g)[self.rank::self.world_size][self._start:self._per_rank]

    def __iter__(self):
        return iter([(index, self.epoch) for index in self.epoch_indices().tolist()])


# --- loaders -----------------------------------------------------------------------

def cpu_limits() -> tuple:
    """(the cores in this process's affinity mask: taskset, Slurm; a container's CPU limit, or None). docker --cpus
    and Kubernetes' limits set a cgroup quota, which neither the mask nor os.cpu_count() shows; a container sees
    its own cgroup at CGROUP (v2's cpu.max, else v1's). macOS has no sched_getaffinity."""
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = None
    with contextlib.suppress(OSError, ValueError):  # "max 100000": no limit (a ValueError)
        limit, period = pathlib.Path(CGROUP, "cpu.max").read_text().split()[:2]
        quota = int(limit) / int(period)
    with contextlib.suppress(OSError, ValueError):  # -1: no limit
        if quota is None and (limit := int(pathlib.Path(CGROUP, "cpu/cpu.cfs_quota_us").read_text())) > 0:
            quota = limit / int(pathlib.Path(CGROUP, "cpu/cpu.cfs_period_us").read_text())
    return affinity, quota


def loader_workers(args, env: DistEnv) -> int:
    """--workers, or min(4, CPU cores per process), at least 1: more would only wait for a core. The choice is
    kept in args, as config.json records it."""
    if args.workers is None:
        affinity, quota = cpu_limits()
        args.workers = max(1, min(4, int(min(affinity, quota or affinity) // max(1, env.local_world_size))))
    return args.workers


class Loader(DataLoader):
    """A DataLoader whose workers are forked early (start_workers) by lifecycle.start_loader_workers."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.num_workers and self.multiprocessing_context is None and sys.platform == "linux":
            # DataLoader's default, the process's start method, is "spawn" under mp.spawn ("forkserver" from
            # Python 3.14): each worker a new interpreter importing PyTorch for work that never touches the GPU.
            self.multiprocessing_context = "fork"

    def start_workers(self):
        """Fork the persistent workers now, before the model's first collective (DDP's broadcast). After a
        collective a process-group thread may hold the interpreter's lock on its thread states, and Python
        3.11.9 and older (CPython gh-112275) leave a child forked then waiting for it: a worker that never starts."""
        context = self.multiprocessing_context or torch.multiprocessing  # DataLoader's, with no context
        if self.num_workers and self.persistent_workers and context.get_start_method() == "fork":
            # DataLoader keeps a persistent-worker iterator for the next iter(), which discards what this one
            # prefetched: it prefetches from no samples (its batch sampler reads `sampler` when it first runs).
            sampler, self.batch_sampler.sampler = self.batch_sampler.sampler, ()
            try:
                iter(self)
            finally:
                self.batch_sampler.sampler = sampler

    def __iter__(self):
        # A new iterator draws its workers' base seed from the global generator, with no workers too: put back, the
        # training's own draws (dropout) do not depend on it, and continue exactly after a resume's restore.
        with torch.random.fork_rng(devices=[]):
            return start_loader_workers(super().__iter__) if self.num_workers else super().__iter__()


def _loader(dataset, sampler, batch_size: int, env: DistEnv, args) -> Loader:
    workers = loader_workers(args, env)
    # Pinned memory lets the copy to the device run asynchronously; MPS shares memory with the CPU.
    loader = Loader(dataset, batch_size=batch_size, sampler=sampler, num_workers=workers,
                    pin_memory=env.device.type not in ("cpu", "mps"), persistent_workers=workers > 0,
                    worker_init_fn=ignore_stop_signals)  # they reach the whole group; the rank decides
    loader.start_workers()  # both loaders' before the model's first collective: see Loader.start_workers
    return loader


def train_loader(train_set, per_device_batch: int, global_batch: int, env: DistEnv, args) -> DataLoader:
    """Whole global batches split over the ranks; a data set not from us is seen through SeededSamples."""
    if not isinstance(train_set, (TrainImages, SeededSamples)):  # views that take (index, epoch), not an index
        train_set = SeededSamples(train_set, args.seed)
    sampler = TrainSampler(len(train_set), global_batch, env.rank, env.world_size, args.seed)
    return _loader(train_set, sampler, per_device_batch, env, args)


def eval_loader(test_set, batch_size: int, env: DistEnv, args) -> DataLoader:
    """Rank r evaluates samples r, r+W, ... once each (a range is a sampler). DistributedSampler would pad the
    last shard with repeats, counted twice; metrics.evaluate all-reduces sums and counts over uneven shards."""
    return _loader(test_set, range(env.rank, len(test_set), env.world_size), batch_size, env, args)
