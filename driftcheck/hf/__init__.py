"""Hugging Face models as Scenarios: tiny seeded families (``hf:llama``), local dirs (``hf:PATH``).

Everything is built offline: families come from tiny configs with seeded random weights, local
directories load with ``local_files_only=True``. The models are the real ``transformers`` (and
``diffusers``) classes with their task heads and their own losses, so the tracer sees the real
module tree and the real output containers (``ModelOutput``). Inputs are synthesized on CPU from a
seeded generator: token ids with attention masks and padding, pixel values, Whisper log-mel
features, raw waveforms, labels.

Choices that keep runs comparable across devices:
- ``attn_implementation="eager"``: attention is explicit matmul/softmax/matmul, the same math on
  every backend, instead of SDPA, which dispatches to a different fused kernel per device.
- MoE experts use the ``"eager"`` implementation (a loop of plain linears), not ``_grouped_mm``.
- Dropout probabilities keep their config defaults (driftcheck replays CPU dropout masks); the
  RNG-driven *structural* randomness is turned off instead: wav2vec2 ``layerdrop`` (skips whole
  layers from ``torch.rand``) and SpecAugment ``mask_time_prob`` (masks drawn with ``np.random``,
  which no torch seed controls).
- ``use_cache=False``: training needs no KV cache, and a ``Cache`` object in the output is not a
  tensor container a tracer can walk.
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from driftcheck.errors import DriftcheckError
from driftcheck.hf.batches import IMAGE_SIZE, ctc_batch, image_batch, speech_batch, text_batch
from driftcheck.scenario import Scenario

if TYPE_CHECKING:  # torch is imported only once the device is known (torch_tpu autoload)
    import torch
    from torch import nn

FAMILIES: dict[str, str] = {
    "llama": "LlamaForCausalLM: RMSNorm, RoPE, grouped-query attention, SwiGLU",
    "qwen2": "Qwen2ForCausalLM: Llama-style decoder with biased q/k/v projections",
    "qwen3": "Qwen3ForCausalLM: per-head q/k RMSNorm, explicit head_dim",
    "gemma": "GemmaForCausalLM: scaled embeddings, (1 + w) RMSNorm, tanh-GELU MLP",
    "mistral": "MistralForCausalLM: sliding-window grouped-query attention decoder",
    "deepseek_v3": "DeepseekV3ForCausalLM: multi-head latent attention, grouped top-k MoE routing",
    "vit": "ViTForImageClassification: patch-embedding vision transformer",
    "resnet": "ResNetForImageClassification: convolutions with BatchNorm (running statistics)",
    "convnext": "ConvNextForImageClassification: depthwise convolutions, LayerNorm, layer scale",
    "dinov2": "Dinov2ForImageClassification: ViT with layer scale and interpolated positions",
    "whisper": "WhisperForConditionalGeneration: log-mel speech encoder-decoder (seq2seq loss)",
    "wav2vec2": "Wav2Vec2ForCTC: raw-waveform convolutions, GroupNorm, weight-norm conv, CTC loss",
    "unet": "diffusers UNet2DModel: DDPM noise prediction, GroupNorm, attention (needs diffusers)",
}

_BATCH = 2
_LR = 1e-3

# Shared by all decoder-only families: 2 layers, 4 heads (2 KV heads), hidden 32, vocab 128.
_DECODER: dict[str, Any] = dict(
    vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    pad_token_id=0, bos_token_id=1, eos_token_id=2, use_cache=False, attn_implementation="eager",
)

# family -> (config class, head class, config kwargs)
_TINY: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", _DECODER),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", _DECODER),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {**_DECODER, "head_dim": 8}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {**_DECODER, "head_dim": 8}),
    # window 8 < _SEQ so the sliding-window mask is really exercised
    "mistral": ("MistralConfig", "MistralForCausalLM", {**_DECODER, "sliding_window": 8}),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", {
        **_DECODER, "num_key_value_heads": 4, "first_k_dense_replace": 1,  # layer 0 dense, 1 MoE
        "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2,
        "n_group": 2, "topk_group": 1, "moe_intermediate_size": 16,
        "kv_lora_rank": 16, "q_lora_rank": 24, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
        "v_head_dim": 8, "experts_implementation": "eager"}),
    "vit": ("ViTConfig", "ViTForImageClassification", dict(
        image_size=IMAGE_SIZE, patch_size=8, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=4, intermediate_size=64, num_labels=10, attn_implementation="eager")),
    "resnet": ("ResNetConfig", "ResNetForImageClassification", dict(
        embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], layer_type="basic",
        num_labels=10)),
    "convnext": ("ConvNextConfig", "ConvNextForImageClassification", dict(
        hidden_sizes=[16, 32], depths=[1, 1], num_stages=2, patch_size=4, num_labels=10)),
    "dinov2": ("Dinov2Config", "Dinov2ForImageClassification", dict(
        image_size=IMAGE_SIZE, patch_size=8, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=4, mlp_ratio=2, num_labels=10, attn_implementation="eager")),
    "whisper": ("WhisperConfig", "WhisperForConditionalGeneration", dict(
        vocab_size=128, num_mel_bins=16, d_model=32, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
        decoder_ffn_dim=64, max_source_positions=16, max_target_positions=32, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, decoder_start_token_id=1, use_cache=False,
        attn_implementation="eager")),
    "wav2vec2": ("Wav2Vec2Config", "Wav2Vec2ForCTC", dict(
        vocab_size=32, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3),
        num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4, pad_token_id=0,
        ctc_loss_reduction="mean", layerdrop=0.0, mask_time_prob=0.0,
        attn_implementation="eager")),
}


def is_available() -> bool:
    """Whether ``transformers`` is importable (the ``hf`` extra is installed)."""
    return importlib.util.find_spec("transformers") is not None


def build(family: str, seed: int = 0) -> Scenario:
    """Build the tiny ``family`` model with seeded random weights and two seeded training batches.

    Args:
        family: a key of ``FAMILIES`` (``"llama"``, ``"resnet"``, ``"whisper"``, ...).
        seed: seeds the weights (``torch.manual_seed``) and the inputs (a CPU generator).

    Returns:
        A Scenario on CPU in float32: the task-head model in train mode, 2 per-step batches of
        keyword args, the model's own loss, AdamW, ``steps=2``.

    Example:
        >>> scenario = build("llama", seed=0)
        >>> out = scenario.model(**scenario.batch(0)); out.loss.backward()
    """
    if family not in FAMILIES:
        raise DriftcheckError(
            f"unknown Hugging Face family 'hf:{family}' (known: {', '.join(FAMILIES)}); "
            "for a local model directory give hf:PATH to a folder with config.json")
    if family == "unet":
        return _build_unet(seed)
    transformers = _transformers(family)
    config_cls, head_cls, kwargs = _TINY[family]
    config = getattr(transformers, config_cls)(**kwargs)
    with _seeded(seed):
        model = getattr(transformers, head_cls)(config)
    return _scenario(model, f"hf:{family}", seed)


def build_from_path(path: str, seed: int = 0) -> Scenario:
    """Load a local Hugging Face model directory (``config.json`` + weights) as a Scenario.

    The task head comes from ``config.architectures`` (or, failing that, the model type): causal
    LM, image classification, Whisper seq2seq or CTC. Inputs are synthesized from the config
    (vocabulary, image size, channels, mel bins, ...). Nothing is downloaded. Weights missing from
    the checkpoint (a head on a base model) are initialized from ``seed``.

    Args:
        path: the directory, as written by ``model.save_pretrained(path)``.
        seed: seeds any newly initialized weights and the synthesized inputs.
    """
    path = os.path.expanduser(path)
    if not os.path.isdir(path):
        raise DriftcheckError(f"hf:{path}: no such directory; give hf:<family> "
                              f"({', '.join(FAMILIES)}) or hf:PATH to a save_pretrained() folder")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise DriftcheckError(f"hf:{path}: no config.json in the directory; write it with "
                              "model.save_pretrained(PATH)")
    weights = [f for f in os.listdir(path) if f.endswith((".safetensors", ".bin"))]
    if not weights:
        raise DriftcheckError(f"hf:{path}: no weights (*.safetensors or *.bin) next to "
                              "config.json; write them with model.save_pretrained(PATH)")
    transformers = _transformers(path)
    try:
        config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError) as err:
        raise DriftcheckError(f"hf:{path}: unreadable config.json ({_first_line(err)})") from err
    head = _head_class(transformers, config, path)
    import torch

    bars = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()
    try:
        with _seeded(seed):
            # eager attention / experts: same choices as the tiny families (module docstring)
            model = head.from_pretrained(path, local_files_only=True, dtype=torch.float32,
                                         attn_implementation="eager",
                                         experts_implementation="eager")
    except (OSError, ValueError, RuntimeError) as err:
        raise DriftcheckError(
            f"hf:{path}: cannot load {head.__name__} ({_first_line(err)})") from err
    finally:
        if bars:
            transformers.utils.logging.enable_progress_bar()
    if hasattr(model.config, "use_cache"):
        model.config.use_cache = False
    return _scenario(model, f"hf:{path}", seed)


def resolve(spec: str, seed: int = 0) -> Scenario:
    """``hf:<family>`` or ``hf:PATH`` (the part after ``hf:``) -> Scenario."""
    if spec in FAMILIES:
        return build(spec, seed)
    if os.path.sep in spec or os.path.isdir(os.path.expanduser(spec)):
        return build_from_path(spec, seed)
    return build(spec, seed)  # raises the unknown-family error with the list


# --- model loss and optimizer (module level: picklable, named in tracebacks) ----------------------

def model_loss(output: Any, batch: Any) -> torch.Tensor:
    """The model's own loss (``output.loss``, computed from the batch's ``labels``)."""
    loss = getattr(output, "loss", None)
    if loss is None:
        raise DriftcheckError("the Hugging Face model returned no loss: its batch needs `labels`")
    return loss


def adamw(params: Any) -> torch.optim.Optimizer:
    """AdamW with lr 1e-3 and the default weight decay."""
    import torch

    return torch.optim.AdamW(params, lr=_LR)


# --- internals ------------------------------------------------------------------------------------

def _transformers(what: str) -> Any:
    if not is_available():
        raise DriftcheckError(f"hf:{what} needs transformers: pip install transformers (from a "
                              "driftcheck checkout: pip install -e \".[hf]\")")
    import transformers

    return transformers


@contextlib.contextmanager
def _seeded(seed: int) -> Iterator[None]:
    """Seed construction-time init without disturbing the caller's global CPU RNG stream."""
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


