"""Pieces every tiny family builder shares: seeded construction and the small text encoders and VAE.

Builds are deterministic: :func:`pinned_rng_and_dtype` serialises them, isolates the global RNG and
pins float32 construction; :func:`seeded` seeds each component from ``(seed, component)`` with a
hash that is the same in every process, so a ``(family, seed)`` pair always gives the same bytes.
"""

from __future__ import annotations

import contextlib
import threading
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from diffusers import AutoencoderKL
from transformers import CLIPTextConfig, PreTrainedTokenizerBase

from .tokenizers import QWEN_SPECIAL_TOKENS

TEXT_DIM = 32  # T5 / UMT5 / Qwen2.5 hidden size = the transformers' joint/text attention width
LATENT_CHANNELS = 16

BUILD_LOCK = threading.RLock()


@contextlib.contextmanager
def pinned_rng_and_dtype() -> Iterator[None]:
    """Serialise builds, isolate the global RNG and pin float32 construction for their duration."""
    with BUILD_LOCK, torch.random.fork_rng(devices=[]):
        previous_dtype = torch.get_default_dtype()
        torch.set_default_dtype(torch.float32)
        try:
            yield
        finally:
            torch.set_default_dtype(previous_dtype)


def seed_for(seed: int, component: str) -> int:
    """Stable per-component seed (crc32 is fixed across processes, unlike ``hash``)."""
    return zlib.crc32(f"{seed}/{component}".encode())


def seeded(seed: int, component: str, factory: Callable[[], Any]) -> Any:
    # The CPU generator only: construction runs on the CPU, and torch.manual_seed would also reseed
    # (and fork_rng would not restore) the caller's CUDA generators.
    torch.random.default_generator.manual_seed(seed_for(seed, component))
    return factory()


def padded_vocab(tokenizer: PreTrainedTokenizerBase, multiple: int = 64) -> int:
    """Embedding rows for ``tokenizer``, rounded up like real checkpoints pad their vocabularies."""
    return -(-len(tokenizer) // multiple) * multiple


# ---------------------------------------------------------------------------------------------
# Shared text encoders and VAEs
# ---------------------------------------------------------------------------------------------


def clip_config(
    tokenizer: PreTrainedTokenizerBase, hidden: int, projection_dim: int, act: str
) -> CLIPTextConfig:
    return CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=tokenizer.model_max_length,
        projection_dim=projection_dim,
        hidden_act=act,
        bos_token_id=tokenizer.bos_token_id,
        # The real EOS id (not the legacy 2), so pooling takes the first EOS position.
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def t5_kwargs(tokenizer: PreTrainedTokenizerBase) -> dict[str, Any]:
    return {
        "vocab_size": padded_vocab(tokenizer),
        "d_model": TEXT_DIM,
        "d_kv": 8,
        "d_ff": 32,
        "num_layers": 2,
        "num_heads": 4,
        "relative_attention_num_buckets": 8,
        "relative_attention_max_distance": 16,
        "dropout_rate": 0.0,
        "feed_forward_proj": "gated-gelu",  # T5 v1.1 / UMT5, as SD3, FLUX and Wan use
        "is_encoder_decoder": False,
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "decoder_start_token_id": tokenizer.pad_token_id,
    }


def image_vae(shift_factor: float, scaling_factor: float) -> AutoencoderKL:
    """SD3/FLUX-style KL VAE with 16 latent channels and a 4x downsampling."""
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 3,
        up_block_types=("UpDecoderBlock2D",) * 3,
        block_out_channels=(8, 16, 16),
        layers_per_block=1,
        latent_channels=LATENT_CHANNELS,
        norm_num_groups=8,
        sample_size=32,
        use_quant_conv=False,
        use_post_quant_conv=False,
        shift_factor=shift_factor,
        scaling_factor=scaling_factor,
    )


def qwen_ids(tokenizer: PreTrainedTokenizerBase) -> dict[str, int]:
    return dict(
        zip(QWEN_SPECIAL_TOKENS, tokenizer.convert_tokens_to_ids(list(QWEN_SPECIAL_TOKENS)), strict=True)
    )


def qwen25_text_config(tokenizer: PreTrainedTokenizerBase, num_layers: int = 2) -> dict[str, Any]:
    ids = qwen_ids(tokenizer)
    head_dim = 16
    return {
        "vocab_size": padded_vocab(tokenizer),
        "hidden_size": TEXT_DIM,
        "intermediate_size": 32,
        "num_hidden_layers": num_layers,
        "num_attention_heads": TEXT_DIM // head_dim,
        "num_key_value_heads": 1,  # grouped-query attention, as in Qwen2.5
        "max_position_embeddings": 2048,
        # Multimodal RoPE: the sections split head_dim / 2 frequencies over (t, h, w) like [16, 24, 24].
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 3, 3]},
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": tokenizer.pad_token_id,
    }
