"""Your own data set and model: the views that make any data set's random transforms
depend on (seed, epoch, index) only, the number of classes, the flags refused for
your own data, and README's template change applied to a copy of distributed.py and
trained under torchrun, with a resume."""
import json
import math
import random
import re
import sys
import shutil

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset

from conftest import ROOT, assert_same_training_state, read_metrics, run_script, samples_by_index, subprocess_env
from models import MODEL_NAMES
from utils import cli, data, lifecycle, metrics
from utils.distributed import DistEnv

CLASSES = ["cat", "dog", "owl"]


def args_for(*argv):
    parser = cli.build_parser("", MODEL_NAMES)
    cli.add_fast_path_flags(parser, data_on_gpu=True)  # distributed_apex.py's flags, --data-on-gpu among them
    return cli.parse_args(parser, ["--workers", "0", *map(str, argv)])


def write_image_folder(root, per_class, sizes, seed):
    """torchvision's ImageFolder layout: root/<class>/<n>.png, a colour per class plus noise; image n
    of each class is sizes[n % len(sizes)] (height, width)."""
    from PIL import Image
    rng = np.random.default_rng(seed)
    for c, name in enumerate(CLASSES):
        (root / name).mkdir(parents=True)
        for n in range(per_class):
            pixels = np.full((*sizes[n % len(sizes)], 3), 60, dtype=np.int64)
            pixels[..., c] = 200
            pixels += rng.integers(-40, 40, size=pixels.shape)
            Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(root / name / f"{n}.png")


@pytest.fixture(scope="module")
def image_folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("images")
    write_image_folder(root / "train", per_class=16, sizes=[(40, 36), (32, 48)], seed=0)  # 48 images
    write_image_folder(root / "val", per_class=5, sizes=[(44, 36), (32, 32)], seed=1)     # 15 images
    return root


def augmented_folder(root):
    from torchvision import datasets, transforms
    augment = transforms.Compose([transforms.RandomResizedCrop(32, scale=(0.6, 1)),
                                  transforms.RandomHorizontalFlip(), transforms.ToTensor()])
    return datasets.ImageFolder(root, augment)


# --- the views ---------------------------------------------------------------------------

def test_random_transforms_depend_on_seed_epoch_and_index_only(image_folder):
    train_set = data.SeededSamples(augmented_folder(image_folder / "train"), seed=7)
    global_batch = 12

    def images_by_index(world_size, workers, epoch=1):
        found = samples_by_index(train_set, args_for("--seed", "7", "--workers", workers), world_size,
                                 global_batch, epoch)
        return {index: image for index, (image, _) in found.items()}

    one = images_by_index(1, 0)
    assert len(one) == 48
    for world_size, workers in ((2, 0), (3, 2)):  # other processes, other loader workers
        other = images_by_index(world_size, workers)
        assert other.keys() == one.keys()
        assert all(torch.equal(one[i], other[i]) for i in one)
    # Another epoch draws another crop (RandomResizedCrop almost never repeats itself).
    next_epoch = images_by_index(1, 0, epoch=2)
    assert sum(not torch.equal(one[i], next_epoch[i]) for i in one) > 40
    # And a sample is not loaded as it would be without the view: the seed decides.
    other_seed = data.SeededSamples(augmented_folder(image_folder / "train"), seed=8)
    assert sum(not torch.equal(one[i], other_seed[(i, 1)][0]) for i in one) > 40


def test_loading_a_sample_leaves_the_training_processes_generators_alone(image_folder):
    train_set = data.SeededSamples(augmented_folder(image_folder / "train"), seed=0)
    torch.manual_seed(123), random.seed(123), np.random.seed(123)
    expected = torch.rand(3), random.random(), np.random.rand()
    torch.manual_seed(123), random.seed(123), np.random.seed(123)
    train_set[(5, 0)]  # what --workers 0 does in the training process itself
    assert torch.equal(torch.rand(3), expected[0])
    assert (random.random(), np.random.rand()) == expected[1:]


def test_sample_seeds_differ_by_seed_epoch_and_index():
    seeds = {data.sample_seed(s, e, i) for s in range(3) for e in range(20) for i in range(500)}
    assert len(seeds) == 3 * 20 * 500
    assert all(0 <= s < 2**64 for s in seeds)
    assert data.sample_seed(2**64 - 1, 10**6, 10**7) < 2**64


def test_numpy_transforms_are_seeded_with_all_64_bits_of_the_sample_seed():
    class NumpyDraws(Dataset):  # a transform that draws from NumPy's global generator, as many libraries do
        def __getitem__(self, index):
            return np.random.random(), index

    seen = {}  # two samples of one epoch whose seeds agree in their low 32 bits (a birthday: within 10**5)
    for index in range(10**6):
        first = seen.setdefault(data.sample_seed(0, 0, index) & 0xFFFF_FFFF, index)
        if first != index:
            break
    samples = data.SeededSamples(NumpyDraws(), seed=0)
    assert samples[(first, 0)][0] != samples[(index, 0)][0], (first, index)
    assert samples[(first, 0)] == samples[(first, 0)]


