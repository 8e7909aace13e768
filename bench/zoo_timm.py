"""The calibration corpus of bench/zoo.py, part 2: timm families, tiny.

Each entry is ``timm.create_model(name, pretrained=False, num_classes=10, **kwargs)`` with
depth/width/image-size kwargs small enough for a 2-core CPU (the model classes accept them;
nothing of timm is patched), trained on 32x32 images, 64x64 for convolutional networks with
BatchNorm (at 32x32 their last stage is 1x1: a BatchNorm over 2 values per channel, which
tv_resnet_bn2 in bench/zoo_models.py keeps as its own case).
"""
from __future__ import annotations

from typing import Any, Callable

from zoo_models import image

from driftcheck import Scenario

_VIT = dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2)
_SWIN = dict(img_size=32, patch_size=2, embed_dim=16, depths=(1, 1), num_heads=(1, 2), window_size=4)
_META = dict(depths=(1, 1, 1, 1), dims=(8, 16, 24, 32))
_MULT = dict(channel_multiplier=0.25, depth_multiplier=0.25)

# name -> (timm model name, or "module.Class" / "module._gen_fn" of timm.models; kwargs, or a
# function making them once timm is imported; image size)
TIMM_SPECS: dict[str, tuple[str, dict[str, Any], int]] = {
    "timm_resnet": ("resnet18", dict(layers=[1, 1, 1, 1], channels=(16, 32, 64, 128)), 64),
    "timm_seresnext": ("seresnext26d_32x4d", dict(layers=[1, 1, 1, 1], channels=(16, 32, 64, 128),
                                                  stem_width=8, base_width=16, cardinality=4), 64),
    "timm_skresnet": ("skresnet18", dict(layers=[1, 1, 1, 1], channels=(16, 32, 64, 128)), 64),
    "timm_res2net": ("res2net50_26w_4s", dict(layers=[1, 1, 1, 1], channels=(16, 32, 64, 128),
                                              base_width=8), 64),
    "timm_resnetv2_bit": ("resnetv2.ResNetV2", lambda: dict(layers=[1, 1, 1, 1], channels=(16, 32, 64, 128),
                           stem_chs=16, stem_type="fixed", conv_layer=_std_conv(),
                           norm_layer=_group_norm_act()), 64),
    "timm_tresnet": ("tresnet_m", dict(layers=[1, 1, 1, 1], width_factor=0.25), 64),
    "timm_densenet": ("densenet121", dict(growth_rate=8, block_config=(2, 2)), 64),
    "timm_dla": ("dla34", dict(levels=[1, 1, 1, 1, 1, 1], channels=[8, 16, 16, 32, 32, 64]), 64),
    "timm_dpn": ("dpn48b", dict(k_sec=(1, 1, 1, 1), inc_sec=(8, 8, 8, 8), num_init_features=8,
                                k_r=16, groups=4), 64),
    "timm_efficientnet": ("efficientnet._gen_efficientnet", dict(variant="efficientnet_b0", **_MULT), 64),
    "timm_mobilenetv3": ("mobilenetv3._gen_mobilenet_v3", dict(variant="mobilenetv3_large_100", channel_multiplier=0.25,
                                                        depth_multiplier=0.25), 64),
    "timm_mixnet": ("efficientnet._gen_mixnet_m", dict(variant="mixnet_m", **_MULT), 64),
    "timm_tinynet": ("efficientnet._gen_tinynet", dict(variant="tinynet_e", model_width=0.25, depth_multiplier=0.25), 64),
    "timm_rexnet": ("rexnet_100", dict(width_mult=0.25, depth_mult=0.25), 64),
    "timm_regnet": ("regnet.RegNet", lambda: dict(cfg=_regnet_cfg(0.0)), 64),
    "timm_ese_vovnet": ("ese_vovnet19b_slim_dw", dict(), 64),
    "timm_cspnet": ("cspnet.CspNet", lambda: dict(cfg=_cs3()), 64),
    "timm_repvgg": ("byobnet.ByobNet", lambda: dict(cfg=_byob("repvgg")), 64),
    "timm_gernet": ("byobnet.ByobNet", lambda: dict(cfg=_byob("gernet")), 64),
    "timm_nfnet": ("nfnet.NormFreeNet", lambda: dict(cfg=_nf()), 64),
    "timm_convnext": ("convnext_atto", _META, 32),
    "timm_convmixer": ("convmixer.ConvMixer", dict(dim=32, depth=2, kernel_size=3, patch_size=4), 32),
    "timm_edgenext": ("edgenext_xx_small", dict(depths=(1, 1, 1, 1), dims=(16, 32, 48, 64),
                                                heads=(2, 2, 2, 2)), 32),
    "timm_mambaout": ("mambaout_femto", dict(depths=(1, 1, 1, 1), dims=(16, 32, 48, 64)), 32),
    "timm_fasternet": ("fasternet_t0", dict(embed_dim=16, depths=(1, 1, 1, 1)), 64),
    "timm_poolformer": ("metaformer.MetaFormer", lambda: _metaformer("pool"), 32),
    "timm_caformer": ("metaformer.MetaFormer", lambda: _metaformer("ca"), 32),
    "timm_efficientformer": ("efficientformer_l1", dict(depths=(1, 1, 1, 2), embed_dims=(16, 32, 48, 64),
                                                        num_vit=1), 224),
    "timm_fastvit": ("fastvit_t8", dict(layers=(1, 1, 1, 1), embed_dims=(16, 32, 64, 128)), 64),
    "timm_vit": ("vit_tiny_patch16_224", _VIT, 32),
    "timm_deit_distilled": ("deit_tiny_distilled_patch16_224", _VIT, 32),
    "timm_deit3": ("deit3_small_patch16_224", _VIT, 32),
    "timm_vit_relpos": ("vit_relpos_small_patch16_224", _VIT, 32),
    "timm_eva": ("eva02_tiny_patch14_224", _VIT, 32),
    "timm_cait": ("cait_xxs24_224", dict(_VIT, depth_token_only=1), 32),
    "timm_xcit": ("xcit_nano_12_p8_224", dict(img_size=32, embed_dim=32, depth=2, num_heads=2), 32),
    "timm_pit": ("pit_ti_224", dict(img_size=32, patch_size=4, stride=2, base_dims=[16, 16],
                                    depth=[1, 1], heads=[1, 2]), 32),
    "timm_tnt": ("tnt_s_patch16_224", dict(img_size=32, patch_size=8, embed_dim=32, inner_dim=8,
                                           depth=2, num_heads_outer=2, num_heads_inner=2), 32),
    "timm_convit": ("convit_tiny", dict(_VIT, local_up_to_layer=1), 32),
    "timm_levit": ("levit_128s", dict(img_size=64, embed_dim=(32, 48, 64), key_dim=8,
                                      depth=(1, 1, 1), num_heads=(2, 2, 2)), 64),
    "timm_coat": ("coat_lite_tiny", dict(img_size=32, embed_dims=[32, 32, 64, 64],
                                         serial_depths=[1, 1, 1, 1], num_heads=8), 32),
    "timm_twins": ("twins_svt_small", dict(img_size=32, embed_dims=(16, 32, 48, 64), depths=(1, 1, 1, 1),
                                           num_heads=(1, 2, 2, 4), wss=(2, 2, 2, 1)), 32),
    "timm_visformer": ("visformer_tiny", dict(img_size=32, init_channels=8, embed_dim=48,
                                              depth=(1, 1, 1), num_heads=2), 32),
    "timm_mixer": ("mlp_mixer.MlpMixer", dict(img_size=32, patch_size=8, num_blocks=2, embed_dim=32), 32),
    "timm_resmlp": ("mlp_mixer.MlpMixer", lambda: _mixer("res"), 32),
    "timm_gmlp": ("mlp_mixer.MlpMixer", lambda: _mixer("gated"), 32),
    "timm_sequencer": ("sequencer2d_s", dict(img_size=32, layers=[1, 1], patch_sizes=[4, 2],
                                             embed_dims=[16, 32], hidden_sizes=[8, 16],
                                             mlp_ratios=[2.0, 2.0]), 32),
    "timm_swinv2": ("swinv2_tiny_window8_256", _SWIN, 32),
    "timm_nest": ("nest.Nest", dict(img_size=32, patch_size=4, embed_dims=(16, 32, 48),
                                    depths=(1, 1, 1), num_heads=(1, 2, 2)), 32),
    "timm_coatnet": ("maxxvit.MaxxVit", lambda: dict(cfg=_maxxvit("C"), img_size=64), 64),
    "timm_hiera": ("hiera_tiny_224", dict(img_size=64, embed_dim=16, num_heads=1, stages=(1, 1, 1, 1)), 64),
    "timm_rdnet": ("rdnet.RDNet", dict(num_init_features=16, growth_rates=(16, 16, 16),
                                       num_blocks_list=(1, 1, 1), is_downsample_block=(None, True, True),
                                       block_type=["Block", "Block", "BlockESE"]), 64),
}