_HEADS = {"ForCausalLM": "causal_lm", "ForImageClassification": "image", "ForCTC": "ctc",
          "ForConditionalGeneration": "speech_seq2seq"}


def _task(model: nn.Module) -> str:
    name = type(model).__name__
    for suffix, task in _HEADS.items():
        if name.endswith(suffix):
            return task
    raise AssertionError(name)


def _head_class(transformers: Any, config: Any, path: str) -> Any:  # a transformers model class
    """The task head: from ``config.architectures`` when it names one, else from the model type."""
    for arch in getattr(config, "architectures", None) or []:
        cls = getattr(transformers, arch, None)
        if cls is not None and _supported(arch, config):
            return cls
    for auto in ("AutoModelForCausalLM", "AutoModelForImageClassification", "AutoModelForCTC",
                 "AutoModelForSpeechSeq2Seq"):
        mapping = getattr(transformers, auto)._model_mapping
        if type(config) in mapping:
            cls = mapping[type(config)]
            if _supported(cls.__name__, config):
                return cls
    raise DriftcheckError(
        f"hf:{path}: no supported task head for model type '{config.model_type}' "
        f"(architectures {getattr(config, 'architectures', None)}); supported heads: *ForCausalLM, "
        "*ForImageClassification, *ForCTC, WhisperForConditionalGeneration")


