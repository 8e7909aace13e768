"""The calibration corpus of bench/zoo.py, part 1: torchvision and timm architectures, tiny.

Every entry builds real third-party model code offline (random weights, seeded) and returns a
driftcheck Scenario of 2 AdamW steps (lr 1e-3) on batch 2 (so BatchNorm trains): 32x32 images,
64x64 for convolutional networks with BatchNorm (their last stage is then 2x2, not a BatchNorm
over 2 values; tv_resnet_bn2 keeps that case) and larger where the architecture needs it;
cross-entropy on 10 classes, or the mean square of every output for bare backbones. torchvision and timm live in bench/.zoo-site
(bash bench/zoo_env.sh), never in the venv: importing this module puts that folder on sys.path
and registers the two torchvision operator schemas the CPU torch lacks, so transformers (which
imports torchvision whenever it can) keeps working too.
"""
from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from driftcheck import Scenario

ZOO_SITE = Path(__file__).resolve().parent / ".zoo-site"
_TV_LIB = None  # the torchvision schema library: must stay alive while torchvision is in use


def zoo_site() -> bool:
    """Put bench/.zoo-site first on sys.path and define torchvision::nms/qnms (schemas only: the
    index's torchvision is a CUDA build whose C ops do not load on the CPU torch). True if there."""
    global _TV_LIB
    if not ZOO_SITE.is_dir():
        return False
    if str(ZOO_SITE) not in sys.path:
        sys.path.insert(0, str(ZOO_SITE))
    if _TV_LIB is None and "torchvision" not in sys.modules:
        try:
            lib = torch.library.Library("torchvision", "DEF")
            lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
            lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
            _TV_LIB = lib
        except RuntimeError:  # already defined (a working torchvision): nothing to add
            pass
    return True


zoo_site()


def seed_all(seed: int = 0) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:
        pass


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3)


def tensors(out: Any) -> list[torch.Tensor]:
    """Every floating tensor in a nested output (tuples, lists, dicts, ModelOutput)."""
    if isinstance(out, torch.Tensor):
        return [out] if out.is_floating_point() else []
    if isinstance(out, dict):
        return [t for v in out.values() for t in tensors(v)]
    if isinstance(out, (tuple, list)):
        return [t for v in out for t in tensors(v)]
    if hasattr(out, "to_tuple"):
        return tensors(out.to_tuple())
    return []


def mean_square(out: Any, _batch: Any = None) -> torch.Tensor:
    """The loss of a bare backbone: the mean square of each output tensor, summed."""
    return sum(t.float().pow(2).mean() for t in tensors(out))


def logits_of(out: Any) -> torch.Tensor:
    for attr in ("logits", "out"):
        if isinstance(out, dict) and attr in out:
            return out[attr]
        if not isinstance(out, dict) and getattr(out, attr, None) is not None:
            return getattr(out, attr)
    return tensors(out)[0]


def built(make: Callable[[], torch.nn.Module], make_input: Callable[[torch.Generator], Any],
          loss: Callable[[Any, Any], torch.Tensor], steps: int = 2) -> Scenario:
    """A model built after seeding everything with 0, ``steps`` batches from one generator."""
    seed_all(0)
    model = make()
    g = torch.Generator().manual_seed(0)
    return Scenario(model=model, inputs=[make_input(g) for _ in range(steps)], loss=loss,
                    optimizer=adamw, steps=steps)


def image(make: Callable[[], torch.nn.Module], size: int | tuple = 32, classes: int = 10,
          backbone: bool = False, chans: int = 3) -> Scenario:
    """Images (batch 2, ``chans`` x size x size), cross-entropy on the logits (labels fixed per
    scenario; per-pixel labels when the logits are a map) or, ``backbone``, mean_square."""
    h, w = (size, size) if isinstance(size, int) else size
    labels = torch.Generator().manual_seed(1)
    y = torch.randint(0, classes, (2,), generator=labels)
    ymap = torch.randint(0, classes, (2, h, w), generator=labels)

    def ce(out, _x):
        lg = logits_of(out)
        if lg.dim() == 4:
            return F.cross_entropy(lg, ymap[:, :lg.shape[2], :lg.shape[3]])
        return F.cross_entropy(lg, y)

    return built(make, lambda g: torch.randn(2, chans, h, w, generator=g),
                 mean_square if backbone else ce)


