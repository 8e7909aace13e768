"""Seeded input batches for the Hugging Face families: token ids, images, waveforms, log-mel
features and CTC labels, made on CPU from a torch.Generator."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

_BATCH = 2
_SEQ = 16  # tokens per sequence (text), decoder tokens (whisper): 8
IMAGE_SIZE = 32  # pixels, for models whose config has no image size
_CTC_FRAMES = 48  # wav2vec2 frames after the feature encoder
_SAMPLING_RATE = 16_000


def _tokens(generator: torch.Generator, shape: tuple[int, int], vocab: int,
            avoid: set[int]) -> torch.Tensor:
    """Random ids in [0, vocab) with the special ids in ``avoid`` remapped to ordinary ones."""
    import torch

    ordinary = torch.tensor([i for i in range(vocab) if i not in avoid])
    return ordinary[torch.randint(0, len(ordinary), shape, generator=generator)]


def _specials(config: Any) -> set[int]:
    ids = [getattr(config, k, None) for k in ("pad_token_id", "bos_token_id", "eos_token_id",
                                               "decoder_start_token_id")]
    flat: list[Any] = []
    for i in ids:
        flat.extend(i if isinstance(i, list) else [i])
    return {i for i in flat if isinstance(i, int)}


def text_batch(model: nn.Module, generator: torch.Generator) -> dict[str, Any]:
    """(B, T) token ids; row 1 right-padded by a quarter: mask 0, label -100."""
    config: Any = model.config  # a PretrainedConfig: its fields depend on the family
    seq = min(_SEQ, getattr(config, "max_position_embeddings", _SEQ) or _SEQ)
    pad = config.pad_token_id if config.pad_token_id is not None else 0
    ids = _tokens(generator, (_BATCH, seq), config.vocab_size, _specials(config))
    mask = ids.new_ones(ids.shape)
    mask[1, seq - seq // 4:] = 0
    ids = ids.masked_fill(mask == 0, pad)
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels, "use_cache": False}


def image_batch(model: nn.Module, generator: torch.Generator) -> dict[str, Any]:
    """Smooth random images in [0, 1] (low-res noise upsampled + grain), ImageNet-normalized."""
    import torch

    config: Any = model.config  # a PretrainedConfig: its fields depend on the family
    size = getattr(config, "image_size", IMAGE_SIZE)
    h, w = (size, size) if isinstance(size, int) else tuple(size)
    channels = getattr(config, "num_channels", 3)
    coarse = torch.rand(_BATCH, channels, max(h // 4, 1), max(w // 4, 1), generator=generator)
    images = torch.nn.functional.interpolate(coarse, size=(h, w), mode="bilinear")
    images = (images + 0.1 * torch.randn(images.shape, generator=generator)).clamp(0, 1)
    mean, std = ([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]) if channels == 3 else ([0.5], [0.5])
    pixels = (images - torch.tensor(mean).view(-1, 1, 1)) / torch.tensor(std).view(-1, 1, 1)
    labels = torch.randint(0, config.num_labels, (_BATCH,), generator=generator)
    return {"pixel_values": pixels, "labels": labels}


def _waveform(generator: torch.Generator, samples: int) -> torch.Tensor:
    """(B, samples) voiced-like audio: three random sines plus noise, zero mean, unit variance."""
    import torch

    t = torch.arange(samples) / _SAMPLING_RATE
    freqs = 100 + 3000 * torch.rand(_BATCH, 3, 1, generator=generator)
    amps = torch.rand(_BATCH, 3, 1, generator=generator)
    wave = (amps * torch.sin(2 * math.pi * freqs * t)).sum(1)
    wave = wave + 0.05 * torch.randn(wave.shape, generator=generator)
    return (wave - wave.mean(1, keepdim=True)) / wave.std(1, keepdim=True)


def _log_mel(wave: torch.Tensor, n_mels: int, frames: int) -> torch.Tensor:
    """Whisper's feature extractor in torch: |STFT|^2 (n_fft 400, hop 160) -> slaney mel -> log10,
    clamped to max - 8, scaled (x + 4) / 4. (B, samples) -> (B, n_mels, frames)."""
    import torch
    from transformers.audio_utils import mel_filter_bank

    n_fft, hop = 400, 160
    stft = torch.stft(wave, n_fft, hop, window=torch.hann_window(n_fft), return_complex=True)
    power = stft[..., :frames].abs() ** 2  # (B, n_fft // 2 + 1, frames)
    filters = torch.from_numpy(mel_filter_bank(
        num_frequency_bins=n_fft // 2 + 1, num_mel_filters=n_mels, min_frequency=0.0,
        max_frequency=_SAMPLING_RATE / 2, sampling_rate=_SAMPLING_RATE, norm="slaney",
        mel_scale="slaney")).float()  # (n_freq, n_mels)
    log_spec = torch.clamp(filters.T @ power, min=1e-10).log10()
    peak = log_spec.amax(dim=(1, 2), keepdim=True)
    return (torch.maximum(log_spec, peak - 8.0) + 4.0) / 4.0


def speech_batch(model: nn.Module, generator: torch.Generator) -> dict[str, Any]:
    """Whisper: log-mel (B, n_mels, 2 * max_source_positions), shifted decoder ids, padding."""
    import torch

    config: Any = model.config  # a PretrainedConfig: its fields depend on the family
    frames = 2 * config.max_source_positions  # the encoder's stride-2 conv halves it
    features = _log_mel(_waveform(generator, frames * 160), config.num_mel_bins, frames)
    length = min(8, config.max_target_positions)
    labels = _tokens(generator, (_BATCH, length), config.vocab_size, _specials(config))
    decoder_ids = torch.cat([torch.full((_BATCH, 1), config.decoder_start_token_id),
                             labels[:, :-1]], dim=1)
    mask = labels.new_ones(labels.shape)
    mask[1, length - length // 4:] = 0  # row 1 is shorter: its tail is padding
    decoder_ids = decoder_ids.masked_fill(mask == 0, config.pad_token_id)
    return {"input_features": features, "decoder_input_ids": decoder_ids,
            "decoder_attention_mask": mask, "labels": labels.masked_fill(mask == 0, -100),
            "use_cache": False}


def ctc_batch(model: nn.Module, generator: torch.Generator) -> dict[str, Any]:
    """wav2vec2: raw waveforms long enough for _CTC_FRAMES encoder frames; row 1 zero-padded."""
    import torch

    config: Any = model.config  # a PretrainedConfig: its fields depend on the family
    samples = _CTC_FRAMES
    for kernel, stride in reversed(list(zip(config.conv_kernel, config.conv_stride))):
        samples = (samples - 1) * stride + kernel  # invert the conv output-length formula
    wave = _waveform(generator, samples)
    mask = torch.ones(wave.shape, dtype=torch.long)
    mask[1, samples - samples // 4:] = 0
    wave = wave.masked_fill(mask == 0, 0.0)
    blank = config.pad_token_id if config.pad_token_id is not None else 0  # CTC blank
    labels = _tokens(generator, (_BATCH, 10), config.vocab_size, {blank})
    labels[1, 7:] = -100  # row 1 transcribes less audio
    return {"input_values": wave, "attention_mask": mask, "labels": labels}
