"""The CIFAR ResNets: sizes, output shapes, the 32x32 stem, and the model registry."""
import pytest
import torch
import torch.nn as nn

from conftest import group_norm
from models import MODEL_NAMES, build_model

# Parameter counts of the CIFAR ResNets with a 100-class head (3x3 stem, no max-pool).
# ResNet-18's 11,220,132 is the figure the CIFAR-100 literature quotes as "11.2 M".
EXPECTED_PARAMETERS = {
    "resnet18": 11_220_132,
    "resnet34": 21_328_292,
    "resnet50": 23_705_252,
}


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_resnet18_has_the_published_size():
    n = count_parameters(build_model("resnet18", 100))
    assert 11_100_000 <= n <= 11_300_000
    assert n == EXPECTED_PARAMETERS["resnet18"]


@pytest.mark.parametrize("name", ["resnet34", "resnet50"])
def test_deeper_resnets_build_and_classify_32x32_images(name):
    torch.manual_seed(0)
    model = build_model(name, 100)
    assert count_parameters(model) == EXPECTED_PARAMETERS[name]
    model.eval()
    with torch.no_grad():
        logits = model(torch.randn(2, 3, 32, 32))
    assert logits.shape == (2, 100)
    assert torch.isfinite(logits).all()


def test_number_of_classes_sets_the_head():
    model = build_model("resnet_tiny", 10)
    assert model.fc.out_features == 10
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)


def test_cifar_stem_keeps_the_full_resolution():
    model = build_model("resnet18", 100)
    stem = model.conv1
    assert isinstance(stem, nn.Conv2d)
    assert stem.kernel_size == (3, 3) and stem.stride == (1, 1) and stem.padding == (1, 1)
    assert not any(isinstance(m, nn.MaxPool2d) for m in model.modules())

    # The four stages see 32, 16, 8 and 4 pixels: an ImageNet stem would start them at 8.
    sizes = []
    hooks = [getattr(model, f"layer{i}").register_forward_hook(
        lambda _m, _inp, out: sizes.append(out.shape[-1])) for i in range(1, 5)]
    model.eval()
    with torch.no_grad():
        model(torch.randn(1, 3, 32, 32))
    for h in hooks:
        h.remove()
    assert sizes == [32, 16, 8, 4]


def test_group_norm_variant_has_no_batch_statistics():
    model = build_model("resnet_tiny", 100, norm_layer=group_norm)
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    assert any(isinstance(m, nn.GroupNorm) for m in model.modules())
    assert list(model.buffers()) == []


def test_registry_lists_the_models_the_cli_offers():
    assert {"resnet18", "resnet34", "resnet50", "resnet_tiny"} <= set(MODEL_NAMES)


def test_unknown_model_name_is_a_value_error():
    with pytest.raises(ValueError, match="resnet19"):
        build_model("resnet19", 100)

