"""The calibration corpus of bench/zoo.py, part 5: the families parts 1-4 lack, tiny, with the
same conventions (seeded weights, 2 AdamW steps on batch 2, each model's own loss): decoder LMs
beyond the built-in hf: families, mixture-of-experts models with their router outputs
(output_router_logits=True, the auxiliary loss added where the config has one), video networks
(torchvision's video ResNets at 1/8 width, MViT v2, Swin3D; VideoMAE, X-CLIP), multi-branch and
multi-resolution networks (HRNet, CrossViT, Inception v3 and GoogLeNet at 1/8 width, SelecSLS,
ResNeSt, InceptionNeXt), outlook, linear, LSH, Nystrom, Fourier and latent cross-attention (VOLO,
EfficientViT, Reformer with its reversible layers, Nystromformer, YOSO, FNet, Perceiver),
conv-attention hybrids (CvT, MobileViT, GCViT, DaViT, lambda, halo and bottleneck-attention
ResNets, TinyViT, MViT v2), set-prediction detectors trained through their Hungarian matching
(DETR, Conditional/Deformable/DAB-DETR, Table Transformer, RT-DETR, on a tiny ResNet backbone) and
encoders with extra inputs (boxes, xpaths, character hashes, language adapters). torchvision's
fixed-width constructors are narrowed through their own arguments (a conv_block / inception block
of 1/8 the channels) or, for VideoResNet, a subclass whose layers are 1/8 as wide; nothing of the
libraries is patched. bench/zoo.py joins the table MORE into its catalogue.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
import zoo_timm
from zoo_hf import _DEC, _ENC, _GQA, _S2S, PAD, SEQ, VOCAB, _text, hf_loss, hf_model, ids_batch
from zoo_hf_media import _TXT, _VIS, _VIT, _media
from zoo_models import built, image, logits_of

from driftcheck import Scenario

_EAGER = dict(experts_implementation="eager")
_ROUTER = dict(output_router_logits=True, router_aux_loss_coef=0.01)

# -- transformers text: decoders, mixture-of-experts, encoders ---------------------------------
# name -> (config class, model class, kwargs), as zoo_hf.TEXT
TEXT: dict[str, tuple[str, str, dict[str, Any]]] = {
    # decoders (causal LM heads)
    "hf_qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(_GQA, head_dim=8)),
    "hf_granite": ("GraniteConfig", "GraniteForCausalLM", dict(
        _GQA, embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.125,
        logits_scaling=8.0)),
    "hf_olmo": ("OlmoConfig", "OlmoForCausalLM", dict(_GQA, clip_qkv=8.0)),
    "hf_phi3": ("Phi3Config", "Phi3ForCausalLM", dict(_GQA, partial_rotary_factor=0.5)),
    "hf_starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", dict(
        _GQA, sliding_window=8, use_bias=True)),
    "hf_persimmon": ("PersimmonConfig", "PersimmonForCausalLM", dict(
        _DEC, qk_layernorm=True, partial_rotary_factor=0.5)),
    "hf_nemotron": ("NemotronConfig", "NemotronForCausalLM", dict(
        _GQA, head_dim=8, partial_rotary_factor=0.5)),
    "hf_glm": ("GlmConfig", "GlmForCausalLM", dict(_GQA, head_dim=8)),
    "hf_glm4": ("Glm4Config", "Glm4ForCausalLM", dict(_GQA, head_dim=8)),
    "hf_helium": ("HeliumConfig", "HeliumForCausalLM", dict(_GQA, head_dim=8)),
    "hf_codegen": ("CodeGenConfig", "CodeGenForCausalLM", dict(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_positions=64, n_ctx=64,
        bos_token_id=1, eos_token_id=2, pad_token_id=PAD, use_cache=False)),
    "hf_xglm": ("XGLMConfig", "XGLMForCausalLM", dict(
        vocab_size=VOCAB, d_model=32, num_layers=2, attention_heads=4, ffn_dim=64,
        max_position_embeddings=64, layerdrop=0.0, pad_token_id=PAD, bos_token_id=1,
        eos_token_id=2, use_cache=False)),
    "hf_biogpt": ("BioGptConfig", "BioGptForCausalLM", dict(_DEC, layerdrop=0.0)),
    "hf_cohere2": ("Cohere2Config", "Cohere2ForCausalLM", dict(
        _GQA, head_dim=8, sliding_window=8, layer_types=["sliding_attention", "full_attention"])),
    "hf_diffllama": ("DiffLlamaConfig", "DiffLlamaForCausalLM", _GQA),
    "hf_apertus": ("ApertusConfig", "ApertusForCausalLM", _GQA),
    "hf_smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", dict(_GQA, no_rope_layers=[1, 0])),
    "hf_olmo3": ("Olmo3Config", "Olmo3ForCausalLM", dict(
        _GQA, sliding_window=8, layer_types=["sliding_attention", "full_attention"])),
    "hf_seed_oss": ("SeedOssConfig", "SeedOssForCausalLM", dict(_GQA, head_dim=8)),
    "hf_arcee": ("ArceeConfig", "ArceeForCausalLM", _GQA),
    "hf_ernie4_5": ("Ernie4_5Config", "Ernie4_5ForCausalLM", dict(_GQA, head_dim=8)),
    "hf_hunyuan_dense": ("HunYuanDenseV1Config", "HunYuanDenseV1ForCausalLM", dict(_GQA, head_dim=8)),
    "hf_bitnet": ("BitNetConfig", "BitNetForCausalLM", _GQA),
    "hf_lfm2": ("Lfm2Config", "Lfm2ForCausalLM", dict(
        _GQA, layer_types=["conv", "full_attention"], conv_L_cache=3)),
    "hf_falcon_h1": ("FalconH1Config", "FalconH1ForCausalLM", dict(
        _GQA, head_dim=8, mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8, mamba_n_groups=1,
        mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=8)),
    # mixture of experts (router logits out, auxiliary loss added to the LM loss)
    "hf_qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        _GQA, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        **_ROUTER, **_EAGER)),
    "hf_olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(
        _GQA, num_experts=4, num_experts_per_tok=2, **_ROUTER, **_EAGER)),
    "hf_granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM", dict(
        _GQA, num_local_experts=4, num_experts_per_tok=2, **_ROUTER, **_EAGER)),
    "hf_granitemoe_shared": ("GraniteMoeSharedConfig", "GraniteMoeSharedForCausalLM", dict(
        _GQA, num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=32,
        **_ROUTER, **_EAGER)),
    "hf_phimoe": ("PhimoeConfig", "PhimoeForCausalLM", dict(
        _GQA, num_local_experts=4, num_experts_per_tok=2, **_ROUTER, **_EAGER)),
    "hf_dbrx": ("DbrxConfig", "DbrxForCausalLM", dict(
        vocab_size=VOCAB, d_model=32, n_heads=4, n_layers=2, max_seq_len=64,
        attn_config=dict(kv_n_heads=2, clip_qkv=8.0, rope_theta=10000.0),
        ffn_config=dict(ffn_hidden_size=32, moe_num_experts=4, moe_top_k=2, moe_loss_weight=0.01),
        output_router_logits=True, pad_token_id=PAD, bos_token_id=1, eos_token_id=2,
        use_cache=False, **_EAGER)),
    "hf_deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(
        _DEC, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=8, n_routed_experts=4, n_shared_experts=1,
        num_experts_per_tok=2, moe_intermediate_size=16, first_k_dense_replace=1, n_group=1,
        topk_group=1, **_EAGER)),
    "hf_gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(
        _GQA, head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"], **_ROUTER, **_EAGER)),
    "hf_jetmoe": ("JetMoeConfig", "JetMoeForCausalLM", dict(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_key_value_heads=2,
        kv_channels=8, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
        max_position_embeddings=64, output_router_logits=True, aux_loss_coef=0.01,
        pad_token_id=PAD, bos_token_id=1, eos_token_id=2, use_cache=False)),
    "hf_glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", dict(
        _GQA, head_dim=8, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
        moe_intermediate_size=16, first_k_dense_replace=1, n_group=1, topk_group=1, **_EAGER)),
    "hf_ernie4_5_moe": ("Ernie4_5_MoeConfig", "Ernie4_5_MoeForCausalLM", dict(
        _GQA, head_dim=8, moe_num_experts=4, moe_k=2, moe_intermediate_size=16,
        moe_num_shared_experts=1, moe_layer_start_index=1, **_ROUTER, **_EAGER)),
    "hf_hunyuan_moe": ("HunYuanMoEV1Config", "HunYuanMoEV1ForCausalLM", dict(
        _GQA, head_dim=8, num_experts=4, moe_topk=2, moe_intermediate_size=16, **_EAGER)),
    "hf_dots1": ("Dots1Config", "Dots1ForCausalLM", dict(
        _GQA, head_dim=8, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
        moe_intermediate_size=16, first_k_dense_replace=1, n_group=1, topk_group=1, **_EAGER)),
    "hf_minimax": ("MiniMaxConfig", "MiniMaxForCausalLM", dict(
        _GQA, head_dim=8, num_local_experts=4, num_experts_per_tok=2, block_size=4,
        layer_types=["linear_attention", "full_attention"], **_ROUTER, **_EAGER)),
    "hf_flex_olmo": ("FlexOlmoConfig", "FlexOlmoForCausalLM", dict(
        _GQA, num_experts=4, num_experts_per_tok=2, **_ROUTER, **_EAGER)),
    "hf_qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(
        _GQA, head_dim=8, linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=8,
        linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, shared_expert_intermediate_size=16,
        layer_types=["linear_attention", "full_attention"], **_ROUTER, **_EAGER)),
    "hf_nllb_moe": ("NllbMoeConfig", "NllbMoeForConditionalGeneration", dict(
        _S2S, num_experts=4, expert_capacity=16, encoder_sparse_step=1, decoder_sparse_step=1,
        router_dtype="float32", output_router_logits=True)),
    # encoders (masked LM heads) with other attention: LSH + reversible, Nystrom, LSH, Fourier,
    # multi-resolution, latent cross-attention
    # Reformer reseeds the global RNG from torch.seed() in each layer (for its reversible
    # backward): hashes from hash_seed and no dropout, or no two runs would agree. Its bucket
    # cache (use_cache, the config's default) is live state a local replay must not write into
    "hf_reformer": ("ReformerConfig", "ReformerModelWithLMHead", dict(
        vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, attention_head_size=8,
        attn_layers=["local", "lsh"], axial_pos_shape=[4, 4], axial_pos_embds_dim=[16, 16],
        feed_forward_size=64, local_attn_chunk_length=4, lsh_attn_chunk_length=4, num_buckets=2,
        num_hashes=1, hash_seed=0, is_decoder=True, max_position_embeddings=SEQ,
        hidden_dropout_prob=0.0, local_attention_probs_dropout_prob=0.0,
        lsh_attention_probs_dropout_prob=0.0, pad_token_id=PAD, eos_token_id=2)),
    "hf_yoso": ("YosoConfig", "YosoForMaskedLM", dict(_ENC, use_expectation=True)),
    "hf_perceiver": ("PerceiverConfig", "PerceiverForMaskedLM", dict(
        vocab_size=VOCAB, max_position_embeddings=SEQ, num_latents=8, d_latents=32, d_model=32,
        num_blocks=1, num_self_attends_per_block=1, num_self_attention_heads=4,
        num_cross_attention_heads=4, qk_channels=32, v_channels=32)),
    # encoders (masked LM heads)
    "hf_ibert": ("IBertConfig", "IBertForMaskedLM", dict(_ENC, pad_token_id=1, quant_mode=False)),
    "hf_ernie": ("ErnieConfig", "ErnieForMaskedLM", dict(_ENC, use_task_id=True, task_type_vocab_size=3)),
    "hf_rembert": ("RemBertConfig", "RemBertForMaskedLM", dict(
        _ENC, input_embedding_size=16, output_embedding_size=32)),
    "hf_megatron_bert": ("MegatronBertConfig", "MegatronBertForMaskedLM", _ENC),
    "hf_xlm_roberta_xl": ("XLMRobertaXLConfig", "XLMRobertaXLForMaskedLM", dict(_ENC, pad_token_id=1)),
    "hf_xmod": ("XmodConfig", "XmodForMaskedLM", dict(
        _ENC, pad_token_id=1, languages=["en_XX", "de_DE"], default_language="en_XX")),
    "hf_modernbert": ("ModernBertConfig", "ModernBertForMaskedLM", dict(
        _ENC, global_attn_every_n_layers=2, local_attention=8, bos_token_id=1, eos_token_id=2,
        sep_token_id=2, cls_token_id=1)),
    "hf_luke": ("LukeConfig", "LukeForMaskedLM", dict(
        _ENC, entity_vocab_size=16, entity_emb_size=16)),
}

# encoders with their own extra inputs: name -> (spec, extra inputs)
_ENC_PLUS: dict[str, tuple[tuple[str, str, dict[str, Any]], str]] = {
    # its landmark attention adds a (batch, 1, seq, seq) mask to (landmarks x seq) scores: no mask
    "hf_nystromformer": (("NystromformerConfig", "NystromformerForMaskedLM", dict(
        _ENC, num_landmarks=4, segment_means_seq_len=SEQ, conv_kernel_size=3)), "no_mask"),
    "hf_fnet": (("FNetConfig", "FNetForMaskedLM", dict(_ENC, use_tpu_fourier_optimizations=False)),
                "no_mask"),
    "hf_roc_bert": (("RoCBertConfig", "RoCBertForMaskedLM", dict(
        _ENC, shape_vocab_size=32, shape_embed_dim=16, pronunciation_vocab_size=32,
        pronunciation_embed_dim=16)), "shape_pron"),
    "hf_layoutlm": (("LayoutLMConfig", "LayoutLMForMaskedLM", dict(_ENC, max_2d_position_embeddings=128)),
                    "bbox"),
    "hf_lilt": (("LiltConfig", "LiltForTokenClassification", dict(  # hidden 48: six layout embeddings of hidden // 6
        _ENC, hidden_size=48, intermediate_size=96, max_2d_position_embeddings=128,
        num_labels=2)), "bbox_tokens"),
    "hf_bros": (("BrosConfig", "BrosForTokenClassification", dict(_ENC, dim_bbox=4, num_labels=2)),
                "bbox01_tokens"),
    "hf_markuplm": (("MarkupLMConfig", "MarkupLMForTokenClassification", dict(
        _ENC, max_depth=4, xpath_unit_hidden_size=8, max_xpath_tag_unit_embeddings=32,
        max_xpath_subs_unit_embeddings=32, tag_pad_id=31, subs_pad_id=31, num_labels=2)), "xpath_tokens"),
    "hf_canine": (("CanineConfig", "CanineForTokenClassification", dict(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=64, downsampling_rate=4, upsampling_kernel_size=4,
        num_hash_functions=4, num_hash_buckets=64, local_transformer_stride=8, num_labels=2)),
                  "tokens"),
    "hf_splinter": (("SplinterConfig", "SplinterForQuestionAnswering", dict(
        _ENC, question_token_id=104)), "qa"),
}


def _extra_inputs(kind: str, g: torch.Generator, b: dict[str, torch.Tensor]) -> dict[str, Any]:
    """``ids_batch`` plus the inputs of an encoder of ``_ENC_PLUS`` (drawn from the same generator)."""
    mask = b["attention_mask"]
    if kind == "no_mask":  # FNet mixes tokens by a Fourier transform: no attention mask
        return {"input_ids": b["input_ids"], "labels": b["labels"]}
    if kind == "shape_pron":
        return dict(b, input_shape_ids=torch.randint(0, 32, (2, SEQ), generator=g),
                    input_pronunciation_ids=torch.randint(0, 32, (2, SEQ), generator=g))
    if kind == "qa":
        ids = b["input_ids"].clone()
        ids[:, 1] = 104  # the question token
        return {"input_ids": ids, "attention_mask": mask,
                "start_positions": torch.tensor([4, 6]), "end_positions": torch.tensor([7, 9])}
    if kind.endswith("tokens"):  # token classification: 2 labels, -100 on padding
        b = dict(b, labels=torch.randint(0, 2, (2, SEQ), generator=g).masked_fill(mask == 0, -100))
    if kind.startswith("bbox01"):  # normalized (x0, y0, x1, y1)
        b["bbox"] = torch.rand(2, SEQ, 4, generator=g)
    elif kind.startswith("bbox"):  # (x0, y0, x1, y1) on a 0..127 grid
        x0 = torch.randint(0, 64, (2, SEQ, 2), generator=g)
        b["bbox"] = torch.cat([x0, x0 + torch.randint(0, 64, (2, SEQ, 2), generator=g)], -1)
    elif kind.startswith("xpath"):
        b["xpath_tags_seq"] = torch.randint(0, 31, (2, SEQ, 4), generator=g)
        b["xpath_subs_seq"] = torch.randint(0, 31, (2, SEQ, 4), generator=g)
    return b


def _text_plus(spec: tuple[str, str, dict[str, Any]], kind: str) -> Callable[[], Scenario]:
    config, model, kwargs = spec
    pad = kwargs.get("pad_token_id", PAD)
    return lambda: built(hf_model(config, model, kwargs),
                         lambda g: _extra_inputs(kind, g, ids_batch(g, VOCAB, pad=pad)), hf_loss)


# -- transformers vision, video, detection -----------------------------------------------------
_RESNET = dict(model_type="resnet", embedding_size=8, hidden_sizes=[8, 16, 16, 32], depths=[1, 1, 1, 1],
               layer_type="basic", out_features=["stage4"])
_DETR = dict(num_queries=4, num_labels=3, d_model=32, encoder_layers=1, decoder_layers=1,
             encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
             decoder_ffn_dim=64, backbone_config=_RESNET)

# name -> (config class, model class, input kind of zoo_hf_media.media_batch, kwargs)
MEDIA: dict[str, tuple[str, str, str, dict[str, Any]]] = {
    "hf_videomae": ("VideoMAEConfig", "VideoMAEForVideoClassification", "video4", dict(
        _VIT, num_frames=4, tubelet_size=2)),
    "hf_cvt": ("CvtConfig", "CvtForImageClassification", "image", dict(
        embed_dim=[16, 32], num_heads=[1, 2], depth=[1, 2], patch_sizes=[7, 3], patch_stride=[4, 2],
        patch_padding=[2, 1], mlp_ratio=[2.0, 2.0], attention_drop_rate=[0.0, 0.0],
        drop_rate=[0.0, 0.0], drop_path_rate=[0.0, 0.0], qkv_bias=[True, True],
        cls_token=[False, True], qkv_projection_method=["dw_bn", "dw_bn"], kernel_qkv=[3, 3],
        padding_kv=[1, 1], stride_kv=[2, 2], padding_q=[1, 1], stride_q=[1, 1])),
    "hf_mobilevit": ("MobileViTConfig", "MobileViTForImageClassification", "image64", dict(
        image_size=64, hidden_sizes=[16, 24, 32], neck_hidden_sizes=[8, 8, 16, 16, 24, 32, 64],
        expand_ratio=2.0)),
    "hf_perceiver_image": ("PerceiverConfig", "PerceiverForImageClassificationLearned", "image", dict(
        image_size=32, num_latents=8, d_latents=32, d_model=32, num_blocks=1,
        num_self_attends_per_block=1, num_self_attention_heads=4, num_cross_attention_heads=1,
        qk_channels=32, v_channels=32)),
    "hf_detr": ("DetrConfig", "DetrForObjectDetection", "detect", _DETR),
    "hf_conditional_detr": ("ConditionalDetrConfig", "ConditionalDetrForObjectDetection", "detect", _DETR),
    "hf_dab_detr": ("DabDetrConfig", "DabDetrForObjectDetection", "detect", dict(
        _DETR, hidden_size=32)),
    "hf_table_transformer": ("TableTransformerConfig", "TableTransformerForObjectDetection", "detect", _DETR),
    "hf_deformable_detr": ("DeformableDetrConfig", "DeformableDetrForObjectDetection", "detect", dict(
        _DETR, backbone_config=dict(_RESNET, out_features=["stage2", "stage3", "stage4"]),
        decoder_layers=2, num_feature_levels=3, encoder_n_points=2, decoder_n_points=2)),
    "hf_rt_detr": ("RTDetrConfig", "RTDetrForObjectDetection", "detect", dict(
        backbone_config=dict(model_type="rt_detr_resnet", embedding_size=8, hidden_sizes=[8, 16, 16, 32],
                             depths=[1, 1, 1, 1], layer_type="basic",
                             out_features=["stage2", "stage3", "stage4"]),
        encoder_in_channels=[16, 16, 32], encoder_hidden_dim=32, encoder_ffn_dim=64,
        encoder_attention_heads=4, d_model=32, decoder_in_channels=[32, 32, 32],
        decoder_ffn_dim=64, decoder_attention_heads=4, decoder_layers=1, decoder_n_points=2,
        num_queries=8, num_denoising=4, num_labels=3, anchor_image_size=None)),
}


def _xclip_batch(g: torch.Generator) -> dict[str, Any]:
    text = ids_batch(g)
    return {"input_ids": text["input_ids"], "attention_mask": text["attention_mask"],
            "pixel_values": torch.randn(2, 2, 3, 32, 32, generator=g), "return_loss": True}


def _xclip() -> Scenario:
    kwargs = dict(text_config=_TXT, vision_config=dict(
        _VIS, mit_hidden_size=32, mit_intermediate_size=64, mit_num_attention_heads=4, num_frames=2),
        projection_dim=32, prompt_num_attention_heads=4)
    return built(hf_model("XCLIPConfig", "XCLIPModel", kwargs), _xclip_batch, hf_loss)


# -- torchvision: video networks, Inception v3 and GoogLeNet narrowed -------------------------
def _clip(make: Callable[[], torch.nn.Module], frames: int = 4, size: int = 32) -> Scenario:
    """Clips (batch 2, 3 x frames x size x size), cross-entropy on 10 classes (labels fixed)."""
    y = torch.randint(0, 10, (2,), generator=torch.Generator().manual_seed(1))
    return built(make, lambda g: torch.randn(2, 3, frames, size, size, generator=g),
                 lambda out, _x: F.cross_entropy(logits_of(out), y))


def _tv_video_resnet(kind: str, width: int = 8):
    """r3d_18 / mc3_18 / r2plus1d_18 of torchvision, one block per stage and 1/8 as wide (its
    constructor hardcodes 64..512 channels: the subclass divides the planes of each layer; the
    stem mirrors torchvision's BasicStem / R2Plus1dStem at that width)."""
    from torch import nn
    from torchvision.models.video import resnet as r

    class NarrowVideoResNet(r.VideoResNet):
        def _make_layer(self, block, conv_builder, planes, blocks, stride=1):
            if planes == 64:
                self.inplanes = width
            return super()._make_layer(block, conv_builder, planes * width // 64, blocks, stride)

    def stem():
        if kind == "r2plus1d":
            mid = width * 45 // 64
            return nn.Sequential(
                nn.Conv3d(3, mid, (1, 7, 7), (1, 2, 2), (0, 3, 3), bias=False), nn.BatchNorm3d(mid),
                nn.ReLU(inplace=True), nn.Conv3d(mid, width, (3, 1, 1), 1, (1, 0, 0), bias=False),
                nn.BatchNorm3d(width), nn.ReLU(inplace=True))
        return nn.Sequential(nn.Conv3d(3, width, (3, 7, 7), (1, 2, 2), (1, 3, 3), bias=False),
                             nn.BatchNorm3d(width), nn.ReLU(inplace=True))

    makers = {"r3d": [r.Conv3DSimple] * 4, "mc3": [r.Conv3DSimple] + [r.Conv3DNoTemporal] * 3,
              "r2plus1d": [r.Conv2Plus1D] * 4}[kind]
    model = NarrowVideoResNet(r.BasicBlock, makers, [1, 1, 1, 1], stem, num_classes=10)
    model.fc = nn.Linear(width * 8, 10)
    nn.init.normal_(model.fc.weight, 0, 0.01)
    nn.init.zeros_(model.fc.bias)
    return model


def _tv_mvit():
    from torchvision.models.video.mvit import MSBlockConfig, MViT

    blocks = [MSBlockConfig(1, 16, 16, [3, 3, 3], [3, 3, 3], [1, 1, 1], [1, 2, 2]),
              MSBlockConfig(1, 16, 32, [3, 3, 3], [3, 3, 3], [1, 2, 2], [1, 1, 1]),
              MSBlockConfig(2, 32, 32, [3, 3, 3], [3, 3, 3], [1, 1, 1], [1, 1, 1])]
    # mvit_v2_s: pooled residual, relative positions, projection after attention
    return MViT((32, 32), 4, blocks, residual_pool=True, residual_with_cls_embed=False,
                rel_pos_embed=True, proj_after_attn=True, stochastic_depth_prob=0.0, num_classes=10)


def _tv_swin3d():
    from torchvision.models.video.swin_transformer import SwinTransformer3d

    return SwinTransformer3d(patch_size=[2, 4, 4], embed_dim=16, depths=[1, 1], num_heads=[1, 2],
                             window_size=[2, 4, 4], stochastic_depth_prob=0.0, num_classes=10)


def _narrow_conv(k: int = 8):
    from torchvision.models.inception import BasicConv2d

    return lambda i, o, **kw: BasicConv2d(i if i == 3 else i // k, o // k, **kw)


def _tv_googlenet():
    """GoogLeNet at 1/8 width through its ``blocks`` argument (every channel count divides)."""
    from torch import nn
    from torchvision.models.googlenet import GoogLeNet, Inception, InceptionAux

    model = GoogLeNet(num_classes=10, aux_logits=False, init_weights=True, blocks=[
        _narrow_conv(), lambda *chs: Inception(*(c // 8 for c in chs)), InceptionAux])
    model.fc = nn.Linear(1024 // 8, 10)
    return model


def _tv_inception_v3():
    """Inception v3 at 1/8 width through its ``inception_blocks`` argument."""
    import functools

    from torch import nn
    from torchvision.models import inception as m

    conv = _narrow_conv()
    blocks = [conv] + [functools.partial(b, conv_block=conv) for b in (
        m.InceptionA, m.InceptionB, m.InceptionC, m.InceptionD, m.InceptionE, m.InceptionAux)]
    model = m.Inception3(num_classes=10, aux_logits=False, init_weights=True, inception_blocks=blocks)
    model.fc = nn.Linear(2048 // 8, 10)
    return model


# -- timm --------------------------------------------------------------------------------------
def _hrnet_cfg():
    def stage(n: int, block: str = "BASIC"):
        return dict(num_modules=1, num_branches=n, block_type=block, num_blocks=(1,) * n,
                    num_channels=(8, 16, 32, 64)[:n], fuse_method="SUM")
    return dict(stem_width=16, stage1=stage(1, "BOTTLENECK"), stage2=stage(2), stage3=stage(3),
                stage4=stage(4))


def _selecsls_cfg():
    from timm.models.selecsls import SelecSlsBlock

    return dict(block=SelecSlsBlock,
                features=[(32, 0, 16, 16, True, 2), (16, 16, 16, 32, False, 1),
                          (32, 0, 32, 32, True, 2), (32, 32, 32, 48, False, 1)],
                head=[(48, 64, 3, 2), (64, 64, 1, 1)], num_features=64,
                feature_info=[dict(num_chs=32, reduction=2, module="stem.2"),
                              dict(num_chs=32, reduction=4, module="features.1"),
                              dict(num_chs=48, reduction=8, module="features.3"),
                              dict(num_chs=64, reduction=16, module="head.1")])


def _byoa(kind: str):
    """Tiny ByobNet configs of timm's attention ResNets: lambda, halo, bottleneck (BoTNet) and
    MobileViT blocks."""
    from timm.models.byobnet import ByoBlockCfg, ByoModelCfg
    from timm.models.mobilevit import _inverted_residual_block, _mobilevit_block

    if kind == "mobilevit":
        return ByoModelCfg(blocks=(_inverted_residual_block(d=1, c=16, s=1, br=2.0),
                                   _inverted_residual_block(d=1, c=24, s=2, br=2.0),
                                   _mobilevit_block(d=1, c=32, s=2, transformer_dim=32,
                                                    transformer_depth=1, patch_size=2, br=2.0)),
                           stem_chs=8, stem_type="3x3", stem_pool="", downsample="",
                           act_layer="silu", num_features=64)
    attn = {"lambda": dict(r=5), "halo": dict(block_size=4, halo_size=1), "bottleneck": dict()}[kind]
    return ByoModelCfg(blocks=(ByoBlockCfg(type="bottle", d=1, c=32, s=1, gs=0, br=0.25),
                               ByoBlockCfg(type="bottle", d=1, c=64, s=2, gs=0, br=0.25),
                               ByoBlockCfg(type="self_attn", d=1, c=64, s=1, gs=0, br=0.25)),
                       stem_chs=16, stem_type="tiered", stem_pool="maxpool",
                       fixed_input_size=kind == "bottleneck", self_attn_layer=kind,
                       self_attn_kwargs=dict(attn, dim_head=8) if kind != "bottleneck" else attn)


def _mvitv2_cfg():
    from timm.models.mvitv2 import MultiScaleVitCfg

    return MultiScaleVitCfg(depths=(1, 1), embed_dim=(16, 32), num_heads=(1, 2))


# name -> (timm model name or "module.Class", kwargs or a function making them, image size), as
# zoo_timm.TIMM_SPECS
TIMM_SPECS: dict[str, tuple[str, Any, int]] = {
    "timm_crossvit": ("crossvit.CrossVit", dict(
        img_size=32, img_scale=(1.0, 1.0), patch_size=(4, 8), embed_dim=(16, 32),
        depth=((1, 1, 1),), num_heads=(2, 2), mlp_ratio=(2.0, 2.0, 2.0)), 32),
    "timm_selecsls": ("selecsls.SelecSls", lambda: dict(cfg=_selecsls_cfg()), 64),
    "timm_resnest": ("resnest14d", dict(layers=[1, 1, 1, 1], channels=(16, 32, 64, 128),
                                        stem_width=8), 64),
    "timm_inception_next": ("inception_next_atto", dict(depths=(1, 1, 1, 1), dims=(16, 32, 48, 64)), 64),
    "timm_volo": ("volo.VOLO", dict(
        layers=(1, 1, 1, 1), img_size=32, patch_size=8, stem_hidden_dim=16,
        embed_dims=(32, 64, 64, 64), num_heads=(1, 2, 2, 2), post_layers=("ca",)), 32),
    "timm_efficientvit_mit": ("efficientvit_mit.EfficientVit", dict(
        widths=(8, 16, 32, 64, 128), depths=(1, 1, 1, 1, 1), head_dim=16, head_widths=(128, 160)), 64),
    "timm_efficientvit_msra": ("efficientvit_m0", dict(
        img_size=64, embed_dim=(16, 32, 48), depth=(1, 1, 1), num_heads=(2, 2, 2),
        window_size=(2, 2, 2), kernels=(5, 5, 5, 5)), 64),
    "timm_swiftformer": ("swiftformer_xs", dict(layers=(1, 1, 1, 1), embed_dims=(16, 32, 48, 64)), 64),
    "timm_gcvit": ("gcvit.GlobalContextVit", dict(img_size=64, embed_dim=16, depths=(1, 1, 1, 1),
                                        num_heads=(1, 2, 2, 4)), 64),
    "timm_davit": ("davit_tiny", dict(depths=(1, 1, 1, 1), embed_dims=(16, 32, 48, 64),
                                      num_heads=(1, 2, 2, 4), window_size=2), 32),
    "timm_mobilevit": ("byobnet.ByobNet", lambda: dict(cfg=_byoa("mobilevit")), 64),
    "timm_lambda_resnet": ("byobnet.ByobNet", lambda: dict(cfg=_byoa("lambda")), 64),
    "timm_halonet": ("byobnet.ByobNet", lambda: dict(cfg=_byoa("halo")), 64),
    "timm_botnet": ("byobnet.ByobNet", lambda: dict(cfg=_byoa("bottleneck"), img_size=64), 64),
    "timm_tiny_vit": ("tiny_vit_5m_224", dict(embed_dims=(16, 32, 48, 64),
                                              depths=(1, 1, 1, 1), num_heads=(1, 2, 2, 4),
                                              window_sizes=(2, 2, 2, 2)), 64),
    "timm_mvitv2": ("mvitv2.MultiScaleVit", lambda: dict(cfg=_mvitv2_cfg(), img_size=(32, 32)), 32),
}

# -- the table ---------------------------------------------------------------------------------
MORE: dict[str, Callable[[], Scenario]] = {
    **{k: _text(v) for k, v in TEXT.items()},
    **{k: _text_plus(spec, kind) for k, (spec, kind) in _ENC_PLUS.items()},
    **{k: _media(v) for k, v in MEDIA.items()},
    "hf_xclip": _xclip,
    "tv_r3d": lambda: _clip(lambda: _tv_video_resnet("r3d")),
    "tv_mc3": lambda: _clip(lambda: _tv_video_resnet("mc3")),
    "tv_r2plus1d": lambda: _clip(lambda: _tv_video_resnet("r2plus1d")),
    "tv_mvit_v2": lambda: _clip(_tv_mvit),
    "tv_swin3d": lambda: _clip(_tv_swin3d),
    "tv_googlenet": lambda: image(_tv_googlenet, 64),
    "tv_inception_v3": lambda: image(_tv_inception_v3, 80),
    # HRNet without its 2048-channel classification head: the four resolution branches out
    "timm_hrnet": lambda: image(lambda: zoo_timm._timm("hrnet.HighResolutionNet", dict(
        cfg=_hrnet_cfg(), head="")), 64, backbone=True),
    **{k: zoo_timm._entry(v) for k, v in TIMM_SPECS.items()},
}
