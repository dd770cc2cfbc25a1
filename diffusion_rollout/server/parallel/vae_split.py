"""The Wan VAE's tiled decode, its tiles spread over the ranks of a ``torch.distributed`` group.

With context parallelism the transformer calls are shared by k ranks but the VAE decode ran on rank 0
alone: on 4x H200 it was 26.5 % of a 20-step Wan 2.2 TI2V-5B rollout at 1280x704x121 and 18.3 % of a
Wan 2.1 1.3B one at 832x480x81 (``benchmarks/results/h200x4/cp_scaling``). This module lets every
rank decode a share of the tiles of ``AutoencoderKLWan``'s tiled decode; rank 0 blends them.

Design decisions:

- **Equal to the tiled decode, not to the untiled one.** The untiled decode cannot be split exactly:
  the decoder's mid-block attention sees the whole frame, and its causal convolutions carry features
  across the whole frame. Tiles are independent of each other until they are blended, so the split
  decode is bit-identical to ``vae.tiled_decode(z)`` on one process, and to ``vae.decode(z)`` with
  ``vae.enable_tiling(...)`` (which decodes a latent that fits one tile untiled, as
  :func:`install_split_decode` does). A tiled decode differs from the untiled one by its seams'
  blending; it is what diffusers gives any user who turns tiling on.
- **The VAE's own grid.** The tile size and stride are the VAE's ``tile_sample_min_*`` and
  ``tile_sample_stride_*`` (:class:`TileSettings`), read from rank 0's VAE on each decode and sent
  with it, so a user who sets them (``enable_tiling(...)``) gets the same grid split. The grid, the
  per-tile causal frame loop (one feature cache per tile, ``first_chunk`` on frame 0), the crop to
  the stride, the unpatchify (Wan 2.2's VAE decodes 2x2 patches) and the clamp follow diffusers'
  ``AutoencoderKLWan.tiled_decode``; the seams are blended with the VAE's own ``blend_v`` and
  ``blend_h``, in the same order and in place as there (a tile's top is blended before its left, and
  a later tile blends against its already blended neighbours), so the bits are the same.
- **Round-robin over the grid.** Tile ``t`` (row-major) is decoded by rank ``t % world``: edge
  tiles are smaller, and row-major round-robin spreads them. Rank 0 decodes its own tiles and then
  receives every other rank's (shapes first, then one flat buffer per rank, point-to-point: NCCL on
  CUDA, gloo on the CPU); only rank 0 holds the decoded video.
- **Collective.** Every rank of the group must call :func:`split_tiled_decode` with the same latent
  and the same settings (the context-parallel engine broadcasts both, ``server/parallel/context_parallel.py``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

# AutoencoderKLWan's decode methods are shadowed by an instance attribute (as server/speed/lanes.py does):
# removing it restores the class's method.
_SPLIT_ATTR = "_diffusion_rollout_split_decode"


@dataclass(frozen=True)
class TileSettings:
    """The VAE's tiling parameters, in output pixels (diffusers' names without ``tile_sample_``)."""

    min_height: int
    min_width: int
    stride_height: int
    stride_width: int

    @classmethod
    def of(cls, vae: Any) -> TileSettings:
        return cls(
            int(vae.tile_sample_min_height),
            int(vae.tile_sample_min_width),
            int(vae.tile_sample_stride_height),
            int(vae.tile_sample_stride_width),
        )


@dataclass(frozen=True)
class TileGrid:
    """Where each tile of one latent lies, and how the decoded tiles are put together."""

    rows: tuple[int, ...]  # latent row of each grid row's first tile
    cols: tuple[int, ...]
    latent_height: int  # a tile's latent extent (the last row and column may be cut shorter)
    latent_width: int
    stride_height: int  # kept rows and columns of each decoded tile (decoder output, before unpatchify)
    stride_width: int
    blend_height: int
    blend_width: int
    out_height: int  # the decoder output's extent, before unpatchify
    out_width: int
    patch_size: int | None

    @property
    def count(self) -> int:
        return len(self.rows) * len(self.cols)

    def latent_slice(self, index: int) -> tuple[slice, slice]:
        """Tile ``index``'s (row-major) latent rows and columns."""
        i, j = self.rows[index // len(self.cols)], self.cols[index % len(self.cols)]
        return slice(i, i + self.latent_height), slice(j, j + self.latent_width)


def tile_grid(vae: Any, latent_shape: tuple[int, ...], settings: TileSettings) -> TileGrid:
    """The grid ``AutoencoderKLWan.tiled_decode`` uses for a ``[B, C, T, H, W]`` latent."""
    height, width = latent_shape[-2:]
    scale = vae.spatial_compression_ratio
    patch = vae.config.patch_size
    # The decoder of a patchified VAE outputs patch x patch pixels per position: its strides and
    # blends are in those positions.
    per = patch or 1
    stride_h, stride_w = settings.stride_height // per, settings.stride_width // per
    return TileGrid(
        rows=tuple(range(0, height, settings.stride_height // scale)),
        cols=tuple(range(0, width, settings.stride_width // scale)),
        latent_height=settings.min_height // scale,
        latent_width=settings.min_width // scale,
        stride_height=stride_h,
        stride_width=stride_w,
        blend_height=settings.min_height // per - stride_h,
        blend_width=settings.min_width // per - stride_w,
        out_height=height * scale // per,
        out_width=width * scale // per,
        patch_size=patch,
    )


def needs_tiles(vae: Any, latent_shape: tuple[int, ...], settings: TileSettings) -> bool:
    """Whether the VAE with tiling on would tile this latent (``_decode``'s test): one that fits a
    single tile is decoded untiled."""
    height, width = latent_shape[-2:]
    scale = vae.spatial_compression_ratio
    return width > settings.min_width // scale or height > settings.min_height // scale


def owned_tiles(count: int, rank: int, world: int) -> list[int]:
    """The tiles rank ``rank`` of ``world`` decodes (round-robin over the row-major grid)."""
    return list(range(rank, count, world))


@functools.cache
def _causal_conv_class() -> type:
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d

    return WanCausalConv3d


def _decoder_cache_size(vae: Any) -> int:
    conv = _causal_conv_class()
    return sum(isinstance(m, conv) for m in vae.decoder.modules())


def decode_tile(vae: Any, z_tile: torch.Tensor, cache_size: int | None = None) -> torch.Tensor:
    """One tile's decode: its latent frames one at a time through ``post_quant_conv`` and the decoder,
    the causal convolutions carrying the earlier frames in a feature cache of the tile's own."""
    if cache_size is None:
        cache_size = _decoder_cache_size(vae)
    cache: list[Any] = [None] * cache_size
    frames = []
    for k in range(z_tile.shape[2]):
        x = vae.post_quant_conv(z_tile[:, :, k : k + 1])
        frames.append(vae.decoder(x, feat_cache=cache, feat_idx=[0], first_chunk=k == 0))
    return torch.cat(frames, dim=2)


def blend_tiles(vae: Any, grid: TileGrid, tiles: list[torch.Tensor]) -> torch.Tensor:
    """Rank 0: the decoded tiles (row-major, blended in place) as one clamped video ``[B, C, F, H, W]``."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import unpatchify

    n_cols = len(grid.cols)
    grid_rows = [tiles[r * n_cols : (r + 1) * n_cols] for r in range(len(grid.rows))]
    kept_rows = []
    for r, row in enumerate(grid_rows):
        kept = []
        for c, tile in enumerate(row):
            # In place and in this order: the tile below or to the right blends against this one
            # as blended here, which is what one process's tiled decode does.
            if r > 0:
                tile = vae.blend_v(grid_rows[r - 1][c], tile, grid.blend_height)
            if c > 0:
                tile = vae.blend_h(row[c - 1], tile, grid.blend_width)
            kept.append(tile[:, :, :, : grid.stride_height, : grid.stride_width])
        kept_rows.append(torch.cat(kept, dim=-1))
    video = torch.cat(kept_rows, dim=3)[:, :, :, : grid.out_height, : grid.out_width]
    if grid.patch_size is not None:
        video = unpatchify(video, patch_size=grid.patch_size)
    return torch.clamp(video, min=-1.0, max=1.0)


def _gather_tiles(
    mine: list[torch.Tensor], grid: TileGrid, rank: int, world: int, group: Any
) -> list[torch.Tensor] | None:
    """Every rank's tiles to rank 0 of ``group``, in grid order there; None elsewhere."""
    import torch.distributed as dist

    def global_rank(r: int) -> int:
        return r if group is None else dist.get_global_rank(group, r)

    if rank != 0:
        if mine:  # a rank with no tile (fewer tiles than ranks) sends nothing; rank 0 expects nothing
            device = mine[0].device
            shapes = torch.tensor([list(t.shape) for t in mine], dtype=torch.int64, device=device)
            dist.send(shapes, dst=global_rank(0), group=group)
            dist.send(torch.cat([t.reshape(-1) for t in mine]), dst=global_rank(0), group=group)
        return None
    tiles: list[torch.Tensor | None] = [None] * grid.count
    for index, tile in zip(owned_tiles(grid.count, 0, world), mine, strict=True):
        tiles[index] = tile
    like = mine[0]  # rank 0 owns tile 0
    senders = [r for r in range(1, world) if owned_tiles(grid.count, r, world)]
    shapes = {r: torch.empty(len(owned_tiles(grid.count, r, world)), like.dim(), dtype=torch.int64,
                             device=like.device) for r in senders}  # fmt: skip
    for work in [dist.irecv(shapes[r], src=global_rank(r), group=group) for r in senders]:
        work.wait()
    flats, sizes = {}, {}
    for r in senders:
        sizes[r] = [tuple(s) for s in shapes[r].tolist()]
        total = sum(int(torch.Size(s).numel()) for s in sizes[r])
        flats[r] = torch.empty(total, dtype=like.dtype, device=like.device)
    for work in [dist.irecv(flats[r], src=global_rank(r), group=group) for r in senders]:
        work.wait()
    for r in senders:
        parts = flats[r].split([int(torch.Size(s).numel()) for s in sizes[r]])
        for index, part, shape in zip(owned_tiles(grid.count, r, world), parts, sizes[r], strict=True):
            tiles[index] = part.view(shape)
    return tiles  # type: ignore[return-value]


def split_tiled_decode(
    vae: Any, z: torch.Tensor, settings: TileSettings | None = None, group: Any = None
) -> torch.Tensor | None:
    """``vae.tiled_decode(z).sample``, bit for bit, computed by every rank of ``group`` (the default
    group when None): a collective, every rank passes the same ``z`` and ``settings`` (default: the
    VAE's own). Returns the video on the group's rank 0, None on the others."""
    import torch.distributed as dist

    settings = TileSettings.of(vae) if settings is None else settings
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    grid = tile_grid(vae, tuple(z.shape), settings)
    cache_size = _decoder_cache_size(vae)
    mine = []
    with torch.no_grad():
        for index in owned_tiles(grid.count, rank, world):
            rows, cols = grid.latent_slice(index)
            mine.append(decode_tile(vae, z[:, :, :, rows, cols], cache_size))
        tiles = _gather_tiles(mine, grid, rank, world, group)
        return None if tiles is None else blend_tiles(vae, grid, tiles)


def install_split_decode(vae: Any, run_split: Callable[[torch.Tensor, TileSettings], torch.Tensor]) -> None:
    """Route ``vae.decode`` through ``run_split(z, settings)`` (rank 0's side of a split decode)
    wherever the VAE with tiling on would tile; a latent that fits one tile is decoded untiled by
    the VAE's own ``decode``, as ``enable_tiling`` would. Undone by :func:`remove_split_decode`."""
    from diffusers.models.autoencoders.vae import DecoderOutput

    if getattr(vae, _SPLIT_ATTR, None) is not None:
        raise RuntimeError("this VAE's decode is already split")
    original = vae.decode

    @functools.wraps(original)
    def decode(z: torch.Tensor, return_dict: bool = True):
        settings = TileSettings.of(vae)
        if not needs_tiles(vae, tuple(z.shape), settings):
            return original(z, return_dict=return_dict)
        if vae.use_slicing and z.shape[0] > 1:  # as ``decode`` slices: one sample at a time
            video = torch.cat([run_split(one, settings) for one in z.split(1)])
        else:
            video = run_split(z, settings)
        return DecoderOutput(sample=video) if return_dict else (video,)

    object.__setattr__(vae, _SPLIT_ATTR, original)
    object.__setattr__(vae, "decode", decode)


def remove_split_decode(vae: Any) -> None:
    """Give ``vae`` back the ``decode`` it had before :func:`install_split_decode`."""
    original = getattr(vae, _SPLIT_ATTR, None)
    if original is None:
        return
    object.__delattr__(vae, "decode")
    object.__delattr__(vae, _SPLIT_ATTR)
    if vae.decode != original:  # another wrapper was under ours (server/speed/lanes.py's lock)
        object.__setattr__(vae, "decode", original)
