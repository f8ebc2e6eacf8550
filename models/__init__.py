"""Model zoo: `build_model(name, num_classes)` returns a CIFAR ResNet."""
from .resnet import BasicBlock, Bottleneck, ResNet

_ARCHS = {  # name -> (block, blocks per stage, base width)
    "resnet18": (BasicBlock, [2, 2, 2, 2], 64),
    "resnet34": (BasicBlock, [3, 4, 6, 3], 64),
    "resnet50": (Bottleneck, [3, 4, 6, 3], 64),
    "resnet_tiny": (BasicBlock, [1, 1, 1, 1], 8),  # 1 block per stage, 8 wide (~80 k parameters): tests, CPU runs
}
MODEL_NAMES = tuple(_ARCHS)


def build_model(name: str, num_classes: int = 100, **options) -> ResNet:
    if name not in _ARCHS:
        raise ValueError(f"unknown model {name!r}: choose from {', '.join(MODEL_NAMES)}")
    block, layers, width = _ARCHS[name]
    return ResNet(block, layers, num_classes=num_classes, width=width, **options)
