"""Data: the real CIFAR-100 loading code on files the tests write in the real
on-disk format, learning on real images that ship offline (scikit-learn's
digits), the samplers, and the synthetic stand-in."""
import argparse
import errno
import math
import os
import pickle
import sys
import warnings
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from cifar_files import write_cifar100
from conftest import (SMALL, assert_refused, cli_args, expect_ok, normalized, one_cpu_process, read_metrics,
                      samples_by_index, torchrun)
from utils import cli, data, metrics
from utils.distributed import DistEnv

# --- CIFAR-100 in its on-disk format --------------------------------------------------

@pytest.fixture(scope="module")
def small_cifar(tmp_path_factory):
    """40 training and 12 test images of random pixels, all 100 classes possible."""
    root = tmp_path_factory.mktemp("cifar")
    rng = np.random.default_rng(7)
    split = {
        "train_images": rng.integers(0, 256, (40, 3, 32, 32), dtype=np.uint8),
        "train_labels": rng.integers(0, 100, 40),
        "test_images": rng.integers(0, 256, (12, 3, 32, 32), dtype=np.uint8),
        "test_labels": rng.integers(0, 100, 12),
    }
    write_cifar100(root, **split)
    return root, split


def test_written_files_have_the_original_layout(small_cifar):
    root, split = small_cifar
    folder = root / "cifar-100-python"
    assert sorted(os.listdir(folder)) == ["meta", "test", "train"]
    with open(folder / "train", "rb") as f:
        raw = f.read()
    assert raw[:2] == b"\x80\x02" and b"cnumpy.core.multiarray\n_reconstruct\n" in raw  # protocol 2, numpy 1's names
    as_bytes = pickle.loads(raw, encoding="bytes")
    assert set(as_bytes) == {b"batch_label", b"filenames", b"fine_labels", b"coarse_labels", b"data"}
    assert as_bytes[b"data"].dtype == np.uint8 and as_bytes[b"data"].shape == (40, 3072)
    as_text = pickle.loads(raw, encoding="latin1")  # how torchvision reads them
    assert np.array_equal(as_text["data"], split["train_images"].reshape(40, 3072))
    assert as_text["fine_labels"] == split["train_labels"].tolist()


def test_cifar100_reaches_loader_workers_started_by_spawn(small_cifar):
    # Where workers start by spawn (macOS, Windows; Linux forks: see data.Loader), each is sent the data set
    # pickled: a class defined inside a function cannot be, and the default run stopped at its first batch.
    root, _ = small_cifar
    train_set, test_set = data.build_datasets(cli_args("--dataset", "cifar100", "--data-dir", root),
                                              one_cpu_process())
    for dataset, keys in ((train_set, [(i, 0) for i in range(40)]), (test_set, range(12))):  # (index, epoch)
        loader = torch.utils.data.DataLoader(dataset, batch_size=len(keys), sampler=keys, num_workers=1,
                                             multiprocessing_context="spawn")
        images, labels = next(iter(loader))
        assert torch.equal(images, torch.stack([dataset[key][0] for key in keys]))
        assert labels.tolist() == [dataset[key][1] for key in keys]


def test_build_datasets_reads_cifar100_from_disk(small_cifar):
    root, split = small_cifar
    train_set, test_set = data.build_datasets(cli_args("--dataset", "cifar100", "--data-dir", root),
                                              one_cpu_process())
    assert (len(train_set), len(test_set)) == (40, 12)

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a clean read: no warning on the user's terminal
        test_items = [test_set[i] for i in range(12)]
    # The stored pixels, as bytes; normalised for the model by model_inputs (on the device).
    to_model = data.model_inputs(test_set, torch.device("cpu"))
    # The formula's statistics: CIFAR-100's training set, per channel, as published.
    assert (data.CIFAR100_MEAN, data.CIFAR100_STD) == ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762))
    for i, (image, label) in enumerate(test_items):
        assert image.dtype == torch.uint8 and torch.equal(image, torch.from_numpy(split["test_images"][i]))
        assert torch.allclose(to_model(image[None])[0], normalized(image), atol=1e-6)
        assert label == split["test_labels"][i]  # the fine label, not the coarse one

    # Training images are the stored pixels, cropped and flipped as the epoch's plan says.
    assert data.num_classes(train_set) == 100
    for epoch in (0, 3):
        plan = data.augmentation_plan(seed=0, epoch=epoch, num_samples=40)  # cli_args's --seed is 0
        for i in (0, 17, 39):
            image, label = train_set[(i, epoch)]
            dy, dx, flip = plan[i].tolist()
            expected = data.crop_flip(torch.from_numpy(split["train_images"][i]), dy, dx, flip)
            assert torch.equal(image, expected)
            assert label == split["train_labels"][i]


