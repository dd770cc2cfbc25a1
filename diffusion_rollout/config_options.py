"""How ``ServerConfig``'s options read to a person: their groups by concern, environment variables and
defaults, as ``serve --help`` and the docs' option table show them. The options themselves and their
validation stay in ``config.py``."""

from __future__ import annotations

from diffusion_rollout.config import ENV_PREFIX, ServerConfig

#: ``ServerConfig``'s fields by concern, in the order ``serve --help`` and docs/serving.md show them
#: (every field in exactly one group; tests/entrypoints/test_cli_help.py checks it).
OPTION_GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("Model", ("model", "dtype", "device", "cache_dir", "log_level")),
    (
        "HTTP",
        (
            "host", "port", "http_parser", "ready_wait_s", "health_generate_interval_s",
            "strict_fields", "same_host_answers", "shutdown_grace_s",
        ),
    ),
    ("Security", ("api_key", "admin_key", "allow_insecure_admin")),
    (
        "Batching and queueing",
        ("max_batch_size", "max_batch_pixels", "batch_wait_ms", "max_queue_depth", "prompt_cache_size"),
    ),
    (
        "Limits",
        (
            "max_steps", "max_pixels", "max_frames", "max_outputs_per_request", "max_prompt_chars",
            "max_prompt_tokens", "max_body_bytes", "max_trajectory_bytes", "request_timeout_s",
        ),
    ),
    (
        "Weight updates",
        ("upload_port", "max_upload_bytes", "upload_buffer_keep_bytes", "allow_cpu_ipc", "ipc_timeout_s"),
    ),
    ("Rewards", ("reward", "reward_gpus", "reward_timeout_s", "reward_batch_size")),
    ("Input images", ("image_path_root", "max_image_bytes", "max_image_pixels")),
    (
        "Speed",
        (
            "speed", "compile", "attention_backend", "quantize", "cuda_graphs", "cuda_graph_max_buckets",
            "pipeline_lanes",
        ),
    ),
    (
        "Compile warm-up and cache",
        (
            "warmup_shapes", "warmup_remembered_shapes", "compile_cache", "precompile_blocks", "warmup_profile",
            "warmup_profile_interval_s", "warmup_profile_cprofile",
        ),
    ),
    (
        "Context parallelism",
        (
            "context_parallel", "context_parallel_mode", "context_parallel_ring_degree",
            "context_parallel_vae", "context_parallel_timeout_s",
        ),
    ),
    (
        "Replicas on Ray",
        (
            "replicas", "gpus_per_replica", "cpus_per_replica", "replica_max_restarts", "ray_address",
            "placement",
        ),
    ),
)  # fmt: skip


def option_env_names(name: str) -> tuple[str, ...]:
    """The environment variables that set the field ``name`` (``from_env``; the cache folder's too)."""
    names = (ENV_PREFIX + name.upper(),)
    return (*names, ENV_PREFIX + "CACHE") if name == "cache_dir" else names


def _binary_size(value: int) -> str:
    for unit, size in (("Gi", 2**30), ("Mi", 2**20)):
        if value >= size and value % size == 0:
            return f"{value // size} {unit}"
    return ""


def option_default_text(name: str) -> str:
    """The field's default as a person reads it: ``unset``, ``on``/``off``, ``16777216 (16 Mi)``."""
    field = ServerConfig.model_fields[name]
    if name == "cache_dir":
        return "~/.cache/diffusion-rollout"
    if field.default_factory is not None:
        value = field.default_factory()
        return "none" if value == [] else str(value)
    value = field.default
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, int) and (size := _binary_size(value)):
        return f"{value} = {size}"
    return str(value)
