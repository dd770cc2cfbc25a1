"""Context-parallel plans the server applies instead of diffusers' own, per transformer class.

``server/parallel/context_parallel.py`` enables diffusers' Ulysses attention on every rank's denoisers through
:func:`enable_plan`; for most classes that is diffusers' shipped ``_cp_plan`` unchanged. LTX-2
(``LTX2VideoTransformer3DModel``, family ``ltx2``) needs its own: diffusers 0.42.1's plan does not run
on it (``tests/server/parallel/test_ltx2_cp_plan.py``: its 4-D split RoPE is left whole, ``cross_attn_rope`` is not
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

HunyuanVideo 1.5's plan (:func:`hunyuanvideo15_plan`, :class:`HunyuanVideo15UlyssesProcessor`;
``HunyuanVideo15Transformer3DModel``, family ``hunyuanvideo15``; diffusers ships no plan for it):

- **Only the video tokens are sharded.** The output of ``x_embedder`` (the patch embedding of the
  channel-concatenated input: noisy latents, condition latents, mask) is split on its token dim, both
  outputs of ``rope`` (``(tokens, dim)``) on dim 0, and ``proj_out`` is gathered. The text token
  refiner, the ByT5 projection, the image embeddings (SigLIP tokens, zeros for T2V), their reordered
  concatenation, its mask and the whole text stream of every block stay whole on every rank.
- **Joint attention sees the video through Ulysses and the text locally.** Each block attends one
  sequence ``[video; text]`` with a key-and-query mask over the text padding. diffusers' Ulysses would
  exchange each rank's whole text as if it were a shard: the text keys would count k times against
  the video's once (a different softmax), and the processor's ``(S, S)`` mask does not survive the
  exchange. So every block's processor is replaced by :class:`HunyuanVideo15UlyssesProcessor`: the
  video Q/K/V go through the all-to-all (tokens -> heads), the text Q/K/V are cut to the rank's heads
  locally (they are whole on every rank), the rank attends the whole ``[video; text]`` sequence in
  k = 1's order with k = 1's mask over its ``heads / k`` heads, the video output goes back through
  the all-to-all (heads -> tokens) and the text output is all-gathered over the heads, so every rank
  again holds the whole text. Heads must divide by k (:func:`check_start`), and the video token count
  too (:func:`check_call`, a 400).

The attention layout's rules (:func:`check_start` at start-up, :func:`check_call` per request), for
``context_parallel_mode`` ulysses (ring degree 1), ring (ring degree k) and hybrid (Ulysses degree
k / ring degree):

- Ulysses splits heads, so every sharded attention's head count must divide by the Ulysses degree
  (k, k / ring degree, or no rule for ring).
- Every layout shards the video tokens over all k ranks, so their count must divide by k, for Wan
  too (diffusers' ``EquipartitionSharder`` asserts it inside the call, which would end a follower).
- A ring (ring, hybrid) needs a backend that returns the log-sum-exp: ``_native_flash`` unless one
  is configured (:func:`ring_backend`), bfloat16 or float16 only, so float32 on CUDA is refused.
- The server's own plans (LTX-2, HunyuanVideo 1.5) exchange over the Ulysses group only: ring and
  hybrid are refused for them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from diffusion_rollout.errors import ContextParallelError, RequestError

LTX2_CLASS = "LTX2VideoTransformer3DModel"
HUNYUANVIDEO15_CLASS = "HunyuanVideo15Transformer3DModel"
# The four attentions of an LTX-2 block whose keys/values are whole on every rank under ltx2_plan.
LTX2_LOCAL_ATTENTIONS = ("attn2", "audio_attn1", "audio_attn2", "audio_to_video_attn")
# The two that go through Ulysses (video keys).
LTX2_ULYSSES_ATTENTIONS = ("attn1", "video_to_audio_attn")


def _is_ltx2(module: nn.Module) -> bool:
    return type(module).__name__ == LTX2_CLASS


def _is_hunyuanvideo15(module: nn.Module) -> bool:
    return type(module).__name__ == HUNYUANVIDEO15_CLASS


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


def hunyuanvideo15_plan(module: nn.Module) -> dict[str, Any]:
    """Video tokens sharded after the patch embedding, with their RoPE; text and image whole."""
    from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

    rope = ContextParallelInput(split_dim=0, expected_dims=2, split_output=True)  # (tokens, dim)
    return {
        "x_embedder": {0: ContextParallelInput(split_dim=1, expected_dims=3, split_output=True)},
        "rope": {0: rope, 1: rope},
        "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3),
    }


class HunyuanVideo15UlyssesProcessor:
    """HunyuanVideo 1.5's joint attention with Ulysses over the video tokens only.

    diffusers' ``HunyuanVideo15AttnProcessor2_0`` with the attention call replaced: the video Q/K/V
    (this rank's tokens, every head) are exchanged to (every token, this rank's heads); the text Q/K/V,
    whole on every rank, are cut to this rank's heads; the rank attends ``[video; text]`` in k = 1's
    order with k = 1's mask; the video output is exchanged back and the text output all-gathered over
    the heads. Projections, QK norms and RoPE are diffusers' code unchanged.
    """

    _attention_backend = None
    _parallel_config = None

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: Any = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        import torch.nn.functional as F
        from diffusers.models.attention_dispatch import dispatch_attention_fn
        from diffusers.models.embeddings import apply_rotary_emb

        if encoder_hidden_states is None:  # the blocks always pass the text; nothing else is served
            raise ValueError("HunyuanVideo15UlyssesProcessor needs encoder_hidden_states (joint attention)")
        query = attn.to_q(hidden_states).unflatten(2, (attn.heads, -1))
        key = attn.to_k(hidden_states).unflatten(2, (attn.heads, -1))
        value = attn.to_v(hidden_states).unflatten(2, (attn.heads, -1))
        query, key = attn.norm_q(query), attn.norm_k(key)
        if image_rotary_emb is not None:  # this rank's video positions (the plan splits ``rope``)
            query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
            key = apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)

        text_query = attn.add_q_proj(encoder_hidden_states).unflatten(2, (attn.heads, -1))
        text_key = attn.add_k_proj(encoder_hidden_states).unflatten(2, (attn.heads, -1))
        text_value = attn.add_v_proj(encoder_hidden_states).unflatten(2, (attn.heads, -1))
        if attn.norm_added_q is not None:
            text_query = attn.norm_added_q(text_query)
        if attn.norm_added_k is not None:
            text_key = attn.norm_added_k(text_key)

        group = self._parallel_config.context_parallel_config._ulysses_mesh.get_group()
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        heads = attn.heads // world
        own = slice(rank * heads, (rank + 1) * heads)
        query, key, value = (_tokens_to_heads(x, world, group) for x in (query, key, value))
        query = torch.cat([query, text_query[:, :, own]], dim=1)
        key = torch.cat([key, text_key[:, :, own]], dim=1)
        value = torch.cat([value, text_value[:, :, own]], dim=1)

        # k = 1's mask: the text mask padded with True over the (whole) video, query and key.
        batch_size, seq_len = query.shape[:2]
        attention_mask = F.pad(attention_mask, (seq_len - attention_mask.shape[1], 0), value=True).bool()
        mask_1 = attention_mask.view(batch_size, 1, 1, seq_len).repeat(1, 1, seq_len, 1)
        attention_mask = (mask_1 & mask_1.transpose(2, 3)).bool()

        out = dispatch_attention_fn(
            query, key, value, attn_mask=attention_mask, dropout_p=0.0, is_causal=False,
            backend=self._attention_backend, parallel_config=None,
        )  # fmt: skip
        video_tokens = out.shape[1] - encoder_hidden_states.shape[1]
        video_out = _heads_to_tokens(out[:, :video_tokens], world, group)
        text_out = _gather_heads(out[:, video_tokens:], group)

        hidden_states = video_out.flatten(2, 3).to(query.dtype)
        encoder_hidden_states = text_out.flatten(2, 3).to(query.dtype)
        hidden_states = attn.to_out[0](hidden_states)
        hidden_states = attn.to_out[1](hidden_states)
        encoder_hidden_states = attn.to_add_out(encoder_hidden_states)
        return hidden_states, encoder_hidden_states


def _tokens_to_heads(x: torch.Tensor, world: int, group: Any) -> torch.Tensor:
    """(B, tokens / k, H, D) on each rank -> (B, tokens, H / k, D): Ulysses' all-to-all (diffusers' layout)."""
    from diffusers.models.attention_dispatch import _all_to_all_single

    b, s, h, d = x.shape
    x = x.reshape(b, s, world, h // world, d).permute(2, 1, 0, 3, 4).contiguous()
    x = _all_to_all_single(x, group)
    return x.flatten(0, 1).permute(1, 0, 2, 3).contiguous()


def _heads_to_tokens(x: torch.Tensor, world: int, group: Any) -> torch.Tensor:
    """(B, tokens, H / k, D) -> (B, tokens / k, H, D): the inverse all-to-all."""
    from diffusers.models.attention_dispatch import _all_to_all_single

    b, s, h, d = x.shape
    x = x.reshape(b, world, s // world, h, d).permute(1, 3, 0, 2, 4).contiguous()
    x = _all_to_all_single(x, group)
    return x.flatten(0, 1).permute(1, 2, 0, 3).contiguous()


def _gather_heads(x: torch.Tensor, group: Any) -> torch.Tensor:
    """(B, T, H / k, D) on each rank -> (B, T, H, D), ranks in head order."""
    import torch.distributed._functional_collectives as funcol
    from diffusers.models.attention_dispatch import _wait_tensor

    return _wait_tensor(funcol.all_gather_tensor(x.contiguous(), 2, group=group))


def install_hunyuanvideo15_processors(module: nn.Module) -> None:
    """Every block's joint attention gets :class:`HunyuanVideo15UlyssesProcessor` (after
    ``enable_parallelism``, keeping the parallel config and attention backend it set)."""
    for block in module.transformer_blocks:
        old = block.attn.processor
        new = HunyuanVideo15UlyssesProcessor()
        new._attention_backend = old._attention_backend
        new._parallel_config = old._parallel_config
        block.attn.set_processor(new)


def enable_plan(module: nn.Module, config: Any) -> None:
    """``module.enable_parallelism(config=...)`` with the server's plan for its class, if it has one."""
    if _is_ltx2(module):
        module.enable_parallelism(config=config, cp_plan=ltx2_plan(module))
        localize_ltx2_attentions(module)
    elif _is_hunyuanvideo15(module):
        module.enable_parallelism(config=config, cp_plan=hunyuanvideo15_plan(module))
        install_hunyuanvideo15_processors(module)
    else:
        module.enable_parallelism(config=config)


