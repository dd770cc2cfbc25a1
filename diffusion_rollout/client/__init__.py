"""The thin trainer client: rollouts over HTTP, weight and LoRA pushes, and replay for training.

- ``sync_client`` / ``async_client``: :class:`RolloutClient` / :class:`AsyncRolloutClient` (every
  endpoint of api.md and weights.md, typed results, bounded concurrency, retries only where a
  repeat is harmless); ``calls`` describes each endpoint once for both, ``base`` holds what they
  share (connection settings, :class:`RetryPolicy`, headers, error mapping), ``receive`` reads a
  rollout answer into one buffer of its Content-Length. ``http`` re-exports the client names under
  their original import path.
- ``results``: :class:`RolloutOutput` and friends (torch tensors, api.md's field names).
- ``weights``: bounded multi-part safetensors uploads with one atomic commit, PEFT adapter pushes,
  checksum verification, the same-host IPC body and the NCCL/gloo broadcaster (one module each).
- ``replay`` / ``training``: recompute a rollout's steps with the trainer's transformer and the
  shared transition function (ratio exactly 1 on-policy), plus the common loss pieces.
- ``stream``: :class:`RolloutStream` / :class:`AsyncRolloutStream`, rollouts generated ahead of the
  trainer with bounded staleness (``RolloutClient.rollout_stream``, ``AsyncRolloutClient.rollout_stream``).
- ``exceptions``: server errors as the project's exception classes, with status and message.

Importing this package opens no connection and starts nothing.
"""

from diffusion_rollout.client.async_client import AsyncRolloutClient
from diffusion_rollout.client.base import RetryPolicy
from diffusion_rollout.client.exceptions import (
    ChecksumMismatchError,
    RequestValidationError,
    RolloutConnectionError,
    RolloutHTTPError,
    RolloutTimeoutError,
)
from diffusion_rollout.client.replay import (
    replay_log_prob,
    replay_model_output,
    replay_stream_model_outputs,
    stack_envs,
)
from diffusion_rollout.client.results import (
    DitTrajectory,
    ReplaySettings,
    RolloutOutput,
    UpdateResult,
    group_by_server_batch,
)
from diffusion_rollout.client.stream import AsyncRolloutStream, RolloutStream, StreamBatch, StreamStats
from diffusion_rollout.client.sync_client import RolloutClient
from diffusion_rollout.client.training import (
    ReplayBatch,
    ReplayedStep,
    clipped_policy_loss,
    gaussian_kl,
    group_advantages,
    ratio_stats_by_staleness,
    replay_step,
    replay_steps,
    tis_policy_loss,
    trainable_steps,
    tree_advantages,
)
from diffusion_rollout.client.weights import (
    WeightBroadcaster,
    build_update_weights_from_tensor_request,
    lora_checksum,
    lora_config_dict,
    lora_state_dict,
    push_lora,
    push_weights,
    push_weights_ipc,
    safetensors_parts,
    verify_lora,
    verify_weights_checksum,
)

__all__ = [
    "AsyncRolloutClient",
    "AsyncRolloutStream",
    "ChecksumMismatchError",
    "DitTrajectory",
    "ReplayBatch",
    "ReplaySettings",
    "ReplayedStep",
    "RequestValidationError",
    "RetryPolicy",
    "RolloutClient",
    "RolloutConnectionError",
    "RolloutHTTPError",
    "RolloutOutput",
    "RolloutStream",
    "RolloutTimeoutError",
    "StreamBatch",
    "StreamStats",
    "UpdateResult",
    "WeightBroadcaster",
    "build_update_weights_from_tensor_request",
    "clipped_policy_loss",
    "gaussian_kl",
    "group_advantages",
    "group_by_server_batch",
    "lora_checksum",
    "lora_config_dict",
    "lora_state_dict",
    "push_lora",
    "push_weights",
    "push_weights_ipc",
    "ratio_stats_by_staleness",
    "replay_log_prob",
    "replay_model_output",
    "replay_step",
    "replay_steps",
    "replay_stream_model_outputs",
    "safetensors_parts",
    "stack_envs",
    "tis_policy_loss",
    "trainable_steps",
    "tree_advantages",
    "verify_lora",
    "verify_weights_checksum",
]