def test_sample_limits_take_the_first_images(small_cifar):
    root, split = small_cifar
    args = cli_args("--dataset", "cifar100", "--data-dir", root, "--train-samples", "8", "--test-samples", "5")
    train_set, test_set = data.build_datasets(args, one_cpu_process())
    assert (len(train_set), len(test_set)) == (8, 5)
    assert [test_set[i][1] for i in range(5)] == split["test_labels"][:5].tolist()
    assert torch.equal(test_set[4][0], torch.from_numpy(split["test_images"][4]))


@pytest.mark.parametrize("no_lock", [errno.ENOLCK, errno.ENOSYS])
def test_a_folder_on_a_file_system_without_locks_is_read_without_one(small_cifar, monkeypatch, no_lock, tmp_path):
    # NFS without its lock daemon, Lustre mounted noflock: the files there are read all the same, and missing
    # ones are not downloaded: every process would, at once, into the same folder.
    def lockf(*_):
        raise OSError(no_lock, os.strerror(no_lock))
    monkeypatch.setattr(data.fcntl, "lockf", lockf)
    root, _ = small_cifar
    train_set, test_set = data.build_datasets(cli_args("--dataset", "cifar100", "--data-dir", root),
                                              one_cpu_process())
    assert (len(train_set), len(test_set)) == (40, 12)
    with pytest.raises(cli.UsageError) as refused:
        data.build_datasets(cli_args("--dataset", "cifar100", "--data-dir", tmp_path), one_cpu_process())
    assert f"CIFAR-100 is not in --data-dir {tmp_path}, and no lock can be taken there" in str(refused.value)


def test_a_data_dir_with_a_tilde_is_locked_where_it_is_read(small_cifar, monkeypatch, tmp_path):
    # `--data-dir=~/data` reaches the program unexpanded; torchvision expands it, and so must the download
    # lock: it was taken in ./~/data, a folder of its own beside the data.
    root, _ = small_cifar
    monkeypatch.setenv("HOME", str(root.parent))
    monkeypatch.chdir(tmp_path)
    train_set, _ = data.build_datasets(cli_args("--dataset", "cifar100", "--data-dir", f"~/{root.name}"),
                                       one_cpu_process())
    assert len(train_set) == 40 and (root / ".download.lock").exists() and not (tmp_path / "~").exists()


