"""``ServedPipeline``: the trainer's own diffusers pipeline, with sampling answered by a rollout server.

    from diffusion_rollout.client.served_pipeline import ServedPipeline
    pipeline = ServedPipeline(pipeline, RolloutClient(url))     # the one wrapping line

flow_grpo's ``pipeline_with_logprob(pipeline, ...)`` (the project's, ``client/flow_grpo.py`` for SD3
and ``client/flow_grpo_flux.py`` for FLUX) then sends the call to the server and returns what
flow_grpo's own function returns. Everything else the training script does with ``pipeline``
(``pipeline.transformer`` for the loss, ``pipeline.scheduler.timesteps``, the text encoders) reaches
the wrapped pipeline unchanged: attributes are read from and written to it.

Design decisions:

- **The trainer's side of a sampling call**, done here so the call functions stay about the request:
  :meth:`sync_weights` before it (``client/weights/follow.py``: the adapter or the full weights of
  ``pipeline.transformer`` pushed when the server's differ; ``sync_weights=False`` turns it off),
  :meth:`adopt_schedule` after it (the trainer's scheduler holds the schedule the server used, as
  flow_grpo's ``retrieve_timesteps`` left it), and :meth:`to_trainer` for the results: on the
  pipeline's device, in the dtypes flow_grpo's function returns, whatever the server's dtype.
- **Embeddings travel in the server's dtype** (:meth:`server_dtype`, asked once): the server takes
  its own dtype only, and a float32 trainer beside a bf16 server sends what the server would compute
  in. With equal dtypes nothing is cast, so the ODE path stays the stock pipeline's, bit for bit.
"""

from __future__ import annotations

from typing import Any

import torch

from diffusion_rollout.client.sync_client import RolloutClient
from diffusion_rollout.client.weights.follow import WeightFollower

__all__ = ["ServedPipeline"]

_OWN = ("pipeline", "client", "follower", "_server_dtype")


class ServedPipeline:
    """A diffusers pipeline whose sampling runs on the rollout server behind ``client``."""

    def __init__(
        self,
        pipeline: Any,
        client: RolloutClient,
        *,
        sync_weights: bool = True,
        target_module: str = "transformer",
    ) -> None:
        if not isinstance(client, RolloutClient):
            raise TypeError(f"client must be a RolloutClient, not {type(client).__name__}")
        if isinstance(pipeline, ServedPipeline):
            raise TypeError("the pipeline is already a ServedPipeline")
        object.__setattr__(self, "pipeline", pipeline)
        object.__setattr__(self, "client", client)
        follower = WeightFollower(client, getattr(pipeline, target_module), target_module=target_module)
        object.__setattr__(self, "follower", follower if sync_weights else None)
        object.__setattr__(self, "_server_dtype", None)

    def __getattr__(self, name: str) -> Any:
        if name in _OWN:  # not set yet (a copy or unpickling in progress): never recurse
            raise AttributeError(name)
        return getattr(self.pipeline, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(
            "a ServedPipeline samples through pipeline_with_logprob(pipeline, ...) (the server); to run the "
            "trainer's own pipeline locally call pipeline.pipeline(...)"
        )

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _OWN:
            object.__setattr__(self, name, value)
        else:
            setattr(self.pipeline, name, value)

    def __repr__(self) -> str:
        return f"ServedPipeline({type(self.pipeline).__name__}, {self.client.urls})"

    @property
    def device(self) -> torch.device:
        """Where results go: the pipeline's execution device (as flow_grpo's function returns them)."""
        return self.pipeline._execution_device

    def server_dtype(self) -> torch.dtype:
        if self._server_dtype is None:
            name = self.client.model_info()["dtype"]
            self._server_dtype = getattr(torch, str(name).removeprefix("torch."))
        return self._server_dtype

    def sync_weights(self, *, force: bool = False) -> bool:
        """Push ``pipeline.transformer`` (its adapter, or all of it) when the server's copy differs."""
        if self.follower is None:
            return False
        # The trainer's module may have been replaced (get_peft_model after wrapping): follow it.
        module = getattr(self.pipeline, self.follower.target_module)
        if module is not self.follower.module:
            self.follower = WeightFollower(self.client, module, target_module=self.follower.target_module)
        return self.follower.sync(force=force)

    def to_server(self, embeds: torch.Tensor | None) -> torch.Tensor | None:
        """A conditioning tensor as the server takes it: its dtype, on the CPU."""
        return None if embeds is None else embeds.detach().to("cpu", self.server_dtype())

    def adopt_schedule(self, sigmas: torch.Tensor) -> None:
        """Leave the trainer's scheduler as ``set_timesteps`` leaves it, holding the server's schedule.

        ``sigmas``: the rollout's ``dit_trajectory.sigmas`` (``T + 1``, terminal 0), used as they are so
        the trainer trains on the schedule sampled with. The timesteps are derived from them as
        ``set_timesteps`` derives its own (``sigmas * num_train_timesteps``), not taken from the
        trajectory, which holds what the pipeline passed the model (FLUX's are divided by 1000).
        """
        scheduler = self.pipeline.scheduler
        sigmas = sigmas.to(self.device, torch.float32)
        scheduler.timesteps = sigmas[:-1] * scheduler.config.num_train_timesteps
        scheduler.sigmas = sigmas
        scheduler.num_inference_steps = len(sigmas) - 1
        scheduler._step_index = None
        scheduler._begin_index = None

    def to_trainer(
        self, images: Any, latents: list[torch.Tensor], log_probs: list[torch.Tensor], x_t_dtype: torch.dtype
    ) -> tuple[Any, list[torch.Tensor], list[torch.Tensor]]:
        """Results on the pipeline's device, in flow_grpo's dtypes: ``x_T`` in ``x_t_dtype`` (its
        ``prepare_latents`` draws in the embeddings' dtype), every later latent and the log-probs in
        float32 (its SDE step computes in float32), images in the VAE's dtype."""
        device = self.device
        if isinstance(images, torch.Tensor):
            vae = getattr(self.pipeline, "vae", None)
            images = images.to(device, vae.dtype if vae is not None else torch.float32)
        latents = [x.to(device, x_t_dtype if i == 0 else torch.float32) for i, x in enumerate(latents)]
        log_probs = [lp.to(device, torch.float32) for lp in log_probs]
        return images, latents, log_probs
