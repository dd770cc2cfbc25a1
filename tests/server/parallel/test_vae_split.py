"""The split VAE decode (``server/parallel/vae_split.py``) on two gloo ranks equals one process's tiled decode.

One spawn of two ranks runs every check (spawning costs seconds on two cores): the tiny zoo's Wan 2.1
VAE and a tiny VAE of the Wan 2.2 (TI2V-5B) layout, whose decoder outputs 2x2 patches and whose
spatial factor is 16. Each is given tiles small enough for a tiny latent to have several, with
an odd tile count (rank 0 decodes one more than rank 1), a batch of two, and a latent of one tile
(rank 1 decodes nothing). Rank 0 compares with ``vae.tiled_decode`` bit for bit.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from diffusion_rollout.testing import free_port


def _wan22_vae():
    """Wan 2.2's VAE layout (residual blocks, 12 channels in 2x2 patches, 16x spatially), tiny."""
    from diffusers import AutoencoderKLWan

    torch.manual_seed(0)
    return AutoencoderKLWan(
        base_dim=8, z_dim=8, dim_mult=[1, 1, 1, 1], num_res_blocks=1, is_residual=True, in_channels=12,
        out_channels=12, patch_size=2, scale_factor_spatial=16, temperal_downsample=[False, True, True],
    ).eval()  # fmt: skip


def _wan21_vae():
    """The tiny zoo's Wan 2.1 VAE alone (building the whole tiny pipeline takes seconds per rank)."""
    from diffusion_rollout.models.tiny_video import _wan_vae

    torch.manual_seed(0)
    return _wan_vae().eval()


CASES = ("wan2.1 1x3 tiles", "wan2.1 one tile", "wan2.2 1x3 tiles", "wan2.2 one tile",
         "wan2.1 batch of 2, 2x2 tiles")  # fmt: skip


def _cases():
    """(name, vae, latents): each VAE's tiles are 4 latent positions wide at a stride of 3."""
    wan21 = _wan21_vae()
    wan22 = _wan22_vae()
    g = torch.Generator().manual_seed(3)
    cases = []
    for name, vae in (("wan2.1", wan21), ("wan2.2", wan22)):
        scale = vae.spatial_compression_ratio
        vae.enable_tiling(4 * scale, 4 * scale, 3 * scale, 3 * scale)
        z_dim = vae.config.z_dim
        cases += [
            (f"{name} 1x3 tiles", vae, torch.randn(1, z_dim, 2, 3, 7, generator=g)),
            (f"{name} one tile", vae, torch.randn(1, z_dim, 1, 3, 3, generator=g)),
        ]
    cases.append(("wan2.1 batch of 2, 2x2 tiles", wan21, torch.randn(2, 16, 1, 5, 5, generator=g)))
    return cases


def _rank(rank: int, world: int, port: int, cases: list, out: str) -> None:
    import torch.distributed as dist

    from diffusion_rollout.server.parallel.vae_split import (
        TileSettings,
        owned_tiles,
        split_tiled_decode,
        tile_grid,
    )

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    report = {}
    try:
        for name, vae, z in cases:
            split = split_tiled_decode(vae, z)
            if rank != 0:
                assert split is None, name
                continue
            with torch.no_grad():
                ref = vae.tiled_decode(z).sample
            grid = tile_grid(vae, tuple(z.shape), TileSettings.of(vae))
            report[name] = {
                "equal": torch.equal(split, ref),
                "shape": tuple(split.shape),
                "tiles": grid.count,
                "rank1_tiles": len(owned_tiles(grid.count, 1, world)),
            }
    finally:
        dist.barrier()  # both ranks leave together (gloo tears down badly under a talking peer)
        dist.destroy_process_group()
    if rank == 0:
        torch.save(report, out)


def test_split_decode_on_two_ranks_equals_the_one_process_tiled_decode(tmp_path):
    import torch.multiprocessing as tmp

    sys.path.insert(0, str(Path(__file__).parents[3]))
    # Built here and handed to both ranks: importing the zoo in each rank would cost seconds.
    tmp.spawn(_rank, args=(2, free_port(), _cases(), str(tmp_path / "report.pt")), nprocs=2)
    report = torch.load(tmp_path / "report.pt")
    assert tuple(report) == CASES
    for name, row in report.items():
        assert row["equal"], (name, row)
    assert report["wan2.1 1x3 tiles"] == {"equal": True, "shape": (1, 3, 5, 24, 56), "tiles": 3,
                                          "rank1_tiles": 1}  # fmt: skip
    # Wan 2.2's decoder works in 2x2 patches: 16 pixels per latent position after unpatchify.
    assert report["wan2.2 1x3 tiles"]["shape"] == (1, 3, 5, 48, 112)
    assert report["wan2.2 one tile"]["rank1_tiles"] == 0
    assert report["wan2.1 batch of 2, 2x2 tiles"]["tiles"] == 4


def test_the_grid_is_the_vaes_and_a_latent_of_one_tile_is_not_tiled():
    from diffusion_rollout.server.parallel.vae_split import TileSettings, needs_tiles, owned_tiles, tile_grid

    vae = _wan21_vae()
    assert TileSettings.of(vae) == TileSettings(256, 256, 192, 192)  # diffusers' defaults
    vae.enable_tiling(tile_sample_min_height=48, tile_sample_min_width=32, tile_sample_stride_width=24)
    settings = TileSettings.of(vae)
    assert settings == TileSettings(48, 32, 192, 24)
    grid = tile_grid(vae, (1, 16, 2, 10, 9), settings)
    assert (grid.rows, grid.cols, grid.count) == ((0,), (0, 3, 6), 3)
    assert (grid.latent_height, grid.latent_width, grid.blend_width) == (6, 4, 8)
    assert not needs_tiles(vae, (1, 16, 2, 6, 4), settings)
    assert needs_tiles(vae, (1, 16, 2, 6, 5), settings)
    assert [owned_tiles(7, r, 3) for r in range(3)] == [[0, 3, 6], [1, 4], [2, 5]]
