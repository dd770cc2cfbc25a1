"""Context-parallel plans the server applies instead of diffusers' own, per transformer class.

``server/context_parallel.py`` enables diffusers' Ulysses attention on every rank's denoisers through
:func:`enable_plan`; for most classes that is diffusers' shipped ``_cp_plan`` unchanged. LTX-2
(``LTX2VideoTransformer3DModel``, family ``ltx2``) needs its own: diffusers 0.42.1's plan does not run
on it (``tests/test_ltx2_cp_plan.py``: its 4-D split RoPE is left whole, ``cross_attn_rope`` is not
split, and the text mask has every head while Ulysses attends heads / k).

LTX-2's plan (:func:`ltx2_plan`, :func:`localize_ltx2_attentions`):

- **Only the video tokens are sharded.** ``hidden_states`` is split on its token dim, both outputs of
  ``rope`` (video self-attention) and of ``cross_attn_rope`` (the video positions of the audio-video
  attentions) are split on theirs (dim 2 of split RoPE's ``(B, heads, tokens, r)``, dim 1 of
  interleaved RoPE's ``(B, tokens, dim)``), and ``proj_out`` is gathered, so every rank returns the
  whole video. Text, its mask and the whole audio stream (latents, RoPE, ``audio_proj_out``) stay
  whole on every rank: each rank computes the same audio.
- **Attentions whose keys are whole on every rank run locally.** Video-text (``attn2``), audio self
  (``audio_attn1``), audio-text (``audio_attn2``) and audio-to-video (``audio_to_video_attn``: audio
  keys) lose their parallel config after ``enable_parallelism``: each rank attends its own queries to
  the whole keys, which is exact, and the text mask keeps its ``heads`` layout. Only video self-
  attention (``attn1``) and video-to-audio (``video_to_audio_attn``: audio queries, video keys) go
  through Ulysses' all-to-all. Ulysses splits heads, so both streams' head counts must divide by k
  (:func:`check_start`), and the video token count too (:func:`check_call`, per request, a 400).
- Image-to-video LTX-2 (``LTX2ImageToVideoPipeline``) is not a served family; its per-token video
  timesteps (``[B, tokens]``, the conditioning frame at 0) would also have to be split with the video
  tokens, which this plan does not do.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from diffusion_rollout.errors import ContextParallelError, RequestError

LTX2_CLASS = "LTX2VideoTransformer3DModel"
# The four attentions of an LTX-2 block whose keys/values are whole on every rank under ltx2_plan.
LTX2_LOCAL_ATTENTIONS = ("attn2", "audio_attn1", "audio_attn2", "audio_to_video_attn")
# The two that go through Ulysses (video keys).
LTX2_ULYSSES_ATTENTIONS = ("attn1", "video_to_audio_attn")


def _is_ltx2(module: nn.Module) -> bool:
    return type(module).__name__ == LTX2_CLASS


def ltx2_plan(module: nn.Module) -> dict[str, Any]:
    """Video tokens sharded; text and audio whole; RoPE and cross-modal RoPE split on the token dim."""
    from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

    if module.config.rope_type == "split":  # cos/sin are (B, heads, tokens, r)
        rope = ContextParallelInput(split_dim=2, expected_dims=4, split_output=True)
    else:  # interleaved: (B, tokens, dim)
        rope = ContextParallelInput(split_dim=1, expected_dims=3, split_output=True)
    return {
        "": {"hidden_states": ContextParallelInput(split_dim=1, expected_dims=3, split_output=False)},
        "rope": {0: rope, 1: rope},
        "cross_attn_rope": {0: rope, 1: rope},
        "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3),
    }


def localize_ltx2_attentions(module: nn.Module) -> None:
    """Take the attentions with whole keys on every rank off Ulysses (after ``enable_parallelism``)."""
    for block in module.transformer_blocks:
        for name in LTX2_LOCAL_ATTENTIONS:
            getattr(block, name).processor._parallel_config = None


def enable_plan(module: nn.Module, config: Any) -> None:
    """``module.enable_parallelism(config=...)`` with the server's plan for its class, if it has one."""
    if _is_ltx2(module):
        module.enable_parallelism(config=config, cp_plan=ltx2_plan(module))
        localize_ltx2_attentions(module)
    else:
        module.enable_parallelism(config=config)


def check_start(engine: Any) -> None:
    """Start-up refusals (before any follower is spawned): LTX-2's head counts must divide by k."""
    k = engine.config.context_parallel
    for name, module in engine.adapter.transformers().items():
        if not _is_ltx2(module):
            continue
        cfg = module.config
        heads = {
            "num_attention_heads": int(cfg.num_attention_heads),
            "audio_num_attention_heads": int(cfg.audio_num_attention_heads),
        }
        bad = {key: n for key, n in heads.items() if n % k}
        if bad:
            listed = ", ".join(f"{key}={n}" for key, n in bad.items())
            raise ContextParallelError(
                f"context_parallel={k}: {name} ({LTX2_CLASS}) has {listed}; Ulysses splits the heads of "
                f"video self-attention and video-to-audio attention over the ranks, so they must be "
                f"divisible by {k}"
            )


def ltx2_video_tokens(adapter: Any, call: Any) -> int:
    """The packed video token count of one LTX-2 call (what Ulysses shards)."""
    pipe = adapter.pipe
    _, f, h, w = adapter.noise_shape(call)
    p, pt = int(pipe.transformer_spatial_patch_size), int(pipe.transformer_temporal_patch_size)
    return -(-f // pt) * (h // p) * (w // p)


def check_call(engine: Any, call: Any) -> None:
    """Request-time refusal (a 400): LTX-2's video token count must divide by k."""
    k = engine.config.context_parallel
    if k <= 1 or engine.adapter.name != "ltx2":
        return
    tokens = ltx2_video_tokens(engine.adapter, call)
    if tokens % k:
        raise RequestError(
            f"height={call.height}, width={call.width}, num_frames={call.num_frames} give {tokens} video "
            f"tokens, not divisible by context_parallel={k} (the ranks shard the video tokens evenly): "
            "send another height, width or num_frames",
            field="num_frames",
        )