def _std_conv():
    import functools

    from timm.layers import StdConv2d

    return functools.partial(StdConv2d, eps=1e-8)


def _group_norm_act():
    import functools

    from timm.layers import GroupNormAct

    return functools.partial(GroupNormAct, num_groups=4)


def _regnet_cfg(se: float):
    from timm.models.regnet import RegNetCfg

    return RegNetCfg(depth=5, w0=8, wa=12.0, wm=2.0, group_size=8, se_ratio=se)


def _cs3():
    from timm.models.cspnet import _cs3_cfg

    return _cs3_cfg(width_multiplier=0.125, depth_multiplier=0.34)


def _byob(kind: str):
    from timm.models import byobnet as b

    if kind == "repvgg":
        return b.ByoModelCfg(blocks=b._rep_vgg_bcfg(d=(1, 1, 1, 1), wf=(0.25,) * 4),
                             stem_type="rep", stem_chs=16)
    if kind == "mobileone":
        return b.ByoModelCfg(blocks=b._mobileone_bcfg(d=(1, 1, 1, 1), wf=(0.25,) * 4,
                                                      num_conv_branches=2),
                             stem_type="one", stem_chs=16)
    return b.ByoModelCfg(blocks=(b.ByoBlockCfg(type="basic", d=1, c=16, s=2, gs=0, br=1.0),
                                 b.ByoBlockCfg(type="bottle", d=1, c=32, s=2, gs=0, br=0.25),
                                 b.ByoBlockCfg(type="bottle", d=1, c=48, s=2, gs=1, br=3.0)),
                         stem_chs=8, stem_pool=None, num_features=64)