# -- torchvision -------------------------------------------------------------------------------
def _tv_resnet(block: str, **kw):
    from torchvision.models import resnet

    return resnet.ResNet(getattr(resnet, block), [1, 1, 1, 1], num_classes=10, **kw)


def _tv_mbv3(arch: str, width: float, n: int):
    from torchvision.models import mobilenetv3 as m

    setting, last = m._mobilenet_v3_conf(arch, width_mult=width)
    return m.MobileNetV3(setting[:n], last, num_classes=10)


def _tv_effnet():
    from torchvision.models import efficientnet as m

    setting, last = m._efficientnet_conf("efficientnet_b0", width_mult=0.25, depth_mult=0.25)
    return m.EfficientNet(setting[:4], 0.2, last_channel=last, num_classes=10)


def _tv_effnet_v2():
    from torchvision.models.efficientnet import EfficientNet, FusedMBConvConfig, MBConvConfig

    setting = [FusedMBConvConfig(1, 3, 1, 8, 8, 1), FusedMBConvConfig(4, 3, 2, 8, 16, 1),
               MBConvConfig(4, 3, 2, 16, 24, 1, 1.0, 1.0)]
    return EfficientNet(setting, 0.2, last_channel=64, num_classes=10)


def _tv_regnet(se: float):
    from torchvision.models.regnet import BlockParams, RegNet

    return RegNet(BlockParams.from_init_params(depth=4, w_0=16, w_a=8.0, w_m=2.0, group_width=8,
                                               se_ratio=se or None), stem_width=8, num_classes=10)


def _tv(name: str, **kw):
    import torchvision

    return getattr(torchvision.models, name)(num_classes=10, **kw)


def _tv_mbv2():
    from torchvision.models import MobileNetV2

    return MobileNetV2(num_classes=10, inverted_residual_setting=[[1, 16, 1, 1], [6, 24, 2, 2],
                                                                   [6, 32, 1, 2]], width_mult=0.5)


def _tv_convnext():
    from torchvision.models.convnext import CNBlockConfig, ConvNeXt

    return ConvNeXt([CNBlockConfig(16, 32, 1), CNBlockConfig(32, None, 1)], num_classes=10)


def _tv_swin(v2: bool):
    from torchvision.models import swin_transformer as s

    extra = dict(block=s.SwinTransformerBlockV2, downsample_layer=s.PatchMergingV2) if v2 else {}
    return s.SwinTransformer([2, 2], 16, [1, 1], [2, 4], [4, 4], num_classes=10, **extra)