# Families whose transformers run a server plan (above): their processors exchange over the Ulysses
# group only, so ring and hybrid layouts would shard the tokens without passing keys round the ring.
_SERVER_PLAN_CLASSES = (LTX2_CLASS, HUNYUANVIDEO15_CLASS)
# The attention backend ring and hybrid run on CUDA unless one is configured: ring attention merges
# each block's partial output by its log-sum-exp, which diffusers' native backend does not return.
RING_BACKEND = "_native_flash"


def ring_backend(configured: str | None, ring_degree: int, cuda: bool) -> str | None:
    """The attention backend every rank runs: the configured one, else :data:`RING_BACKEND` for a ring
    on CUDA, else None (the model's default)."""
    if configured or ring_degree == 1 or not cuda:
        return configured
    return RING_BACKEND


def _split_heads(module: nn.Module) -> dict[str, int]:
    """The head counts Ulysses splits over its ranks (LTX-2: the video and the audio stream's)."""
    cfg = module.config
    heads = {"num_attention_heads": int(cfg.num_attention_heads)}
    if _is_ltx2(module):
        heads["audio_num_attention_heads"] = int(cfg.audio_num_attention_heads)
    return heads


def check_start(modules: dict[str, nn.Module], config: Any, *, cuda: bool, dtype: torch.dtype) -> None:
    """Start-up refusals (before any follower is spawned) of the attention layout ``config`` asks for
    (``context_parallel``, ``context_parallel_mode``, ``context_parallel_degrees()``,
    ``attention_backend``). The same on a CPU engine, where mirror mode does not shard, except the
    dtype rule, which is the CUDA backend's."""
    k, mode = config.context_parallel, config.context_parallel_mode
    ring, ulysses = config.context_parallel_degrees()
    where = f"context_parallel={k}, context_parallel_mode={mode}"
    if ring > 1:
        if (
            cuda
            and dtype == torch.float32
            and ring_backend(config.attention_backend, ring, cuda) == RING_BACKEND
        ):
            raise ContextParallelError(
                f"{where} runs attention_backend={RING_BACKEND} (ring attention merges by the log-sum-exp "
                "it returns), which takes bfloat16 or float16 only: set dtype=bfloat16 (or float16), or "
                "context_parallel_mode=ulysses for float32"
            )
        for name, module in modules.items():
            if type(module).__name__ in _SERVER_PLAN_CLASSES:
                raise ContextParallelError(
                    f"{where}: {name} ({type(module).__name__}) runs the server's own context-parallel "
                    "plan, whose attention exchanges over the Ulysses ranks only; use "
                    "context_parallel_mode=ulysses"
                )
    if ulysses == 1:
        return
    for name, module in modules.items():
        bad = {key: n for key, n in _split_heads(module).items() if n % ulysses}
        if bad:
            listed = ", ".join(f"{key}={n}" for key, n in bad.items())
            raise ContextParallelError(
                f"{where}: {name} ({type(module).__name__}) has {listed}; Ulysses splits the heads of "
                f"the sharded attentions over its {ulysses} ranks, so they must be divisible by {ulysses}"
            )