def _supported(arch: str, config: Any) -> bool:
    if arch.endswith("ForConditionalGeneration"):
        return config.model_type == "whisper"  # the only seq2seq inputs synthesized here
    return any(arch.endswith(suffix) for suffix in _HEADS)


def _scenario(model: nn.Module, name: str, seed: int) -> Scenario:
    import torch

    model.train()  # from_pretrained returns eval mode; a training step needs dropout/BN training
    task = _task(model)
    make = {"causal_lm": text_batch, "image": image_batch, "ctc": ctc_batch,
            "speech_seq2seq": speech_batch}[task]
    generator = torch.Generator().manual_seed(seed)
    inputs = [make(model, generator) for _ in range(2)]
    return Scenario(model=model, inputs=inputs, loss=model_loss, optimizer=adamw, steps=2,
                    name=name)


# --- diffusion (diffusers) ------------------------------------------------------------------------

def _build_unet(seed: int) -> Scenario:
    if importlib.util.find_spec("diffusers") is None:
        raise DriftcheckError("hf:unet needs diffusers: pip install diffusers")
    import torch
    from diffusers import UNet2DModel
    from diffusers.models.attention_processor import AttnProcessor

    with _seeded(seed):
        unet: Any = UNet2DModel(  # a diffusers ModelMixin (an nn.Module mypy cannot see as one)
            sample_size=16, in_channels=3, out_channels=3, layers_per_block=1,
            block_out_channels=(8, 16), down_block_types=("DownBlock2D", "AttnDownBlock2D"),
            up_block_types=("AttnUpBlock2D", "UpBlock2D"), norm_num_groups=4, attention_head_dim=8)
    for module in unet.modules():  # explicit matmul attention, as "eager" above, not SDPA
        if hasattr(module, "set_processor"):
            module.set_processor(AttnProcessor())
    model = _noise_prediction_class()(unet)
    model.train()
    generator = torch.Generator().manual_seed(seed)
    inputs = []
    for _ in range(2):
        clean = torch.rand(_BATCH, 3, 16, 16, generator=generator) * 2 - 1
        noise = torch.randn(clean.shape, generator=generator)
        timestep = torch.randint(0, 1000, (_BATCH,), generator=generator)
        inputs.append({"clean": clean, "noise": noise, "timestep": timestep})
    return Scenario(model=model, inputs=inputs, loss=noise_mse, optimizer=adamw, steps=2,
                    name="hf:unet")


