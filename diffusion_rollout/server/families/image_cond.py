"""What image-conditioned families share: the input image reaches the transformer as latents
concatenated to the noisy latent.

FLUX.1 Kontext and Qwen-Image-Edit append the packed image latents to the latent *tokens*
(``cat([x_t, image_latents], dim=1)``) and keep only the first ``x_t`` tokens of the model output;
Wan image-to-video appends a mask and the encoded first frame on the *channel* axis
(``cat([x_t, condition], dim=1)`` on ``[B, C, F, H, W]``) and uses the whole output. Either way the
scheduler (and so the rollout, its log-probs and ``dit_trajectory``) only ever sees ``x_t``.

``denoising_env.latent_condition`` records the appended part exactly as the transformer received it
(cut from the recorded step-0 input, so in the dtype the model saw): ``{"latents": [1, ...],
"dim": d, "slice_output": bool}``. A replayer rebuilds the model input as
``cat([x_t, latents], dim=d)`` and, with ``slice_output``, keeps the first ``x_t.shape[d]`` entries
of each branch's output before combining the guidance branches, which is the pipelines' order.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch


class LatentConcatMixin:
    """Mixin for adapters whose pipeline concatenates image latents to the transformer input."""

    image_inputs: ClassVar[int] = 1
    concat_dim: ClassVar[int] = 1  # the axis the pipeline concatenates on (tokens or channels)
    slice_output: ClassVar[bool] = True  # whether the pipeline cuts the output back to x_t's extent

    def latent_extent(self, settings: Any) -> int:
        """Size of ``x_t`` along :attr:`concat_dim` (what comes before the image latents)."""
        raise NotImplementedError

    def image_call_kwargs(self, images: tuple) -> dict[str, Any]:
        return {"image": images[0].image}

    def split_env(self, calls, batch, settings, timestep_dtype):
        envs = super().split_env(calls, batch, settings, timestep_dtype)
        x = calls[0].get("hidden_states") if calls else None
        if not isinstance(x, torch.Tensor):
            return envs
        n = self.latent_extent(settings)
        d = self.concat_dim
        for row, env in enumerate(envs):
            env["latent_condition"] = {
                "latents": x[row : row + 1].narrow(d, n, x.shape[d] - n),
                "dim": d,
                "slice_output": self.slice_output,
            }
        return envs


def packed_tokens(pipe: Any, height: int, width: int) -> int:
    """Latent tokens of a ``height`` x ``width`` image in pipelines that pack 2x2 latent patches."""
    f = int(pipe.vae_scale_factor) * 2
    return (int(height) // f) * (int(width) // f)