def _tv_seg(head: str):
    """A segmentation head of torchvision on a small MobileNetV3 body (the ResNet bodies are 5M
    parameters at any depth): FCN, DeepLabV3 (ASPP narrowed to 32 channels), LR-ASPP."""
    from torch import nn
    from torchvision.models._utils import IntermediateLayerGetter
    from torchvision.models.segmentation import deeplabv3, fcn, lraspp

    feats = _tv_mbv3("mobilenet_v3_small", 0.5, 6).features
    low, high = feats[1].out_channels, feats[5].out_channels
    if head == "lraspp":
        body = IntermediateLayerGetter(feats, {"1": "low", "5": "high"})
        return lraspp.LRASPP(body, low, high, num_classes=10, inter_channels=16)
    body = IntermediateLayerGetter(feats, {"5": "out"})
    if head == "fcn":
        return fcn.FCN(body, fcn.FCNHead(high, 10))
    aspp = nn.Sequential(deeplabv3.ASPP(high, (2, 4, 6), out_channels=32),
                         nn.Conv2d(32, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU(),
                         nn.Conv2d(32, 10, 1))
    return deeplabv3.DeepLabV3(body, aspp)


def _tv_fpn(kind: str):
    from torchvision.models.detection.backbone_utils import BackboneWithFPN

    if kind == "resnet":
        from torchvision.models.resnet import BasicBlock, ResNet

        body = ResNet(BasicBlock, [1, 1, 1, 1])
        return BackboneWithFPN(body, {"layer2": "0", "layer3": "1", "layer4": "2"}, [128, 256, 512], 16)
    feats = _tv_mbv3("mobilenet_v3_large", 0.25, 7).features
    chans = [feats[i].out_channels for i in (3, 6)]
    return BackboneWithFPN(feats, {"3": "0", "6": "1"}, chans, 16)


def _tv_raft():
    from torchvision.models.optical_flow import raft_small

    return raft_small(weights=None)


def _tv_raft_scenario() -> Scenario:
    return built(_tv_raft, lambda g: {"image1": torch.randn(2, 3, 128, 128, generator=g),
                                      "image2": torch.randn(2, 3, 128, 128, generator=g),
                                      "num_flow_updates": 2},
                 lambda out, b: out[-1].pow(2).mean())


TORCHVISION: dict[str, Callable[[], Scenario]] = {
    "tv_resnet": lambda: image(lambda: _tv_resnet("BasicBlock"), 64),
    # 32x32: layer4 is 1x1, its BatchNorms normalize 2 values per channel (batch 2)
    "tv_resnet_bn2": lambda: image(lambda: _tv_resnet("BasicBlock"), 32),
    "tv_resnext": lambda: image(lambda: _tv_resnet("Bottleneck", groups=8, width_per_group=4), 64),
    "tv_wide_resnet": lambda: image(lambda: _tv_resnet("Bottleneck", width_per_group=32), 64),
    "tv_mobilenet_v2": lambda: image(_tv_mbv2, 64),
    "tv_mobilenet_v3_small": lambda: image(lambda: _tv_mbv3("mobilenet_v3_small", 0.25, 5), 64),
    "tv_efficientnet": lambda: image(_tv_effnet, 64),
    "tv_efficientnet_v2": lambda: image(_tv_effnet_v2, 64),
    "tv_regnet_x": lambda: image(lambda: _tv_regnet(0.0), 64),
    "tv_regnet_y": lambda: image(lambda: _tv_regnet(0.25), 64),
    "tv_shufflenet_v2": lambda: image(lambda: _tv_shufflenet(), 64),
    "tv_squeezenet1_1": lambda: image(lambda: _tv("squeezenet1_1"), 64),
    "tv_mnasnet": lambda: image(lambda: _tv_mnasnet(), 64),
    "tv_densenet": lambda: image(lambda: _tv_densenet(), 64),
    "tv_convnext": lambda: image(_tv_convnext),
    "tv_vit": lambda: image(lambda: _tv_vit()),
    "tv_swin": lambda: image(lambda: _tv_swin(False)),
    "tv_swin_v2": lambda: image(lambda: _tv_swin(True)),
    "tv_maxvit": lambda: image(lambda: _tv_maxvit()),
    "tv_alexnet_features": lambda: image(lambda: _tv("alexnet").features, 64, backbone=True),
    "tv_vgg_features": lambda: image(lambda: _tv_vgg(), backbone=True),
    "tv_fcn": lambda: image(lambda: _tv_seg("fcn")),
    "tv_deeplabv3": lambda: image(lambda: _tv_seg("deeplabv3")),
    "tv_lraspp": lambda: image(lambda: _tv_seg("lraspp")),
    "tv_fpn_mobilenet": lambda: image(lambda: _tv_fpn("mobilenet"), 64, backbone=True),
    "tv_raft_small": _tv_raft_scenario,
}


def _tv_shufflenet():
    from torchvision.models import ShuffleNetV2

    return ShuffleNetV2([1, 1, 1], [8, 16, 32, 64, 128], num_classes=10)


def _tv_mnasnet():
    from torchvision.models import MNASNet

    return MNASNet(0.25, num_classes=10)


def _tv_densenet():
    from torchvision.models import DenseNet

    return DenseNet(growth_rate=8, block_config=(2, 2), num_init_features=16, bn_size=2,
                    num_classes=10)


def _tv_vit():
    from torchvision.models import VisionTransformer

    return VisionTransformer(32, 8, 2, 2, 32, 64, num_classes=10)


def _tv_maxvit():
    from torchvision.models import MaxVit

    return MaxVit(input_size=(32, 32), stem_channels=8, partition_size=2, block_channels=[16, 32],
                  block_layers=[1, 1], head_dim=8, stochastic_depth_prob=0.0, num_classes=10)


def _tv_vgg():
    from torchvision.models.vgg import make_layers

    return make_layers([16, "M", 32, "M", 32, 32, "M"], batch_norm=True)