def test_a_plain_data_set_handed_to_train_loader_is_seen_through_seeded_samples():
    class Pairs(Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, index):
            return torch.rand(2), index  # a random "augmentation"

    env = DistEnv(0, 0, 1, 1, torch.device("cpu"), False)
    args = args_for("--seed", "3")
    first = [b for b in data.train_loader(Pairs(), 4, 4, env, args)]
    again = [b for b in data.train_loader(Pairs(), 4, 4, env, args)]
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(first, again))


# --- classes, flags, top-5 ---------------------------------------------------------------

def test_num_classes_comes_from_the_data_set(image_folder):
    from torchvision import datasets
    folder = datasets.ImageFolder(image_folder / "val")
    args = args_for("--test-samples", "4")
    train_set, test_set = data.own_datasets(args, folder, folder)
    assert data.num_classes(train_set) == data.num_classes(test_set) == 3  # through the view and the Subset
    assert len(test_set) == 4
    assert data.num_classes(data.TrainImages(data.SyntheticCIFAR(True, 8), seed=0)) == 100

    class NoClasses(Dataset):
        def __len__(self):
            return 1

    with pytest.raises(cli.UsageError, match="NoClasses.*classes"):
        data.num_classes(data.SeededSamples(NoClasses(), 0))


@pytest.mark.parametrize("flag, fragment", [
    (["--dataset", "synthetic"], "--dataset synthetic"),
    (["--data-on-gpu"], "--data-on-gpu"),
    (["--train-samples", "99"], "--train-samples 99 is more than the 15 samples"),
])
def test_flags_that_mean_our_cifar_are_refused_for_your_own_data(image_folder, flag, fragment):
    from torchvision import datasets
    folder = datasets.ImageFolder(image_folder / "val")
    with pytest.raises(cli.UsageError, match=re.escape(fragment)):
        data.own_datasets(args_for(*flag), folder, folder)


def test_top5_is_not_reported_for_five_classes_or_fewer():
    class Fixed(torch.nn.Module):
        def __init__(self, classes):
            super().__init__()
            self.classes = classes

        def forward(self, images):
            return images[:, :self.classes]

    targets = torch.tensor([0, 1, 2, 0])
    logits = 10 * torch.eye(6)[[0, 2, 2, 1]] + torch.linspace(1, 0, 6)  # right, wrong, right, wrong; no ties
    batches = [(logits, targets)]
    three = metrics.evaluate(Fixed(3), batches, torch.device("cpu"))
    assert three["test_acc1"] == 50.0 and three["test_samples"] == 4
    assert math.isnan(three["test_acc5"])  # every one of 3 classes is among the top 5: no figure
    six = metrics.evaluate(Fixed(6), batches, torch.device("cpu"))
    assert six["test_acc5"] == 100.0


# --- README's template, applied and run --------------------------------------------------