def _nf():
    from timm.models.nfnet import _nfreg_cfg

    return _nfreg_cfg(depths=(1, 1, 1, 1), channels=(16, 32, 48, 64))


def _metaformer(kind: str):
    from torch import nn
    from timm.models import metaformer as m

    base = dict(depths=(1, 1, 1, 1), dims=(16, 32, 48, 64))
    if kind == "pool":
        return dict(base, downsample_norm=None, mlp_act=nn.GELU, mlp_bias=True,
                    norm_layers=m.GroupNorm1, layer_scale_init_values=1e-5,
                    res_scale_init_values=None, use_mlp_head=False)
    if kind == "conv":
        return dict(base, token_mixers=m.SepConv, norm_layers=m.LayerNorm2dNoBias)
    return dict(base, dims=(16, 32, 64, 64), token_mixers=[m.SepConv, m.SepConv, m.Attention, m.Attention],
                norm_layers=[m.LayerNorm2dNoBias] * 2 + [m.LayerNormNoBias] * 2)


def _mixer(kind: str):
    from timm.layers import GatedMlp
    from timm.models import mlp_mixer as m

    base = dict(img_size=32, patch_size=8, num_blocks=2, embed_dim=32)
    if kind == "res":
        return dict(base, mlp_ratio=4, block_layer=m.ResBlock, norm_layer=m.Affine)
    return dict(base, mlp_ratio=6, block_layer=m.SpatialGatingBlock, mlp_layer=GatedMlp)


def _maxxvit(kind: str):
    from timm.models import maxxvit as m

    if kind == "M":
        return m.MaxxVitCfg(embed_dim=(16, 32), depths=(1, 1), block_type=("M", "M"),
                            stem_width=8, **m._rw_max_cfg(dim_head=8))
    import dataclasses

    cfg = m._rw_coat_cfg()
    cfg["transformer_cfg"] = dataclasses.replace(cfg["transformer_cfg"], dim_head=8)
    return m.MaxxVitCfg(embed_dim=(16, 32), depths=(1, 1), block_type=("C", "T"), stem_width=8, **cfg)


def _timm(name: str, kwargs: dict[str, Any] | Callable[[], dict[str, Any]]):
    import importlib

    import timm

    kw = dict(kwargs() if callable(kwargs) else kwargs)
    if "." not in name:
        return timm.create_model(name, pretrained=False, num_classes=10, **kw)
    module, attr = name.rsplit(".", 1)
    fn = getattr(importlib.import_module(f"timm.models.{module}"), attr)
    if attr.startswith("_gen"):
        kw["pretrained"] = False
    return fn(num_classes=10, **kw)


def _entry(spec: tuple[str, Any, int]) -> Callable[[], Scenario]:
    name, kwargs, size = spec
    backbone = isinstance(kwargs, dict) and kwargs.get("features_only", False)
    return lambda: image(lambda: _timm(name, kwargs), size, backbone=backbone)


TIMM: dict[str, Callable[[], Scenario]] = {k: _entry(v) for k, v in TIMM_SPECS.items()}
