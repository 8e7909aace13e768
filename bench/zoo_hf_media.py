"""The calibration corpus of bench/zoo.py, part 4: transformers vision, speech and multimodal
families, and diffusers models, tiny (32x32 images unless the architecture needs more,
800-sample waveforms, 16-bin features), each trained through its own loss where it has one.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F

from zoo_hf import hf_loss, hf_model, ids_batch
from zoo_models import built

from driftcheck import Scenario

_VIT = dict(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=64)
_W2V = dict(vocab_size=16, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=64, conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3),
            num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4, mask_time_prob=0.0,
            layerdrop=0.0, pad_token_id=0, ctc_loss_reduction="mean")
_TXT = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=64, bos_token_id=1, eos_token_id=2,
            pad_token_id=0)
_VIS = dict(image_size=32, patch_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4)
_PYR = dict(num_encoder_blocks=2, depths=[1, 1], hidden_sizes=[16, 32], patch_sizes=[7, 3],
            strides=[4, 2], num_attention_heads=[1, 2], mlp_ratios=[2, 2])

# name -> (config class, model class, input kind, kwargs)
MEDIA: dict[str, tuple[str, str, str, dict[str, Any]]] = {
    "hf_deit": ("DeiTConfig", "DeiTForImageClassification", "image", _VIT),
    "hf_beit": ("BeitConfig", "BeitForImageClassification", "image", dict(
        _VIT, use_relative_position_bias=True, use_mean_pooling=True)),
    "hf_vit_mae": ("ViTMAEConfig", "ViTMAEForPreTraining", "pixels", dict(
        _VIT, decoder_hidden_size=32, decoder_num_hidden_layers=1, decoder_num_attention_heads=4,
        decoder_intermediate_size=64, mask_ratio=0.5)),
    "hf_swinv2": ("Swinv2Config", "Swinv2ForImageClassification", "image", dict(
        image_size=32, patch_size=2, embed_dim=16, depths=[1, 1], num_heads=[1, 2], window_size=4)),
    "hf_convnextv2": ("ConvNextV2Config", "ConvNextV2ForImageClassification", "image", dict(
        hidden_sizes=[16, 32], depths=[1, 1], num_stages=2)),
    "hf_segformer": ("SegformerConfig", "SegformerForSemanticSegmentation", "segment", dict(
        _PYR, sr_ratios=[2, 1], decoder_hidden_size=32)),
    "hf_mobilevitv2": ("MobileViTV2Config", "MobileViTV2ForImageClassification", "image64", dict(
        image_size=64, width_multiplier=0.25)),
    "hf_poolformer": ("PoolFormerConfig", "PoolFormerForImageClassification", "image", dict(
        hidden_sizes=[16, 32, 48, 64], depths=[1, 1, 1, 1])),
    "hf_regnet": ("RegNetConfig", "RegNetForImageClassification", "image", dict(
        embedding_size=8, hidden_sizes=[16, 32], depths=[1, 1], groups_width=8, layer_type="y")),
    "hf_bit": ("BitConfig", "BitForImageClassification", "image", dict(
        embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], num_groups=4,
        layer_type="preactivation")),
    "hf_focalnet": ("FocalNetConfig", "FocalNetForImageClassification", "image", dict(
        image_size=32, patch_size=2, embed_dim=16, depths=[1, 1], focal_levels=[2, 2],
        focal_windows=[3, 3])),
    "hf_pvt": ("PvtConfig", "PvtForImageClassification", "image", dict(
        _PYR, image_size=32, sequence_reduction_ratios=[2, 1], patch_sizes=[4, 2])),
    "hf_pvt_v2": ("PvtV2Config", "PvtV2ForImageClassification", "image", dict(_PYR, sr_ratios=[2, 1])),
    "hf_timesformer": ("TimesformerConfig", "TimesformerForVideoClassification", "video", dict(
        _VIT, num_frames=2)),
    "hf_vivit": ("VivitConfig", "VivitForVideoClassification", "video4", dict(
        _VIT, num_frames=4, tubelet_size=[2, 8, 8])),
    "hf_yolos": ("YolosConfig", "YolosForObjectDetection", "detect", dict(
        _VIT, image_size=[32, 32], num_detection_tokens=4, num_labels=3)),
    # speech
    "hf_hubert": ("HubertConfig", "HubertForCTC", "ctc", _W2V),
    "hf_wavlm": ("WavLMConfig", "WavLMForCTC", "ctc", dict(_W2V, num_buckets=16, max_bucket_distance=32)),
    "hf_data2vec_audio": ("Data2VecAudioConfig", "Data2VecAudioForCTC", "ctc", dict(
        _W2V, num_conv_pos_embeddings=3, conv_pos_kernel_size=5)),
    "hf_sew": ("SEWConfig", "SEWForCTC", "ctc", dict(_W2V, squeeze_factor=2)),
    "hf_sew_d": ("SEWDConfig", "SEWDForCTC", "ctc", dict(
        _W2V, squeeze_factor=2, position_buckets=8, max_position_embeddings=64)),
    "hf_wav2vec2_conformer": ("Wav2Vec2ConformerConfig", "Wav2Vec2ConformerForCTC", "ctc", dict(
        _W2V, position_embeddings_type="rotary", conv_depthwise_kernel_size=3)),
    "hf_speech_to_text": ("Speech2TextConfig", "Speech2TextForConditionalGeneration", "features", dict(
        vocab_size=128, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_source_positions=64,
        max_target_positions=64, conv_channels=32, input_feat_per_channel=16, num_conv_layers=2,
        conv_kernel_sizes=(5, 5), input_channels=1, pad_token_id=0, decoder_start_token_id=2,
        use_cache=False)),
    "hf_speecht5": ("SpeechT5Config", "SpeechT5ForSpeechToText", "wave_s2s", dict(
        vocab_size=128, hidden_size=32, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
        decoder_ffn_dim=64, conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3),
        num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4, mask_time_prob=0.0,
        max_text_positions=64, max_speech_positions=256, encoder_layerdrop=0.0,
        decoder_layerdrop=0.0, pad_token_id=1, decoder_start_token_id=2, use_cache=False)),
    "hf_ast": ("ASTConfig", "ASTForAudioClassification", "spectrogram", dict(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        patch_size=8, num_mel_bins=16, max_length=32, frequency_stride=8, time_stride=8)),
    # multimodal
    "hf_clip": ("CLIPConfig", "CLIPModel", "contrastive", dict(
        text_config=_TXT, vision_config=_VIS, projection_dim=16)),
    "hf_siglip": ("SiglipConfig", "SiglipModel", "contrastive", dict(
        text_config=_TXT, vision_config=_VIS)),
    "hf_blip": ("BlipConfig", "BlipForConditionalGeneration", "captions", dict(
        text_config=dict(_TXT, encoder_hidden_size=32), vision_config=_VIS, projection_dim=16)),
}


def media_batch(kind: str, g: torch.Generator) -> dict[str, Any]:
    """The inputs of one step for an input ``kind`` of MEDIA."""
    px = lambda s: torch.randn(2, 3, s, s, generator=g)  # noqa: E731
    lab = lambda n: torch.randint(0, n, (2,), generator=g)  # noqa: E731
    if kind in ("image", "image64"):
        return {"pixel_values": px(64 if kind == "image64" else 32), "labels": lab(2)}
    if kind == "pixels":
        return {"pixel_values": px(32)}
    if kind == "segment":
        return {"pixel_values": px(32), "labels": torch.randint(0, 2, (2, 32, 32), generator=g)}
    if kind == "depth":
        return {"pixel_values": px(32), "labels": torch.rand(2, 32, 32, generator=g) + 0.5}
    if kind in ("video", "video4"):
        n = 4 if kind == "video4" else 2
        return {"pixel_values": torch.randn(2, n, 3, 32, 32, generator=g), "labels": lab(2)}
    if kind == "detect":
        return {"pixel_values": px(32), "labels": [
            {"class_labels": torch.randint(0, 3, (2,), generator=g),
             "boxes": torch.rand(2, 4, generator=g) * 0.4 + 0.3} for _ in range(2)]}
    if kind == "ctc":
        return {"input_values": torch.randn(2, 800, generator=g),
                "labels": torch.randint(1, 16, (2, 8), generator=g)}
    if kind == "features":
        return {"input_features": torch.randn(2, 40, 16, generator=g),
                "labels": torch.randint(3, 128, (2, 8), generator=g)}
    if kind == "wave_s2s":
        return {"input_values": torch.randn(2, 800, generator=g),
                "labels": torch.randint(3, 128, (2, 8), generator=g)}
    if kind == "spectrogram":
        return {"input_values": torch.randn(2, 32, 16, generator=g), "labels": lab(2)}
    text = ids_batch(g)
    if kind == "captions":
        return dict(text, pixel_values=px(32))
    return {"input_ids": text["input_ids"], "attention_mask": text["attention_mask"],
            "pixel_values": px(32), "return_loss": True}


def _media(spec: tuple[str, str, str, dict[str, Any]]) -> Callable[[], Scenario]:
    config, model, kind, kwargs = spec
    if kind in ("image", "image64", "video", "video4"):
        kwargs = dict(kwargs, num_labels=2)
    return lambda: built(hf_model(config, model, kwargs), lambda g: media_batch(kind, g), hf_loss)


HF_MEDIA: dict[str, Callable[[], Scenario]] = {k: _media(v) for k, v in MEDIA.items()}


# -- diffusers -------------------------------------------------------------------------------
def _noise_loss(out: Any, _batch: Any) -> torch.Tensor:
    """MSE against a fixed "noise" target (seeded, the prediction's shape)."""
    pred = out.sample if hasattr(out, "sample") else out[0]
    target = torch.randn(pred.shape, generator=torch.Generator().manual_seed(2))
    return F.mse_loss(pred.float(), target)


def _diffusers(cls: str, kwargs: dict[str, Any], inputs: Callable[[torch.Generator], dict[str, Any]],
               loss: Callable[[Any, Any], torch.Tensor] = _noise_loss) -> Callable[[], Scenario]:
    def make() -> torch.nn.Module:
        import diffusers

        return getattr(diffusers, cls)(**kwargs)
    return lambda: built(make, inputs, loss)


def _latents(c: int = 4, s: int = 16, text: int | None = None, **extra: Any):
    def make(g: torch.Generator) -> dict[str, Any]:
        x = torch.randn(2, c, s, s, generator=g)
        b = {"sample": x, "timestep": torch.tensor([10, 500])}
        if text:
            b["encoder_hidden_states"] = torch.randn(2, 8, text, generator=g)
        return dict(b, **{k: v(g) if callable(v) else v for k, v in extra.items()})
    return make


def _transformer_latents(pooled: bool = True, c: int = 4, s: int = 8, text: int = 16):
    def make(g: torch.Generator) -> dict[str, Any]:
        x = torch.randn(2, c, s, s, generator=g)
        b = {"hidden_states": x, "timestep": torch.tensor([10, 500]),
             "encoder_hidden_states": torch.randn(2, 8, text, generator=g)}
        if pooled:
            b["pooled_projections"] = torch.randn(2, text, generator=g)
        return b
    return make


def _flux_inputs(g: torch.Generator) -> dict[str, Any]:
    x = torch.randn(2, 16, 16, generator=g)  # 4x4 latent patches, 16 channels
    ij = torch.stack(torch.meshgrid(torch.arange(4), torch.arange(4), indexing="ij"), -1).reshape(16, 2)
    return {"hidden_states": x, "encoder_hidden_states": torch.randn(2, 8, 16, generator=g),
            "pooled_projections": torch.randn(2, 16, generator=g),
            "timestep": torch.tensor([0.1, 0.5]), "img_ids": torch.cat([torch.zeros(16, 1), ij], 1).float(),
            "txt_ids": torch.zeros(8, 3)}


def _residual_loss(out: Any, _batch: Any) -> torch.Tensor:
    """ControlNet's residuals start at zero (zero-initialized convolutions): MSE against fixed
    targets, so the first step has a gradient."""
    outs = list(out.down_block_res_samples) + [out.mid_block_res_sample]
    g = torch.Generator().manual_seed(2)
    return sum(F.mse_loss(t.float(), torch.randn(t.shape, generator=g)) for t in outs)


def _recon_loss(out: Any, batch: dict[str, Any]) -> torch.Tensor:
    loss = F.mse_loss(out.sample.float(), batch["sample"].float())
    commit = getattr(out, "commit_loss", None)
    return loss + commit.float().mean() if commit is not None else loss


_UNET = dict(block_out_channels=(16, 32), layers_per_block=1, norm_num_groups=8)
_AE = dict(block_out_channels=(16, 32), down_block_types=("DownEncoderBlock2D",) * 2,
           up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4, norm_num_groups=8)
_IMG = lambda g: {"sample": torch.randn(2, 3, 32, 32, generator=g)}  # noqa: E731

DIFFUSERS: dict[str, Callable[[], Scenario]] = {
    "diffusers_unet2d_condition": _diffusers("UNet2DConditionModel", dict(
        _UNET, sample_size=16, in_channels=4, out_channels=4, cross_attention_dim=16,
        attention_head_dim=4, down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D")), _latents(text=16)),
    "diffusers_autoencoder_kl": _diffusers("AutoencoderKL", _AE, _IMG, _recon_loss),
    "diffusers_vq_model": _diffusers("VQModel", dict(_AE, num_vq_embeddings=16, vq_embed_dim=4),
                                     _IMG, _recon_loss),
    "diffusers_autoencoder_tiny": _diffusers("AutoencoderTiny", dict(
        encoder_block_out_channels=(8, 8, 8, 8), decoder_block_out_channels=(8, 8, 8, 8),
        num_encoder_blocks=(1, 1, 1, 1), num_decoder_blocks=(1, 1, 1, 1), latent_channels=4),
        _IMG, _recon_loss),
    "diffusers_controlnet": _diffusers("ControlNetModel", dict(
        _UNET, in_channels=4, cross_attention_dim=16, attention_head_dim=4,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        conditioning_embedding_out_channels=(8, 16)),
        _latents(text=16, controlnet_cond=lambda g: torch.randn(2, 3, 32, 32, generator=g)),
        _residual_loss),
    "diffusers_dit": _diffusers("DiTTransformer2DModel", dict(
        num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4, num_layers=1,
        sample_size=8, patch_size=2, num_embeds_ada_norm=1000),
        lambda g: {k: v for k, v in _transformer_latents(pooled=False)(g).items()
                   if k != "encoder_hidden_states"} | {"class_labels": torch.tensor([1, 7])}),
    "diffusers_sd3": _diffusers("SD3Transformer2DModel", dict(
        sample_size=8, patch_size=2, in_channels=4, num_layers=1, attention_head_dim=8,
        num_attention_heads=2, joint_attention_dim=16, caption_projection_dim=16,
        pooled_projection_dim=16, out_channels=4, pos_embed_max_size=16), _transformer_latents()),
    "diffusers_flux": _diffusers("FluxTransformer2DModel", dict(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=8,
        num_attention_heads=2, joint_attention_dim=16, pooled_projection_dim=16,
        axes_dims_rope=(2, 2, 4)), _flux_inputs),
}