def template_change(which: int = 0) -> list:
    """The (removed lines, added lines) pairs of README's template diff number `which`
    (0: images in folders, 1: token sequences in a file)."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Use it as your template", 1)[1].split("\n## ", 1)[0]
    block = re.findall(r"```diff\n(.*?)```", section, re.S)[which]
    pairs = []
    for line in block.splitlines():
        sign, text = line[0], line[1:]
        if sign == "-" and (not pairs or pairs[-1][1]):
            pairs.append(([], []))
        pairs[-1][0 if sign == "-" else 1].append(text)
    return pairs


def make_template(folder, which: int = 0):
    """What README says to copy, with its change applied: distributed.py and utils/, no models/."""
    script = (ROOT / "distributed.py").read_text()
    changed = 0
    for removed, added in template_change(which):
        old, new = "\n".join(removed) + "\n", "\n".join(added) + "\n"
        assert script.count(old) == 1, f"README's template removes lines distributed.py does not hold once:\n{old}"
        script = script.replace(old, new)
        changed += len(removed) + len(added)
    assert changed <= 14  # the promise: a handful of lines
    (folder / "train.py").write_text(script)
    shutil.copytree(ROOT / "utils", folder / "utils", ignore=shutil.ignore_patterns("__pycache__"))
    return folder / "train.py"


def torchrun_template(folder, *args, check=True):
    env = subprocess_env(PYTHONPATH=str(folder))  # the copy only: nothing of this repository
    return run_script(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py",
                       *map(str, args)], cwd=folder, env=env, timeout=300, check=check)


def test_readme_template_trains_your_data_and_model_under_torchrun_and_resumes_exactly(image_folder, tmp_path,
                                                                                       capsys):
    project = tmp_path / "project"
    project.mkdir()
    make_template(project)
    common = ["--data-dir", image_folder, "--batch-size", "12", "--epochs", "2", "--workers", "2",
              "--lr", "0.05", "--dist-timeout", "120"]

    straight = torchrun_template(project, *common, "--checkpoint-dir", tmp_path / "straight",
                                 "--metrics", tmp_path / "straight.jsonl")
    records = read_metrics(tmp_path / "straight.jsonl")
    end = records[-1]
    assert end["event"] == "end" and end["step"] == 8  # 48 images, 12 a step, 2 epochs
    assert end["test_samples"] == 15  # every validation image, once
    assert end["test_acc5"] is None and "acc5" not in straight.stdout  # 3 classes: no top-5
    weights = torch.load(tmp_path / "straight" / "checkpoint.pt", weights_only=True)["model"]
    assert weights["fc.weight"].shape == (3, 512)  # torchvision's ResNet-18, 3 classes

    # Stopped in the middle of epoch 2, resumed: the same weights and optimizer state, bitwise.
    torchrun_template(project, *common, "--checkpoint-dir", tmp_path / "resumed", "--max-steps", "6")
    resumed = torchrun_template(project, *common, "--checkpoint-dir", tmp_path / "resumed", "--resume")
    assert "resumed from" in resumed.stdout and "step 2 of 4 in it" in resumed.stdout, resumed.stdout
    assert_same_training_state(tmp_path / "straight" / "checkpoint.pt",
                               tmp_path / "resumed" / "checkpoint.pt", global_step=8)
    # As slurm.sbatch checks a requeued job before it starts it again: the same flags, --resume, --check-args.
    check = run_script(["train.py", *map(str, common), "--checkpoint-dir", tmp_path / "resumed", "--resume",
                        "--check-args"], cwd=project, env=subprocess_env(PYTHONPATH=str(project)), timeout=120)
    assert "arguments OK" in check.stdout

    # What the run recorded of the data is what it trained on.
    config = json.loads((tmp_path / "straight" / "config.json").read_text())
    assert config["dataset"] == "ImageFolder" and config["model"] == "resnet18"

    # The copy's --help speaks of its own data, not of CIFAR; --dataset (our data sets) is gone.
    # (Read in this process: the copy's utils/ is this repository's, already imported.)
    import runpy
    capsys.readouterr()
    lifecycle.run_main(runpy.run_path(str(project / "train.py"), run_name="template")["main"], ["--help"])
    help_text = capsys.readouterr().out
    assert "Train a ResNet-18 on my images" in help_text and "--data-dir" in help_text
    assert "CIFAR" not in help_text and "--dataset" not in help_text, help_text


def write_tokens(path, seed=0):
    """tokens.pt as README's text template reads it: 4 classes of 16 token ids out of 1000, each
    class drawing mostly from its own quarter of the vocabulary (learnable, not trivially)."""
    g = torch.Generator().manual_seed(seed)

    def split(n):
        labels = torch.randint(0, 4, (n,), generator=g)
        own = labels.view(n, 1) * 250 + torch.randint(0, 250, (n, 16), generator=g)
        noise = torch.randint(0, 1000, (n, 16), generator=g)
        return torch.where(torch.rand(n, 16, generator=g) < 0.5, own, noise), labels
    torch.save({"train": split(4096), "test": split(904)}, path)


def test_readme_non_image_template_trains_a_text_classifier_on_token_files(tmp_path, monkeypatch, capsys):
    """README's second change (token sequences read from a file this test writes, an EmbeddingBag),
    applied to a copy of the script and run here: it learns, records what it trained on, has no
    top-5 accuracy (4 classes), and offers neither --channels-last (images=False) nor
    --data-on-gpu (our CIFAR images): each is refused in one line."""
    import runpy
    from conftest import keep_on_cpu
    keep_on_cpu(monkeypatch)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(sys, "argv", ["train.py"])
    project = tmp_path / "project"
    project.mkdir()
    write_tokens(tmp_path / "tokens.pt")
    copy = runpy.run_path(str(make_template(project, which=1)), run_name="template")
    common = ["--data-dir", str(tmp_path), "--epochs", "2", "--batch-size", "256", "--lr", "1.0", "--workers", "0",
              "--warmup-epochs", "0"]
    lifecycle.run_main(copy["main"], [*common, "--checkpoint-dir", str(tmp_path / "ck"), "--metrics", str(tmp_path / "m")])
    end = read_metrics(tmp_path / "m")[-1]
    assert end["event"] == "end" and end["step"] == 32  # 4096 sequences, 256 a step, 2 epochs
    assert end["test_samples"] == 904 and end["test_acc1"] > 80, end  # chance is 25%
    assert end["test_acc5"] is None and "acc5" not in capsys.readouterr().out  # 4 classes: no top-5
    config = json.loads((tmp_path / "ck" / "config.json").read_text())
    assert (config["dataset"], config["model"]) == ("TensorDataset", "bag-of-tokens")
    for flag, fragment in (("--channels-last", "unrecognized arguments: --channels-last"),
                           ("--data-on-gpu", "unrecognized arguments: --data-on-gpu")):
        with pytest.raises(SystemExit) as stop:
            lifecycle.run_main(copy["main"], [*common, "--batch-size", "128", flag])
        err = capsys.readouterr().err
        assert stop.value.code == 2 and len(err.strip().splitlines()) == 1 and fragment in err, err
    lifecycle.run_main(copy["main"], ["--help"])  # exit status 0: run_main returns
    help_text = capsys.readouterr().out
    assert "Train a text classifier on token sequences" in help_text and "CIFAR" not in help_text, help_text

