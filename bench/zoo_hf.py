"""The calibration corpus of bench/zoo.py, part 3: transformers text families (encoders,
decoders, encoder-decoders, state-space models), tiny, beyond driftcheck/hf's families and the
BERT/T5/GPT-2/BART of bench/architectures.py.

Each entry is ``<Model>(<Config>(**tiny))`` with the task head's own loss (labels = the input
ids, -100 on padding), eager attention, seeded weights, 2 steps of batch 2 x 16 tokens (the
second sequence padded by 3). bench/zoo_hf_media.py has the vision, speech, multimodal and
diffusers entries (it imports this one; bench/zoo.py joins both).
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from zoo_models import built, mean_square

from driftcheck import Scenario

VOCAB, SEQ, PAD = 128, 16, 0

_ENC = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=64, max_position_embeddings=64, pad_token_id=PAD)
_DEC = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=64, max_position_embeddings=64, pad_token_id=PAD, bos_token_id=1,
            eos_token_id=2, use_cache=False)
_GQA = dict(_DEC, num_key_value_heads=2)
_S2S = dict(vocab_size=VOCAB, d_model=32, encoder_layers=1, decoder_layers=1,
            encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
            decoder_ffn_dim=64, max_position_embeddings=64, pad_token_id=PAD, bos_token_id=1,
            eos_token_id=2, decoder_start_token_id=2, use_cache=False)
_T5 = dict(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_decoder_layers=1,
           num_heads=4, pad_token_id=PAD, eos_token_id=2, decoder_start_token_id=PAD, use_cache=False)

# name -> (config class, model class, kwargs): every class from transformers
TEXT: dict[str, tuple[str, str, dict[str, Any]]] = {
    # encoders (masked LM heads)
    "hf_roberta": ("RobertaConfig", "RobertaForMaskedLM", dict(_ENC, pad_token_id=1)),
    "hf_electra": ("ElectraConfig", "ElectraForMaskedLM", dict(_ENC, embedding_size=16)),
    "hf_deberta": ("DebertaConfig", "DebertaForMaskedLM", dict(_ENC, relative_attention=True,
                                                              pos_att_type=["c2p", "p2c"])),
    "hf_deberta_v2": ("DebertaV2Config", "DebertaV2ForMaskedLM", dict(
        _ENC, relative_attention=True, pos_att_type=["p2c", "c2p"], position_buckets=8,
        norm_rel_ebd="layer_norm", share_att_key=True)),
    "hf_albert": ("AlbertConfig", "AlbertForMaskedLM", dict(_ENC, embedding_size=16)),
    "hf_distilbert": ("DistilBertConfig", "DistilBertForMaskedLM", dict(
        vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, hidden_dim=64,
        max_position_embeddings=64, pad_token_id=PAD)),
    "hf_mpnet": ("MPNetConfig", "MPNetForMaskedLM", dict(_ENC, pad_token_id=1)),
    "hf_funnel": ("FunnelConfig", "FunnelForMaskedLM", dict(
        vocab_size=VOCAB, block_sizes=[1, 1], block_repeats=[1, 1], num_decoder_layers=1,
        d_model=32, n_head=4, d_head=8, d_inner=64, max_position_embeddings=64, pad_token_id=PAD)),
    "hf_convbert": ("ConvBertConfig", "ConvBertForMaskedLM", dict(_ENC, embedding_size=32,
                                                                 conv_kernel_size=3)),
    "hf_squeezebert": ("SqueezeBertConfig", "SqueezeBertForMaskedLM", dict(
        _ENC, embedding_size=32, q_groups=2, k_groups=2, v_groups=2, post_attention_groups=2,
        intermediate_groups=4, output_groups=4)),
    "hf_mobilebert": ("MobileBertConfig", "MobileBertForMaskedLM", dict(
        _ENC, embedding_size=16, intra_bottleneck_size=16, true_hidden_size=16,
        num_feedforward_networks=2, intermediate_size=32)),
    "hf_roformer": ("RoFormerConfig", "RoFormerForMaskedLM", dict(_ENC, embedding_size=32)),
    "hf_big_bird": ("BigBirdConfig", "BigBirdForMaskedLM", dict(_ENC, attention_type="original_full")),
    "hf_longformer": ("LongformerConfig", "LongformerForMaskedLM", dict(
        _ENC, pad_token_id=1, attention_window=[4, 4])),
    "hf_xlnet": ("XLNetConfig", "XLNetLMHeadModel", dict(
        vocab_size=VOCAB, d_model=32, n_layer=2, n_head=4, d_inner=64, pad_token_id=PAD,
        use_mems_train=False)),
    "hf_esm": ("EsmConfig", "EsmForMaskedLM", dict(
        _ENC, vocab_size=33, pad_token_id=1, mask_token_id=32, position_embedding_type="rotary")),
    # decoders (causal LM heads)
    "hf_gpt_neo": ("GPTNeoConfig", "GPTNeoForCausalLM", dict(
        _DEC, num_layers=2, num_heads=4, attention_types=[[["global", "local"], 1]], window_size=8)),
    "hf_gptj": ("GPTJConfig", "GPTJForCausalLM", dict(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_positions=64,
        bos_token_id=1, eos_token_id=2, use_cache=False)),
    "hf_opt": ("OPTConfig", "OPTForCausalLM", dict(_DEC, ffn_dim=64, word_embed_proj_dim=32)),
    "hf_bloom": ("BloomConfig", "BloomForCausalLM", dict(_DEC, n_layer=2, n_head=4)),
    "hf_falcon": ("FalconConfig", "FalconForCausalLM", dict(_DEC, num_kv_heads=1)),
    "hf_phi": ("PhiConfig", "PhiForCausalLM", dict(_DEC, partial_rotary_factor=0.5)),
    "hf_gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(_GQA, head_dim=8, sliding_window=8)),
    "hf_gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(_GQA, head_dim=8, sliding_window=8)),
    "hf_stablelm": ("StableLmConfig", "StableLmForCausalLM", _GQA),
    "hf_olmo2": ("Olmo2Config", "Olmo2ForCausalLM", _GQA),
    "hf_gpt_bigcode": ("GPTBigCodeConfig", "GPTBigCodeForCausalLM", dict(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, multi_query=True,
        bos_token_id=1, eos_token_id=2, use_cache=False)),
    "hf_gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(_DEC, rotary_pct=0.25)),
    "hf_mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(
        _GQA, num_local_experts=4, num_experts_per_tok=2, experts_implementation="eager")),
    "hf_qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        _GQA, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        shared_expert_intermediate_size=32, experts_implementation="eager")),
    "hf_cohere": ("CohereConfig", "CohereForCausalLM", _GQA),
    "hf_mpt": ("MptConfig", "MptForCausalLM", dict(
        vocab_size=VOCAB, d_model=32, n_heads=4, n_layers=2, expansion_ratio=2, max_seq_len=64,
        use_cache=False)),
    "hf_ctrl": ("CTRLConfig", "CTRLLMHeadModel", dict(
        vocab_size=VOCAB, n_embd=32, dff=64, n_layer=2, n_head=4, n_positions=64, use_cache=False)),
    "hf_openai_gpt": ("OpenAIGPTConfig", "OpenAIGPTLMHeadModel", dict(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64)),
    "hf_jamba": ("JambaConfig", "JambaForCausalLM", dict(
        _GQA, num_experts=2, num_experts_per_tok=1, attn_layer_period=2, attn_layer_offset=1,
        expert_layer_period=2, expert_layer_offset=1, mamba_d_state=8, mamba_d_conv=4,
        mamba_expand=2, use_mamba_kernels=False)),
    "hf_mamba": ("MambaConfig", "MambaForCausalLM", dict(
        vocab_size=VOCAB, hidden_size=32, state_size=8, num_hidden_layers=2, pad_token_id=PAD,
        use_cache=False, use_mambapy=False)),
    "hf_mamba2": ("Mamba2Config", "Mamba2ForCausalLM", dict(
        vocab_size=VOCAB, hidden_size=32, state_size=8, num_hidden_layers=2, num_heads=4,
        head_dim=16, n_groups=1, chunk_size=8, pad_token_id=PAD, use_cache=False)),
    "hf_rwkv": ("RwkvConfig", "RwkvForCausalLM", dict(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, attention_hidden_size=32,
        intermediate_size=64, context_length=64, use_cache=False)),
    "hf_recurrent_gemma": ("RecurrentGemmaConfig", "RecurrentGemmaForCausalLM", dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, lru_width=32, attention_window_size=8,
        block_types=["recurrent", "attention"], pad_token_id=PAD, use_cache=False)),
    # encoder-decoders (seq2seq heads)
    "hf_mbart": ("MBartConfig", "MBartForConditionalGeneration", _S2S),
    "hf_pegasus": ("PegasusConfig", "PegasusForConditionalGeneration", _S2S),
    "hf_marian": ("MarianConfig", "MarianMTModel", dict(_S2S, decoder_vocab_size=VOCAB)),
    "hf_led": ("LEDConfig", "LEDForConditionalGeneration", dict(
        _S2S, attention_window=[4], max_encoder_position_embeddings=64,
        max_decoder_position_embeddings=64)),
    "hf_prophetnet": ("ProphetNetConfig", "ProphetNetForConditionalGeneration", dict(
        vocab_size=VOCAB, hidden_size=32, encoder_ffn_dim=64, decoder_ffn_dim=64,
        num_encoder_layers=1, num_decoder_layers=1, num_encoder_attention_heads=4,
        num_decoder_attention_heads=4, max_position_embeddings=64, ngram=2, num_buckets=8,
        relative_max_distance=16, pad_token_id=PAD, decoder_start_token_id=2, use_cache=False)),
    "hf_umt5": ("UMT5Config", "UMT5ForConditionalGeneration", _T5),
    "hf_longt5": ("LongT5Config", "LongT5ForConditionalGeneration", dict(
        _T5, encoder_attention_type="transient-global", local_radius=4, global_block_size=4)),
    "hf_switch_transformers": ("SwitchTransformersConfig", "SwitchTransformersForConditionalGeneration",
                               dict(_T5, num_experts=4, expert_capacity=16, num_sparse_encoder_layers=1,
                                    num_sparse_decoder_layers=1, router_jitter_noise=0.0)),
}


def ids_batch(g: torch.Generator, vocab: int = VOCAB, seq: int = SEQ, pad: int = PAD,
              eos: int | None = 2) -> dict[str, torch.Tensor]:
    """Token ids of batch 2 (the second sequence padded by 3, ending in ``eos``), their
    attention mask and labels (the ids, -100 on padding)."""
    ids = torch.randint(3, vocab, (2, seq), generator=g)
    mask = torch.ones(2, seq, dtype=torch.long)
    mask[1, -3:] = 0
    if eos is not None:
        ids[0, -1], ids[1, -4] = eos, eos
    ids[1, -3:] = pad
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def hf_loss(out: Any, _batch: Any = None) -> torch.Tensor:
    loss = getattr(out, "loss", None)
    return loss if loss is not None else mean_square(out)


def hf_model(config: str, model: str, kwargs: dict[str, Any]) -> Callable[[], torch.nn.Module]:
    def make() -> torch.nn.Module:
        import transformers

        cfg = getattr(transformers, config)(**dict({"attn_implementation": "eager"}, **kwargs))
        return getattr(transformers, model)(cfg)
    return make


def _text(spec: tuple[str, str, dict[str, Any]]) -> Callable[[], Scenario]:
    config, model, kwargs = spec
    vocab = kwargs.get("vocab_size", VOCAB)
    pad = kwargs.get("pad_token_id", PAD)
    return lambda: built(hf_model(config, model, kwargs), lambda g: ids_batch(g, vocab, pad=pad),
                         hf_loss)


HF_TEXT: dict[str, Callable[[], Scenario]] = {k: _text(v) for k, v in TEXT.items()}

