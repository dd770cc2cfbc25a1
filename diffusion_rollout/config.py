"""The server's one typed configuration object.

Every field has a default and a one-line description; the CLI (``diffusion-rollout serve``) is built
from these fields, and environment variables are read here and nowhere else
(``DIFFUSION_ROLLOUT_<FIELD>`` for any field, ``DIFFUSION_ROLLOUT_CACHE`` for the cache folder).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from diffusion_rollout import config_checks

ENV_PREFIX = "DIFFUSION_ROLLOUT_"


def default_cache_dir() -> Path:
    """Where the demo model is generated on first use: ``$DIFFUSION_ROLLOUT_CACHE`` or ``~/.cache``."""
    env = os.environ.get(ENV_PREFIX + "CACHE")
    return Path(env) if env else Path.home() / ".cache" / "diffusion-rollout"


class ServerConfig(BaseModel):
    """Everything the server can be told at start-up."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    # What to serve
    model: str | None = Field(
        None,
        title="diffusers pipeline folder; unset = the tiny random demo model",
        description="diffusers pipeline folder; unset serves the tiny random demo model",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="weight dtype; auto = bfloat16 on CUDA, float32 on CPU"
    )
    device: str = Field(
        "auto",
        title="torch device; auto = cuda if available, else cpu",
        description="torch device for the pipeline; auto = cuda if available, else cpu",
    )

    # HTTP
    host: str = Field("127.0.0.1", description="address to bind")
    port: int = Field(30000, ge=0, le=65535, description="port to bind (0 = any free port)")
    # repr=False: a logged or printed config must not carry the keys.
    api_key: str | None = Field(
        None, repr=False, description="key required for generation (Authorization: Bearer)"
    )
    admin_key: str | None = Field(
        None, repr=False, description="key required for weight, LoRA, memory and pause endpoints"
    )
    allow_insecure_admin: bool = Field(
        False,
        title="start on a non-loopback host without an admin key",
        description="start on a non-loopback host without an admin key (anyone could replace the weights)",
    )
    health_generate_interval_s: float = Field(
        30.0,
        ge=0,
        title="least seconds between /health_generate generations for keyless callers",
        description="shortest interval between generations /health_generate runs for callers without a key",
    )
    allow_cpu_ipc: bool = Field(
        False,
        title="accept CPU tensors shared by file descriptor in /update_weights_from_tensor",
        description="accept CPU tensors shared by file descriptor in /update_weights_from_tensor "
        "(only a sender sharing this process's multiprocessing authkey can use it; CUDA IPC needs no flag)",
    )
    ipc_timeout_s: float = Field(
        10.0, gt=0, le=600, description="bound on each socket step of fetching a shared CPU tensor"
    )
    strict_fields: bool = Field(
        False,
        title="refuse unknown request fields (422) instead of listing them in ignored_fields",
        description="refuse a rollout request with a field this server does not know (422) instead of "
        "accepting it and naming it in the answer's ignored_fields, as SGLang accepts them",
    )
    ready_wait_s: float = Field(
        900.0,
        ge=0,
        title="how long a request waits for loading/warm-up before a 503 (0 = refuse at once)",
        description="how long a request that arrives while the model loads or warms up waits for it "
        "before a 503 naming the state (0 = refuse at once); /health answers at once throughout",
    )
    same_host_answers: bool = Field(
        True,
        title="write answers into a same-host client's shared-memory file",
        description="write a rollout answer into the shared-memory file a client on this host names "
        "(x-rollout-answer-segment) instead of sending it through the socket",
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="logging level")
    upload_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        title="second port serving only POST /update_weights, faster (0 = any free port)",
        description="also serve POST /update_weights on this port of the same host, read straight "
        "from the socket into the receive buffers (faster than the main port; 0 = a free port, "
        "advertised as weight_upload_port by /model_info); unset = off",
    )
    http_parser: Literal["auto", "httptools", "h11"] = Field(
        "auto",
        title="uvicorn's HTTP/1.1 parser; auto = httptools when installed, else h11",
        description="uvicorn's HTTP/1.1 parser: auto = httptools when installed (not a dependency), else h11",
    )

    # Batching and queueing
    max_batch_size: int = Field(16, ge=1, description="most samples run in one pipeline call")
    max_batch_pixels: int = Field(
        8 * 1024 * 1024,
        ge=1,
        title="most output pixels (width*height*frames) a call grows to by merging requests",
        description="most output pixels (width*height*frames, summed over samples) a pipeline call is "
        "grown to by taking further queued requests in; one request is never split by it. A call "
        "this large keeps the GPU busy on its own, and merging more would only hold every answer "
        "back until the whole call ends (videos: one request per call)",
    )
    batch_wait_ms: float = Field(2.0, ge=0, description="how long the worker waits to fill a batch")
    max_queue_depth: int = Field(256, ge=1, description="most requests waiting; more get 429")
    prompt_cache_size: int = Field(
        256, ge=0, description="encoded prompts kept (a GRPO group repeats one prompt)"
    )

    # Limits
    max_steps: int = Field(200, ge=1, description="most num_inference_steps per request")
    max_pixels: int = Field(2048 * 2048, ge=1, description="most width*height per output")
    max_frames: int = Field(257, ge=1, description="most video frames per output")
    max_outputs_per_request: int = Field(64, ge=1, description="most num_outputs_per_prompt")
    max_prompt_chars: int = Field(
        20_000,
        ge=1,
        title="most characters per prompt or negative prompt",
        description="most characters per prompt or negative prompt (checked before any tokenizing)",
    )
    max_prompt_tokens: int | None = Field(
        None,
        ge=1,
        title="most tokens per prompt or sent embedding; unset = truncate as diffusers does",
        description="most tokens per prompt by the pipeline's first tokenizer, and per sent embedding "
        "(prompt_embeds and negatives: their token length); unset: longer prompts are truncated to the "
        "pipeline's max_sequence_length as diffusers does, embeddings bounded by the model's most",
    )
    max_body_bytes: int = Field(16 * 2**20, ge=1024, description="largest JSON request body")
    max_upload_bytes: int = Field(8 * 2**30, ge=1024, description="largest weight-upload part")
    upload_buffer_keep_bytes: int = Field(
        64 * 2**30,
        ge=0,
        title="weight-upload receive buffers kept between uploads; 0 frees them",
        description="receive buffers kept between weight uploads (pinned on CUDA); 0 frees them",
    )
    request_timeout_s: float = Field(900.0, gt=0, description="longest a rollout may wait and run")
    max_trajectory_bytes: int = Field(4 * 2**30, ge=1, description="largest trajectory in one response")
    shutdown_grace_s: float = Field(30.0, ge=0, description="how long shutdown waits for in-flight work")

    # Rewards scored on the server
    reward: list[str] = Field(
        default_factory=list,
        title="NAME=SPEC, repeatable: a reward scored on the server (env: ';' between rewards)",
        description="NAME=SPEC, repeatable: a reward the server scores when a request names it in "
        "'rewards' (SPEC as the recipes' --reward: a built-in such as jpeg_compressibility, "
        "clip:/folder, vlm_judge?model=/folder, http://host/path, module:callable); loaded at start, "
        "and a reward that fails to load stops the server; in DIFFUSION_ROLLOUT_REWARD, separate with ';'",
    )
    reward_gpus: str | None = Field(
        None,
        title="CUDA device indices for the reward models (e.g. 1,2); unset = the rollout device",
        description="CUDA devices for the reward models, comma-separated indices (e.g. 1 or 1,2: the "
        "rewards are placed on them in turn); unset = the rollout device",
    )
    reward_timeout_s: float = Field(
        600.0,
        gt=0,
        title="longest one reward may take for one request",
        description="longest one reward may take for one request before its outputs are marked failed",
    )
    reward_batch_size: int = Field(
        64,
        ge=1,
        title="most samples one reward call scores (halved on out-of-memory)",
        description="most samples one reward call scores, taken from every request waiting for that "
        "reward; halved for that reward whenever a call runs out of GPU memory",
    )

    # Input images (image-conditioned families)
    image_path_root: str | None = Field(
        None,
        title="folder image_path may read from; unset refuses image_path",
        description="folder image_path may read from (subfolders too); unset refuses image_path",
    )
    max_image_bytes: int = Field(32 * 2**20, ge=1, description="largest input image file")
    max_image_pixels: int = Field(4096 * 4096, ge=1, description="most width*height of an input image")

    # Speed (the default is the fastest exact set; the eager path is the bit-exact one)
    speed: Literal["exact", "fast"] = Field(
        "exact",
        title="preset for the speed options not given: exact (bit-exact) or fast (fp8 + compile)",
        description="preset that fills in the speed options not given: exact = the fastest bit-exact set "
        "measured on this device (CUDA: pipeline_lanes=2; CPU: plain eager), fast = quantize=fp8 + "
        "compile (compile alone where FP8 cannot run); the choice is logged and shown in /server_info",
    )
    warmup_shapes: str | None = Field(
        None,
        title="with compile: WIDTHxHEIGHT[xFRAMES],... to compile before ready; none = no warm-up",
        description="with compile: the request sizes to compile before /health_generate says ready, "
        "WIDTHxHEIGHT[xFRAMES] comma-separated (e.g. 512x512,1024x768), each for batch sizes 1.."
        "max_batch_size (one dynamic-batch compile); unset = the model's default size; none = no warm-up "
        "(compile on the first request of each shape)",
    )
    warmup_remembered_shapes: bool = Field(
        True,
        title="with compile and a compile cache: also warm the request shapes earlier starts served",
        description="with compile, a compile cache and no warmup_shapes: also warm up, after the default "
        "size, the request shapes earlier starts on the same cache key served (up to 8, kept in the key "
        "folder's served_shapes.json); off: the default size only (shapes are still recorded)",
    )
    compile_cache: str | None = Field(
        None,
        title="with compile: folder for compile artifacts; unset = <cache-dir>/compile; none = off",
        description="with compile: folder for torch's compile artifacts, reused by later starts with "
        "the same torch, device, model, dtype and speed options (a keyed subfolder each), used only when "
        "it is the server user's own and writable by no one else (else refused, compiled afresh); unset = "
        "<cache_dir>/compile; none = torch's own temporary cache",
    )
    precompile_blocks: bool = Field(
        True,
        title="with compile: save/load ahead-of-time compiled blocks in the compile cache",
        description="with compile and a compile cache: after a warm-up, save each kind of block compiled "
        "ahead of time (torch's aot_compile) in the cache, and load them at the next start so its warm-up "
        "skips Dynamo's tracing; off for the rest of the process at the first weight or LoRA change; "
        "off: every start traces the blocks",
    )
    warmup_profile: str | None = Field(
        None,
        title="with compile: folder for a cProfile and stack samples of the warm-up",
        description="with compile: folder (created if missing) for a profile of the warm-up: "
        "warmup_call_<i>.pstats and .txt (cProfile of each warm-up call on the worker thread) and "
        "warmup_stacks.txt (the worker's Python stack every warmup_profile_interval_s seconds, appended, "
        "so a warm-up cut off mid-call still shows where it was); listed in /server_info; unset = none",
    )
    warmup_profile_interval_s: float = Field(
        10.0, gt=0, description="with warmup_profile: seconds between the worker's stack samples"
    )
    warmup_profile_cprofile: bool = Field(
        True,
        title="with warmup_profile: cProfile each warm-up call (off: stack samples only)",
        description="with warmup_profile: cProfile each warm-up call (about 1.5-2x the seconds of "
        "Python-heavy work such as Dynamo's tracing); --no-warmup-profile-cprofile keeps the stack samples only",
    )
    compile: bool = Field(False, description="regional torch.compile of transformer blocks (not bit-exact)")
    attention_backend: str | None = Field(
        None,
        title="diffusers attention backend (e.g. flash; fa4 = FlashAttention-4); not bit-exact",
        description="diffusers attention backend name, e.g. flash (not bit-exact unless native); fa4 = "
        "FlashAttention-4 from the flash-attn-4 package (Hopper or newer GPU; refused at start-up elsewhere)",
    )
    quantize: Literal["fp8"] | None = Field(
        None,
        title="fp8: torchao float8 linears (CUDA, compute capability >= 8.9); not bit-exact",
        description="fp8: torchao float8 (rowwise) on the denoiser's larger linears, embedders, norms and "
        "the final projection kept bf16; CUDA GPU of compute capability >= 8.9 and "
        "torchao (pip install 'diffusion-rollout[fast]') needed, refused at start-up elsewhere; use with "
        "--compile; not bit-exact",
    )
    cuda_graphs: bool = Field(
        False,
        title="replay the eager denoiser as CUDA graphs per shape (CUDA; bit-exact)",
        description="replay the eager denoiser as CUDA graphs per shape bucket (CUDA only; bit-exact)",
    )
    cuda_graph_max_buckets: int = Field(
        8, ge=1, description="most captured CUDA-graph shape buckets; other shapes run eager"
    )

    pipeline_lanes: int = Field(
        1,
        ge=1,
        le=8,
        title="pipeline calls in flight at once, one CUDA stream each (eager only; bit-exact)",
        description="pipeline calls in flight at once, each on its own thread, CUDA stream and pipeline "
        "object sharing the modules: one call's kernels fill the gaps between "
        "another's, every call bit-identical to one lane; eager only (no compile, cuda_graphs, "
        "context_parallel), feature_cache requests get 400",
    )

    # Context parallelism: one request's transformer calls over several ranks
    context_parallel: int = Field(
        1,
        ge=1,
        title="ranks per engine for one request's transformer calls (Wan, LTX-2)",
        description="ranks per engine for one request's transformer calls (Wan families, LTX-2); "
        ">1 starts k-1 follower processes, one per GPU (a CPU engine mirrors them, for tests)",
    )
    context_parallel_mode: Literal["ulysses", "ring", "hybrid"] = Field(
        "ulysses",
        title="how attention is sharded over the ranks: ulysses, ring or hybrid",
        description="how attention is sharded over the ranks on CUDA: ulysses (heads exchanged all-to-all; "
        "heads must divide by k), ring (key/value blocks passed round all k ranks), hybrid (Ulysses groups "
        "of k / context_parallel_ring_degree ranks, rings across them); ring and hybrid run the "
        "_native_flash attention backend (bfloat16/float16 only) unless attention_backend is set, and "
        "serve the Wan families only",
    )
    context_parallel_ring_degree: int | None = Field(
        None,
        title="hybrid only: ranks per ring (unset = 2)",
        description="hybrid only: ranks per ring (unset = 2); context_parallel must be a multiple of it and "
        "larger, the Ulysses degree is context_parallel / it; a start-up error with another mode",
    )
    context_parallel_vae: Literal["rank0", "split"] = Field(
        "rank0",
        title="VAE decode on rank 0 alone, or split into tiles over the ranks (Wan)",
        description="where the VAE decode runs: rank0 = on rank 0 alone, the stock untiled decode; split = "
        "the VAE's tiled decode with its tiles spread over the context_parallel ranks (Wan VAEs only), "
        "bit-identical to one process's tiled decode, not to the untiled one",
    )
    context_parallel_timeout_s: float = Field(
        600.0,
        gt=0,
        title="bound on follower start-up and on each collective",
        description="bound on follower start-up (model load) and on each collective with the followers",
    )

    # Replicas on Ray (diffusion_rollout.cluster); unset replicas = one process, Ray never imported
    replicas: int | None = Field(
        None,
        ge=1,
        title="engine replicas as Ray actors behind this front; unset = one process",
        description="engine replicas as Ray actors behind this front; unset = one process",
    )
    gpus_per_replica: float | None = Field(
        None,
        ge=0,
        title="GPUs per replica (fractions share one); unset = context_parallel on CUDA, else 0",
        description="GPUs per replica (fractions share a GPU); unset = context_parallel on CUDA, 0 on CPU",
    )
    cpus_per_replica: float = Field(1.0, ge=0, description="CPU cores Ray reserves per replica")
    replica_max_restarts: int = Field(
        3,
        ge=0,
        title="times Ray restarts a dead replica",
        description="times Ray restarts a dead replica (it re-syncs weights from a peer)",
    )
    ray_address: str | None = Field(
        None,
        title="Ray cluster to join ('auto' = the local one); unset = start Ray here",
        description="Ray cluster to join ('auto' = the local 'ray start' one); unset = start Ray here",
    )
    placement: Literal["spread", "pack"] | None = Field(
        None,
        title="Ray placement group: 'spread' over as many nodes as it can, 'pack' onto as few",
        description="where the replicas go: a Ray placement group of one bundle per replica, 'spread' over "
        "as many nodes as it can, 'pack' onto as few; unset = Ray's default scheduling, each replica "
        "wherever it fits",
    )

    # Demo model
    cache_dir: str = Field(
        default_factory=lambda: str(default_cache_dir()), description="folder for the generated demo model"
    )

    @field_validator("reward", mode="before")
    @classmethod
    def _reward_list(cls, value: object) -> object:
        return config_checks.reward_list(value)

    @field_validator("reward_gpus")
    @classmethod
    def _reward_gpus(cls, value: str | None) -> str | None:
        return config_checks.gpu_indices("reward_gpus", value)

    def reward_specs(self) -> dict[str, str]:
        """The configured rewards, ``{NAME: SPEC}`` in the order given."""
        if not self.reward:
            return {}
        from diffusion_rollout.rewards import parse_named_reward

        return dict(parse_named_reward(v) for v in self.reward)

    @field_validator("warmup_shapes")
    @classmethod
    def _warmup_shapes_parse(cls, value: str | None) -> str | None:
        return config_checks.warmup_shapes(value)

    @field_validator("warmup_profile")
    @classmethod
    def _warmup_profile_folder(cls, value: str | None) -> str | None:
        return config_checks.writable_folder("warmup_profile", value)

    # What --speed chose (speed_presets.py), set once by _apply_speed_preset.
    _speed_choice: object = PrivateAttr(None)

    @model_validator(mode="after")
    def _apply_speed_preset(self) -> ServerConfig:
        # First of the validators, so that they check the options as expanded. Written through
        # __dict__: assignment would validate again, and the preset applies once.
        if self._speed_choice is not None:
            return self
        from diffusion_rollout.speed_presets import choose

        device = self.resolved_device()
        fp8_reason = None
        if self.speed == "fast" and "quantize" not in self.model_fields_set:
            from diffusion_rollout.fast_tier_checks import unsupported_reason

            fp8_reason = unsupported_reason(
                quantize="fp8", attention_backend=None, device=device, check_hardware=self.replicas is None
            )
        given = {n: getattr(self, n) for n in self.model_fields_set}
        choice = choose(self.speed, device=device, given=given, fp8_unavailable=fp8_reason)
        for name, value in choice.applied.items():
            self.__dict__[name] = value
        self._speed_choice = choice
        return self

    @property
    def speed_choice(self):
        """The :class:`~diffusion_rollout.speed_presets.SpeedChoice` behind the speed options."""
        return self._speed_choice

    def resolved_compile_cache(self) -> str | None:
        """The compile cache's root folder, or None when it is off."""
        if self.compile_cache is not None and self.compile_cache.lower() == "none":
            return None
        return self.compile_cache or str(Path(self.cache_dir) / "compile")

    @model_validator(mode="after")
    def _options_fit_together(self) -> ServerConfig:
        config_checks.check_options(self)
        return self

    def context_parallel_degrees(self) -> tuple[int, int]:
        """``(ring degree, Ulysses degree)`` of ``context_parallel_mode``; their product is ``context_parallel``."""
        k = self.context_parallel
        if self.context_parallel_mode == "ring":
            return k, 1
        if self.context_parallel_mode == "hybrid":
            ring = self.context_parallel_ring_degree or 2
            return ring, max(k // ring, 1)
        return 1, k

    @classmethod
    def from_env(cls, **overrides: object) -> ServerConfig:
        """Fields from ``DIFFUSION_ROLLOUT_<FIELD>`` environment variables, then ``overrides``."""
        values: dict[str, object] = {}
        for name in cls.model_fields:
            raw = os.environ.get(ENV_PREFIX + name.upper())
            if raw is not None:
                values[name] = raw
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls.model_validate(values)

    def resolved_device(self) -> str:
        """The concrete torch device string."""
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def resolved_dtype(self):
        """The concrete torch dtype."""
        import torch

        if self.dtype == "auto":
            return torch.bfloat16 if self.resolved_device().startswith("cuda") else torch.float32
        return getattr(torch, self.dtype)

    def resolved_gpus_per_replica(self) -> float:
        """GPUs each replica asks Ray for: the set value, else ``context_parallel`` (one per rank) when
        the front sees CUDA, else 0."""
        if self.gpus_per_replica is not None:
            return self.gpus_per_replica
        return float(self.context_parallel) if self.resolved_device().startswith("cuda") else 0.0

    def limits(self) -> dict[str, object]:
        """The limits reported by ``/server_info``."""
        names = [
            "max_batch_size", "max_batch_pixels", "max_queue_depth", "max_steps", "max_pixels", "max_frames",
            "max_outputs_per_request", "max_body_bytes", "max_upload_bytes", "request_timeout_s",
            "max_trajectory_bytes", "max_prompt_chars", "max_prompt_tokens",
            "max_image_bytes", "max_image_pixels",
        ]  # fmt: skip
        return {n: getattr(self, n) for n in names}
