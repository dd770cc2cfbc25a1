"""Full-weight operations of ``WeightManager``: the transports' entry points, and their checks.

Design decisions:

- **One interface, four transports.** Disk (``update_weights_from_disk``), multi-part HTTP uploads
  and the upload port (``upload_ops.py``), SGLang tensor payloads (dispatched by ``WeightManager
  .update_from_tensor``) and torch.distributed broadcasts are transports (``transports/``): each
  only receives and stages the tensors; :class:`~.transports.WeightTransactions` validates them all,
  then copies them all in place on the worker (base weights exact under a merged LoRA), then bumps
  the version. A failure anywhere leaves the old weights. A cluster replica runs the same phases
  one at a time, so its front can commit on every replica or on none.
- **Slow I/O off the worker.** Reading files, parsing safetensors bodies and receiving broadcasts
  happen before, in threads, so rollouts keep running meanwhile; only the copies run exclusively.
- **Checks see updates.** Whole-module checksums and the per-tensor checker run on the worker, so a
  checksum asked after an update sees it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

from diffusion_rollout.errors import NotFoundError, WeightUpdateError
from diffusion_rollout.protocol.checksums import ALGORITHMS, module_checksum, tensors_sha256
from diffusion_rollout.server.weights.manager_core import ManagerCore, Version
from diffusion_rollout.server.weights.updater import canonical_name, describe_names, get_module, live_tensors


class FullWeightOps(ManagerCore):
    """Full-weight updates through the transports, update groups and checks (mixed into
    ``WeightManager``)."""

    def remember_received(self, received_sha256: Mapping[str, Mapping[str, str]] | None) -> None:
        """After an upload's apply and bump: keep its hashes, except for a module under a merged
        LoRA (its live weights are not the bytes received)."""
        if not received_sha256:
            return
        self.received.remember(
            {
                module: named
                for module, named in received_sha256.items()
                if not getattr(self.lora.targets.get(module), "merged", False)
            }
        )

    async def update_from_disk(
        self,
        model_path: str,
        target_modules: Sequence[str] | None,
        *,
        flush_cache: bool = True,
        weight_version: Version = None,
    ) -> dict[str, Any]:
        request = {"model_path": model_path, "target_modules": target_modules}
        return await self.transactions.update(
            "disk", request, weight_version=weight_version, flush_cache=flush_cache
        )

    # ------------------------------------------------------------------ torch.distributed
    async def init_group(self, **kwargs: Any) -> dict[str, Any]:
        group = await asyncio.to_thread(lambda: self.groups.init(**kwargs))
        return self.result(
            f"joined weight update group {group.name!r} as rank {group.rank} of {group.world_size} "
            f"({group.backend}, {group.master})"
        )

    async def update_from_distributed(
        self,
        *,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        group_name: str,
        target_modules: Sequence[str] | None = None,
        weight_version: Version = None,
        flush_cache: bool = True,
    ) -> dict[str, Any]:
        request = {
            "names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name,
            "target_modules": target_modules,
        }  # fmt: skip
        return await self.transactions.update(
            "distributed", request, weight_version=weight_version, flush_cache=flush_cache
        )

    async def destroy_group(self, group_name: str) -> dict[str, Any]:
        await asyncio.to_thread(self.groups.destroy, group_name)
        return self.result(f"left weight update group {group_name!r}")

    # ------------------------------------------------------------------ checksums
    async def checksums(
        self, module_names: Sequence[str] | None, algorithm: str = "sglang"
    ) -> dict[str, str]:
        if algorithm not in ALGORITHMS:
            raise WeightUpdateError(f"algorithm must be one of {ALGORITHMS}", field="algorithm")

        def run() -> dict[str, str]:
            modules = self.modules()
            names = list(module_names) if module_names is not None else list(modules)
            unknown = [n for n in names if n not in modules]
            if unknown:
                raise NotFoundError(
                    f"unknown module(s) {', '.join(unknown)}; this pipeline has: {', '.join(sorted(modules))}"
                )
            return {n: module_checksum(modules[n], algorithm) for n in names}

        return await self._exclusive(run)

    async def check_tensors(self, target_module: str, expected: Mapping[str, str]) -> dict[str, Any]:
        if not expected:
            raise WeightUpdateError(
                "expected_named_tensors_sha256 is empty", field="expected_named_tensors_sha256"
            )

        def run() -> str:
            module = get_module(self.engine.pipe, target_module)
            live = live_tensors(module)
            received = self.received.lookup(target_module)
            missing, mismatched, to_hash = [], [], {}
            for raw, digest in expected.items():
                name = canonical_name(raw, target_module, live)
                if name not in live:
                    missing.append(raw)
                elif name in received:
                    if received[name] != digest:
                        mismatched.append(raw)
                else:
                    to_hash[raw] = live[name]
            # Whatever no applied upload vouches for is read back and hashed, on several cores.
            live_digests = tensors_sha256(to_hash)
            mismatched += [raw for raw, got in live_digests.items() if got != expected[raw]]
            if missing or mismatched:
                parts = []
                if missing:
                    parts.append(f"missing {len(missing)} tensor(s): {describe_names(sorted(missing))}")
                if mismatched:
                    parts.append(
                        f"checksum mismatch for {len(mismatched)} tensor(s): {describe_names(sorted(mismatched))}"
                    )
                raise WeightUpdateError(f"module {target_module!r} check failed: " + "; ".join(parts))
            return f"verified {len(expected)} tensor(s) of {target_module!r}"

        return self.result(await self._exclusive(run))