def ltx2_video_tokens(adapter: Any, call: Any) -> int:
    """The packed video token count of one LTX-2 call (what Ulysses shards)."""
    pipe = adapter.pipe
    _, f, h, w = adapter.noise_shape(call)
    p, pt = int(pipe.transformer_spatial_patch_size), int(pipe.transformer_temporal_patch_size)
    return -(-f // pt) * (h // p) * (w // p)


def hunyuanvideo15_video_tokens(adapter: Any, call: Any) -> int:
    """The video token count of one HunyuanVideo 1.5 call (latent frames x height x width / patches)."""
    cfg = adapter.pipe.transformer.config
    _, f, h, w = adapter.noise_shape(call)
    p, pt = int(cfg.patch_size), int(cfg.patch_size_t)
    return (f // pt) * (h // p) * (w // p)


def wan_video_tokens(adapter: Any, call: Any) -> int:
    """The video token count of one Wan call (latent frames x height x width / the patch)."""
    denoiser = next(iter(adapter.transformers().values()))  # the experts of Wan 2.2 share a patch
    pt, ph, pw = (int(n) for n in denoiser.config.patch_size)
    _, f, h, w = adapter.noise_shape(call)
    return (f // pt) * (h // ph) * (w // pw)


# Families whose video tokens the ranks shard evenly, and how to count them for one call. diffusers'
# Wan plan asserts the split inside the transformer, where it would end a follower mid-call.
_VIDEO_TOKENS = {
    "ltx2": ltx2_video_tokens,
    "hunyuanvideo15": hunyuanvideo15_video_tokens,
    **dict.fromkeys(("wan", "wan2.2", "wan-i2v", "wan2.2-i2v", "wan2.2-ti2v-i2v"), wan_video_tokens),
}


def check_call(engine: Any, call: Any) -> None:
    """Request-time refusal (a 400): the video token count must divide by k (every layout shards the
    tokens over all k ranks)."""
    k = engine.config.context_parallel
    count = _VIDEO_TOKENS.get(engine.adapter.name)
    if k <= 1 or count is None:
        return
    tokens = count(engine.adapter, call)
    if tokens % k:
        raise RequestError(
            f"height={call.height}, width={call.width}, num_frames={call.num_frames} give {tokens} video "
            f"tokens, not divisible by context_parallel={k} (the ranks shard the video tokens evenly): "
            "send another height, width or num_frames",
            field="num_frames",
        )