def noise_mse(output: Any, batch: Any) -> torch.Tensor:
    """Diffusion training loss: MSE between the predicted and the added noise, in float32."""
    return (output.sample.float() - batch["noise"].float()).pow(2).mean()


_NOISE_PREDICTION: type | None = None


def _noise_prediction_class() -> type:
    """A DDPM training step as a module: add noise at ``timestep`` (linear betas), predict it."""
    global _NOISE_PREDICTION
    if _NOISE_PREDICTION is None:
        import torch
        from torch import nn

        class NoisePrediction(nn.Module):
            alphas_cumprod: torch.Tensor  # a buffer

            def __init__(self, unet: nn.Module) -> None:
                super().__init__()
                self.unet = unet
                alphas_cumprod = torch.cumprod(1 - torch.linspace(1e-4, 0.02, 1000), dim=0)
                self.register_buffer("alphas_cumprod", alphas_cumprod, persistent=False)

            def forward(self, clean: torch.Tensor, noise: torch.Tensor,
                        timestep: torch.Tensor) -> Any:
                abar = self.alphas_cumprod[timestep].view(-1, 1, 1, 1)  # (B, 1, 1, 1)
                noisy = abar.sqrt() * clean + (1 - abar).sqrt() * noise
                return self.unet(noisy, timestep)

        _NOISE_PREDICTION = NoisePrediction
    return _NOISE_PREDICTION