def test_corrupt_dataset_file_is_a_usage_error(tmp_path, small_cifar):
    root, _ = small_cifar
    folder = tmp_path / "cifar-100-python"
    folder.mkdir()
    for name in ("train", "test", "meta"):
        raw = (root / "cifar-100-python" / name).read_bytes()
        (folder / name).write_bytes(raw[:len(raw) // 2] if name == "train" else raw)
    with pytest.raises(cli.UsageError) as excinfo:
        data.build_datasets(cli_args("--dataset", "cifar100", "--data-dir", tmp_path), one_cpu_process())
    assert str(tmp_path) in str(excinfo.value) and "\n" not in str(excinfo.value)


def test_distributed_py_trains_on_cifar100_files_with_two_processes(small_cifar, tmp_path):
    # One rank at a time checks the folder (and would download); then both read it.
    root, _ = small_cifar
    metrics = tmp_path / "metrics.jsonl"
    proc = torchrun(2, "distributed.py", [
        "--dataset", "cifar100", "--data-dir", root, "--model", "resnet_tiny", "--workers", "0",
        "--epochs", "1", "--batch-size", "16", "--metrics", metrics])
    assert "Traceback" not in proc.stderr
    records = read_metrics(metrics)
    assert [r["event"] for r in records] == ["epoch", "end"]
    assert records[-1]["test_samples"] == 12 and records[-1]["step"] == 40 // 16
    assert records[-1]["world_size"] == 2


def test_missing_dataset_offline_is_one_line(tmp_path, run_in_process):
    empty = tmp_path / "nothing-here"
    empty.mkdir()
    outcome = run_in_process("distributed.py", ["--dataset", "cifar100", "--data-dir", empty, "--model",
                                                "resnet_tiny", "--workers", "0", "--epochs", "1"])
    assert_refused(outcome, "--data-dir", str(empty), "--dataset synthetic")
    assert outcome[1] == ""  # nothing on stdout


# --- learning real images that ship offline -------------------------------------------

# 276 steps of 32 images (about 5 s of one core of the 2-core build machine). Measured there
# with PyTorch 2.14.1: 94.9% test accuracy (--seed 0, the default).
DIGITS_RECIPE = ["--epochs", "6", "--batch-size", "32", "--lr", "0.6", "--warmup-epochs", "0.2"]

def test_resnet_learns_handwritten_digits_through_the_cifar100_reader(tmp_path, run_in_process):
    """scikit-learn's 1,797 8x8 digits, upscaled to 32x32 RGB and stored as CIFAR-100
    (fine labels 0-9): the real reader, sampler, augmentation and training loop
    must take test accuracy far above chance (10%)."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    order = np.random.default_rng(0).permutation(len(digits.target))
    pixels = np.kron(digits.images[order], np.ones((4, 4))) * (255 / 16)  # 0..16 -> 0..255, 8 -> 32 px
    gray = np.clip(np.round(pixels), 0, 255).astype(np.uint8)
    images = np.repeat(gray[:, None], 3, axis=1)  # N x 3 x 32 x 32
    labels = digits.target[order]
    write_cifar100(tmp_path, images[:1500], labels[:1500], images[1500:], labels[1500:])

    metrics = tmp_path / "metrics.jsonl"
    expect_ok(run_in_process("distributed.py", ["--dataset", "cifar100", "--data-dir", tmp_path, "--model",
                                                "resnet_tiny", "--workers", "0", *DIGITS_RECIPE, "--metrics", metrics]))
    end = read_metrics(metrics)[-1]
    assert end["event"] == "end" and end["test_samples"] == 297
    assert end["test_acc1"] >= 90.0, end



# --- samplers -------------------------------------------------------------------------

def rank_keys(num_samples, global_batch, world_size, seed=0, epoch=0, start_step=0):
    """Each rank's (index, epoch) keys for one epoch."""
    out = []
    for rank in range(world_size):
        sampler = data.TrainSampler(num_samples, global_batch, rank, world_size, seed)
        sampler.set_epoch(epoch, start_step=start_step)
        keys = list(sampler)
        assert len(keys) == len(sampler)
        out.append(keys)
    return out


def steps(keys, per_device_batch):
    return [keys[i:i + per_device_batch] for i in range(0, len(keys), per_device_batch)]


def test_three_ranks_see_the_samples_of_one_process_step_by_step():
    num_samples, global_batch = 100, 24
    assert data.steps_per_epoch(num_samples, global_batch) == 4
    (single,) = rank_keys(num_samples, global_batch, 1)
    per_rank = rank_keys(num_samples, global_batch, 3)
    single_steps = steps(single, global_batch)
    rank_steps = [steps(keys, global_batch // 3) for keys in per_rank]
    assert len(single_steps) == 4 and all(len(s) == 4 for s in rank_steps)
    for step in range(4):
        together = [key for r in range(3) for key in rank_steps[r][step]]
        assert all(len(rank_steps[r][step]) == 8 for r in range(3))
        assert sorted(together) == sorted(single_steps[step])
    indices = [key[0] for key in single]
    assert len(indices) == len(set(indices)) == 96  # whole batches only, no repeats


def test_set_epoch_changes_the_order_and_the_keys_name_the_epoch():
    (epoch0,) = rank_keys(100, 20, 1, epoch=0)
    (epoch0_again,) = rank_keys(100, 20, 1, epoch=0)
    (epoch1,) = rank_keys(100, 20, 1, epoch=1)
    assert epoch0 == epoch0_again
    assert [key[0] for key in epoch0] != [key[0] for key in epoch1]
    # The epoch in the key is what draws a new augmentation each epoch (see the views' tests).
    assert {key[1] for key in epoch0} == {0} and {key[1] for key in epoch1} == {1}
    (other_seed,) = rank_keys(100, 20, 1, seed=1, epoch=0)
    assert [key[0] for key in other_seed] != [key[0] for key in epoch0]


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("start_step", [1, 3])
def test_start_step_skips_exactly_those_steps(world_size, start_step):
    global_batch = 16
    full = rank_keys(100, global_batch, world_size, epoch=2)
    resumed = rank_keys(100, global_batch, world_size, epoch=2, start_step=start_step)
    per_device = global_batch // world_size
    for rank in range(world_size):
        assert resumed[rank] == full[rank][start_step * per_device:]
    # Set back to 0 at the next epoch: the whole epoch again.
    sampler = data.TrainSampler(100, global_batch, 0, world_size, 0)
    sampler.set_epoch(2, start_step=start_step)
    sampler.set_epoch(3)
    assert len(list(sampler)) == len(sampler) == 6 * per_device


def test_train_sampler_refuses_a_set_smaller_than_one_batch():
    with pytest.raises(cli.UsageError, match="10 samples.*32"):
        data.TrainSampler(10, 32, 0, 1, 0)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_evaluation_counts_every_test_sample_once(world_size):
    args = SimpleNamespace(workers=0)
    loaders = [data.eval_loader(list(range(101)), 8, DistEnv(rank, rank, world_size, world_size,
                                                            torch.device("cpu"), world_size > 1), args)
               for rank in range(world_size)]
    shards = [torch.cat(list(loader)).tolist() for loader in loaders]
    assert sorted(i for shard in shards for i in shard) == list(range(101))
    assert [len(loader.sampler) for loader in loaders] == [len(s) for s in shards]
    assert max(map(len, shards)) - min(map(len, shards)) <= 1


def test_an_empty_test_set_is_not_scored():
    # Your own data with an empty test set: no figure is measured, so none is reported as 0%.
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 10))
    loader = data.eval_loader([], 8, one_cpu_process(), SimpleNamespace(workers=0))
    scores = metrics.evaluate(model, loader, torch.device("cpu"))
    assert scores["test_samples"] == 0 and all(math.isnan(scores[key]) for key in ("test_loss", "test_acc1")), scores


def test_augmentation_does_not_depend_on_world_size_or_workers():
    train_set = data.TrainImages(data.SyntheticCIFAR(True, 64), seed=5)
    global_batch = 16

    def images_by_index(world_size, workers, epoch=1):
        found = samples_by_index(train_set, cli_args("--seed", "5", "--workers", workers), world_size,
                                 global_batch, epoch)
        assert all(label.item() == index % 100 for index, (_, label) in found.items())
        return {index: image for index, (image, _) in found.items()}

    one = images_by_index(1, 0)
    assert len(one) == 64
    for world_size, workers in ((2, 0), (4, 0), (2, 2)):
        other = images_by_index(world_size, workers)
        assert other.keys() == one.keys()
        assert all(torch.equal(one[i], other[i]) for i in one)
    next_epoch = images_by_index(1, 0, epoch=2)
    assert sum(not torch.equal(one[i], next_epoch[i]) for i in one) > 32  # a new draw each epoch


@pytest.mark.parametrize("workers", [0, 1])
def test_a_loader_leaves_the_global_generator_alone(workers):
    """DataLoader draws a base seed from the global generator for every iterator, with no workers
    too: put back, a resume (the checkpoint's generator state restored, then the epoch's iterator
    started) continues the training's own draws, a model's dropout, exactly."""
    loader = data.Loader(torch.utils.data.TensorDataset(torch.arange(8.0)), batch_size=2, num_workers=workers)
    torch.manual_seed(0)
    before = torch.get_rng_state()
    for _ in range(2):  # two epochs
        assert len(list(loader)) == 4
    assert torch.equal(torch.get_rng_state(), before)


def test_crop_flip_is_a_padded_crop_or_its_mirror():
    pixels = torch.arange(3 * 32 * 32, dtype=torch.int64).view(3, 32, 32) % 251 + 1  # no zeros
    padded = torch.nn.functional.pad(pixels, (4, 4, 4, 4))
    for dy, dx, flip in ((0, 0, 0), (8, 8, 1), (3, 5, 0), (4, 4, 1)):
        out = data.crop_flip(pixels, dy, dx, flip)
        assert out.shape == (3, 32, 32)
        crop = padded[:, dy:dy + 32, dx:dx + 32]
        assert torch.equal(out, crop.flip(2) if flip else crop)
    # The plan covers every offset and both flips over a data set.
    plan = data.augmentation_plan(seed=0, epoch=0, num_samples=2000)
    assert {tuple(row) for row in plan.tolist()} == {(dy, dx, f) for dy in range(9) for dx in range(9) for f in (0, 1)}


# --- the synthetic stand-in -----------------------------------------------------------

def test_synthetic_has_cifar100s_shape():
    train, test = data.SyntheticCIFAR(True), data.SyntheticCIFAR(False)
    assert (len(train), len(test)) == (50_000, 10_000)
    assert data.NUM_CLASSES == 100
    image, label = train[12345]
    assert image.shape == (32, 32, 3) and image.dtype == np.uint8
    assert 0 <= label < 100
    assert sorted(set(train.targets)) == list(range(100)) == sorted(set(test.targets))
    assert image.std() > 10  # not a constant image


def test_synthetic_is_deterministic_and_splits_differ():
    a, b = data.SyntheticCIFAR(True, 300), data.SyntheticCIFAR(True, 300)
    for i in (0, 1, 299):
        assert np.array_equal(a[i][0], b[i][0]) and a[i][1] == b[i][1]
    test = data.SyntheticCIFAR(False, 300)
    assert not np.array_equal(a[0][0], test[0][0])
    assert not np.array_equal(a[0][0], a[100][0])  # same class, another sample


def test_synthetic_classes_are_learnable_signal():
    # Samples of a class are closer to their own class mean than to the others'.
    dataset = data.SyntheticCIFAR(True, 1000)
    images = np.stack([dataset[i][0] for i in range(1000)]).astype(np.float32).reshape(1000, -1)
    labels = np.array(dataset.targets)
    means = np.stack([images[labels == c][:5].mean(0) for c in range(100)])  # 5 per class
    held_out = images[500:]
    nearest = ((held_out[:, None, :] - means[None]) ** 2).sum(-1).argmin(1)
    assert (nearest == labels[500:]).mean() > 0.5


def test_build_datasets_synthetic_with_limits():
    args = cli_args(*SMALL)
    train_set, test_set = data.build_datasets(args, one_cpu_process())
    assert (len(train_set), len(test_set)) == (256, 100)
    image, label = test_set[3]
    assert image.shape == (3, 32, 32) and label == 3
    assert torch.equal(image, torch.from_numpy(data.SyntheticCIFAR(False, 100)[3][0].transpose(2, 0, 1)))


def _report_loader_workers(rank, out):
    loader = data.Loader(torch.utils.data.TensorDataset(torch.zeros(8, 1)), batch_size=4, num_workers=1)
    iterator = iter(loader)
    next(iterator)
    [worker] = iterator._workers
    with open(out, "w") as f:
        f.write(f"{torch.multiprocessing.get_start_method()} {type(worker).__name__}")


@pytest.mark.skipif(sys.platform != "linux", reason="fork is asked for on Linux only")
def test_loader_workers_are_forked_in_a_process_that_mp_spawn_started(tmp_path):
    # distributed_mp.py's ranks: their own start method is "spawn", their loader workers'
    # is "fork" (each spawned worker would import PyTorch again, see Loader.__init__).
    out = tmp_path / "workers"
    torch.multiprocessing.spawn(_report_loader_workers, args=(out,), nprocs=1)
    assert out.read_text() == "spawn ForkProcess"


# Two processes of one node that both take themselves for its first (torchrun --virtual-local-rank
# gives every worker LOCAL_RANK=0): each loads CIFAR-100 from an empty folder at once, with the
# download replaced by one that counts itself and writes the files only once the other process has
# come as far as it can without them: blocked on the lock that this one holds (as /proc/locks shows
# it), or downloading too. Both are there before any file is, whatever the load.
BOTH_LOCAL_RANK_0 = """
import os, sys, time
sys.path[:0] = [{root!r}, {tests!r}]
import numpy as np
import torchvision.datasets.cifar as cifar
from cifar_files import write_cifar100
from models import MODEL_NAMES
from utils import cli, data

ARRIVED, DOWNLOADS = {arrived!r}, {count!r}
open(os.path.join(ARRIVED, str(os.getpid())), "w").close()


def waits_for_my_lock(pid):
    # /proc/locks: "1: POSIX  ADVISORY  WRITE HOLDER ...", then "1: -> POSIX  ADVISORY  WRITE WAITER ..."
    # for each process blocked on that lock.
    holders = {{}}
    with open("/proc/locks") as f:
        for number, *rest in map(str.split, f):
            if rest[0] != "->":
                holders[number] = rest[3]
            elif rest[4] == str(pid) and holders.get(number) == str(os.getpid()):
                return True
    return False


def download(url, root, filename=None, md5=None):
    with open(DOWNLOADS, "a") as f:
        f.write(f"{{os.getpid()}}\\n")
    deadline = time.monotonic() + 60
    while True:
        others = [int(name) for name in os.listdir(ARRIVED) if int(name) != os.getpid()]
        with open(DOWNLOADS) as f:
            downloading = len(f.read().split()) > 1
        if others and (downloading or waits_for_my_lock(others[0])):
            break
        if time.monotonic() > deadline:
            sys.exit("the other process neither waited for this one's lock nor downloaded within 60 s")
        time.sleep(0.01)
    print("overlap:", "both downloading" if downloading else "the other waiting for the lock", file=sys.stderr)
    rng = np.random.default_rng(0)
    write_cifar100(root, rng.integers(0, 256, (8, 3, 32, 32)), rng.integers(0, 100, 8),
                   rng.integers(0, 256, (4, 3, 32, 32)), rng.integers(0, 100, 4))

cifar.download_and_extract_archive = download
args = cli.parse_args(cli.build_parser("", MODEL_NAMES), ["--workers", "0", "--dataset", "cifar100",
                                                          "--data-dir", {folder!r}])
train, test = data._load_cifar100(args)
print(len(train), len(test))
"""


@pytest.mark.skipif(not os.path.exists("/proc/locks"), reason="the overlap is seen in Linux's /proc/locks")
def test_cifar100_is_downloaded_once_however_many_processes_take_themselves_for_the_first(tmp_path):
    import subprocess
    from conftest import ROOT, subprocess_env
    program, arrived = tmp_path / "load.py", tmp_path / "arrived"
    arrived.mkdir()
    program.write_text(BOTH_LOCAL_RANK_0.format(root=str(ROOT), tests=str(ROOT / "tests"), folder=str(tmp_path / "data"),
                                                arrived=str(arrived), count=str(tmp_path / "downloads")))
    procs = [subprocess.Popen([sys.executable, str(program)], env=subprocess_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [proc.communicate(timeout=120) for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], outputs
    assert [out.split() for out, _ in outputs] == [["8", "4"], ["8", "4"]], outputs
    # The one download began while the other process waited for the lock; it then found the files.
    assert [err.count("overlap: the other waiting for the lock") for _, err in outputs] in ([1, 0], [0, 1]), outputs
    assert len((tmp_path / "downloads").read_text().split()) == 1


@pytest.mark.parametrize("given, capability, expected", [
    (None, (9, 0), torch.channels_last), (None, (8, 0), torch.channels_last), (None, (7, 5), torch.contiguous_format),
    (False, (9, 0), torch.contiguous_format), (True, (7, 5), torch.channels_last)])
def test_the_default_layout_follows_the_gpu(monkeypatch, given, capability, expected):
    """NHWC by default on NVIDIA GPUs of compute capability 8.0 or newer, NCHW on older ones, ROCm's and the CPU;
    --channels-last and --no-channels-last decide everywhere. The choice is kept in args, for config.json."""
    asked = []
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: asked.append(device) or capability)

    def layout(device):
        args = argparse.Namespace(channels_last=given)
        chosen = data.memory_format(args, device)
        assert args.channels_last is (chosen == torch.channels_last)
        return chosen

    assert layout(torch.device("cuda", 1)) == expected
    assert asked in ([torch.device("cuda", 1)], [])  # the process's own GPU, not the first one
    assert layout(torch.device("cpu")) == (torch.contiguous_format if given is None else expected)
    monkeypatch.setattr(torch.version, "hip", "6.4")  # a ROCm build's "cuda" device: NCHW unless asked
    assert layout(torch.device("cuda", 1)) == (torch.contiguous_format if given is None else expected)
