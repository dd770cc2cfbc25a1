"""The update core: validate every tensor of an update, then copy them all in place, or none.

Design decisions:

- Validate-all-then-apply. :func:`plan_update` checks the whole payload before the first copy:
  every name exists in its target module (after stripping a ``"<target>."`` prefix, as verl-omni
  sends), no name comes twice, shapes match exactly, the dtype converts (float to float, integer and
  bool only to the same dtype) and the converted values are finite (a float32 master that overflows
  float16 is caught here, not in a rollout). Problems are collected and reported together in one
  ``WeightUpdateError`` naming a few names per kind and a count.
- One defined cast: ``tensor.to(param.dtype)``, done during planning so the copy itself cannot fail
  on a dtype and the client can reproduce the exact bytes (``checksums.cast_named_tensors``).
- Names are the module's *base* names: PEFT wrappers are seen through (``x.base_layer.weight`` is
  ``x.weight``) and adapter tensors are not targets of a full update. Buffers are targets too
  (diffusers checkpoints may carry them), though checksums cover parameters only.
- :func:`apply_copies` backs up every touched tensor before the first write (on the same device; on
  CUDA OOM the backup goes to the CPU) so a failure mid-copy restores the exact previous bytes and
  raises ``WeightApplyError``. A failure while backing up changes nothing.
- The copy is ``target.data.copy_(source)`` under ``torch.no_grad``: parameter objects keep their
  identity (optimizers, PEFT wrappers and pinned-memory bookkeeping hold references to them).
- Weights held quantized (a tensor subclass: torchao's float8 under ``--quantize fp8``) take no
  in-place copy of plain values. A module whose loader quantized it carries a re-quantizer
  (:data:`REQUANTIZE_ATTR`, set by ``server/speed/fast_tier.py``): such a weight is replaced by a new
  parameter quantized from the update's values, the old parameter object kept as the backup (put
  back on a failure or a cluster rollback, :func:`restore_copy`). Without one, the update is refused
  before anything changes.
- Nothing here knows about threads: the manager runs planning and applying on the engine's worker
  thread, between generation batches.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from diffusion_rollout.errors import WeightApplyError, WeightUpdateError
from diffusion_rollout.protocol.checksums import base_named_buffers, base_named_parameters

logger = logging.getLogger(__name__)

# How many names of one kind an error message lists before it only counts the rest.
SHOWN_NAMES = 5
# A module whose weights a loader quantized carries ``(values, held) -> new held tensor`` under this
# attribute: full updates re-quantize those weights instead of refusing them.
REQUANTIZE_ATTR = "_rollout_requantize"
Requantize = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

BeforeCopy = Callable[[str, str], None]


# ---------------------------------------------------------------------------- naming helpers
def describe_names(names: Iterable[str], limit: int = SHOWN_NAMES) -> str:
    """``"a, b, c"`` or ``"a, b, c, d, e and 12 more"``."""
    items = list(names)
    shown = ", ".join(items[:limit])
    if len(items) > limit:
        shown += f" and {len(items) - limit} more"
    return shown


def pipeline_modules(pipe) -> dict[str, nn.Module]:
    """The pipeline's components that are ``nn.Module`` (what ``target_modules`` can name)."""
    components = getattr(pipe, "components", None) or {}
    return {name: mod for name, mod in components.items() if isinstance(mod, nn.Module)}


def get_module(pipe, name: str) -> nn.Module:
    modules = pipeline_modules(pipe)
    if name not in modules:
        raise WeightUpdateError(
            f"module {name!r} not found in pipeline; this pipeline has: {', '.join(sorted(modules)) or 'none'}",
            field="target_modules",
        )
    return modules[name]


def live_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """Base parameters and buffers of ``module`` by name (PEFT wrappers seen through)."""
    out = dict(base_named_parameters(module))
    for name, buf in base_named_buffers(module):
        out.setdefault(name, buf)
    return out


def canonical_name(name: str, target: str, known: Mapping[str, object]) -> str:
    """Strip a leading ``"<target>."`` (verl-omni sends ``transformer.blocks.0...``)."""
    if name not in known and name.startswith(target + "."):
        return name[len(target) + 1 :]
    return name


# ---------------------------------------------------------------------------- validation
@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype


def module_spec(module: nn.Module) -> dict[str, TensorSpec]:
    """Shapes and dtypes of a module's update targets (a snapshot; updates never change them)."""
    return {n: TensorSpec(tuple(t.shape), t.dtype) for n, t in live_tensors(module).items()}


@dataclass
class Problems:
    """Validation failures of one update, reported together."""

    unknown: list[str] = field(default_factory=list)
    duplicate: list[str] = field(default_factory=list)
    shape: list[str] = field(default_factory=list)
    dtype: list[str] = field(default_factory=list)
    nonfinite: list[str] = field(default_factory=list)
    other: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return any((self.unknown, self.duplicate, self.shape, self.dtype, self.nonfinite, self.other))

    def message(self) -> str:
        parts = []
        kinds = [
            ("unknown tensor names", self.unknown),
            ("names sent more than once", self.duplicate),
            ("shape mismatch", self.shape),
            ("dtype cannot convert", self.dtype),
            ("non-finite values after the cast", self.nonfinite),
            ("invalid entries", self.other),
        ]
        for label, items in kinds:
            if items:
                parts.append(f"{label} ({len(items)}): {describe_names(items)}")
        return "weight update rejected, nothing changed: " + "; ".join(parts)

    def raise_if_any(self) -> None:
        if self:
            raise WeightUpdateError(self.message())


def dtype_converts(source: torch.dtype, target: torch.dtype) -> bool:
    """Float to any float, complex to complex; integer and bool only to themselves."""
    if target.is_floating_point:
        return source.is_floating_point
    if target.is_complex:
        return source.is_complex
    return source == target


def check_and_convert(
    module_name: str,
    named_tensors: Iterable[tuple[str, object]],
    spec: Mapping[str, TensorSpec],
    problems: Problems,
    *,
    seen: set[str] | None = None,
    check_finite: bool = True,
) -> dict[str, torch.Tensor]:
    """Validate ``(name, tensor)`` pairs against ``spec``; return them converted to the target dtypes.

    Problems are appended to ``problems`` (prefixed with the module name) instead of raised, so
    one answer names every failure. ``seen`` carries names across the parts of one upload.
    ``check_finite=False`` only for tensors already checked after the same cast (staged upload parts).
    """
    seen = set() if seen is None else seen
    out: dict[str, torch.Tensor] = {}
    wheres: dict[str, str] = {}
    for raw_name, tensor in named_tensors:
        if not isinstance(raw_name, str) or not isinstance(tensor, torch.Tensor):
            problems.other.append(f"{module_name}: {raw_name!r} is not a (name, tensor) pair")
            continue
        name = canonical_name(raw_name, module_name, spec)
        where = f"{module_name}.{name}"
        if name in seen:
            problems.duplicate.append(where)
            continue
        seen.add(name)
        target = spec.get(name)
        if target is None:
            problems.unknown.append(where)
            continue
        if tuple(tensor.shape) != target.shape:
            problems.shape.append(f"{where}: got {tuple(tensor.shape)}, expected {target.shape}")
            continue
        if not dtype_converts(tensor.dtype, target.dtype):
            problems.dtype.append(f"{where}: {tensor.dtype} -> {target.dtype}")
            continue
        out[name] = tensor.detach().to(target.dtype)
        wheres[name] = f"{where} ({tensor.dtype} -> {target.dtype})"
    names = [n for n, t in out.items() if check_finite and (t.is_floating_point() or t.is_complex())]
    for name, finite in zip(names, finite_flags([out[n] for n in names]), strict=True):
        if not finite:
            problems.nonfinite.append(wheres[name])
            del out[name]
    return out


def finite_flags(tensors: Sequence[torch.Tensor]) -> list[bool]:
    """Whether each tensor is all finite, with one device synchronisation per device.

    A ``bool(t.isfinite().all())`` per tensor waits for the GPU once per tensor; an adapter or a
    transformer has hundreds, which made that wait most of a LoRA push. Real tensors are checked
    through their minimum and maximum (NaN propagates into both, an infinity is one of them): one
    reduction without a boolean temporary, 25x faster than ``isfinite().all()`` on a CPU (bf16: 4.3
    vs 0.16 GB/s), which is where uploaded parts are checked.
    """
    flags: list[bool | None] = [None] * len(tensors)
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        if t.numel() == 0:
            flags[i] = True
        else:
            by_device.setdefault(t.device, []).append(i)
    for indices in by_device.values():
        found = torch.stack([_all_finite(tensors[i]) for i in indices]).tolist()
        for i, ok in zip(indices, found, strict=True):
            flags[i] = bool(ok)
    return [bool(f) for f in flags]


def _all_finite(t: torch.Tensor) -> torch.Tensor:
    """A 0-d bool tensor on ``t``'s device (no synchronisation)."""
    if t.is_floating_point():
        try:
            low, high = torch.aminmax(t)
            return torch.isfinite(low) & torch.isfinite(high)
        except (RuntimeError, NotImplementedError):  # a dtype without aminmax (float8 on some builds)
            pass
    return torch.isfinite(t).all()


# ---------------------------------------------------------------------------- plan and apply
@dataclass(frozen=True)
class PlannedCopy:
    module: str
    name: str
    target: torch.Tensor
    source: torch.Tensor
    # For a weight held quantized: ``(values, held) -> new held tensor``, and where the parameter
    # lives (the replacement is set there instead of copying into ``target``).
    requantize: Requantize | None = None
    owner: nn.Module | None = None

    def install(self, value: torch.Tensor) -> None:
        """Set ``value`` as this weight: a new parameter on its owner (``requantize`` copies)."""
        assert self.owner is not None
        attr = self.name.rsplit(".", 1)[-1]
        setattr(self.owner, attr, nn.Parameter(value, requires_grad=False))


@dataclass
class UpdatePlan:
    copies: list[PlannedCopy]

    @property
    def modules(self) -> list[str]:
        return sorted({c.module for c in self.copies})

    @property
    def num_bytes(self) -> int:
        return sum(c.source.numel() * c.source.element_size() for c in self.copies)

    def summary(self) -> str:
        per = {m: sum(1 for c in self.copies if c.module == m) for m in self.modules}
        return ", ".join(f"{m}: {n} tensors" for m, n in per.items())


def held_quantized(t: torch.Tensor) -> bool:
    """Whether ``t`` is held as a tensor subclass (e.g. torchao's float8), not plain values."""
    return type(t) not in (torch.Tensor, torch.nn.Parameter) or type(t.data) is not torch.Tensor


def _refuse_quantized(module_name: str, targets: Mapping[str, torch.Tensor]) -> None:
    """Weights held as a tensor subclass (torchao's float8 under ``--quantize fp8``) cannot take an
    in-place copy of plain values, and this module has no re-quantizer: refuse before anything is
    copied, naming them (a 400, not the 500 of a copy failing half-way)."""
    quantized = sorted(n for n, t in targets.items() if held_quantized(t))
    if quantized:
        kind = type(targets[quantized[0]]).__name__
        raise WeightUpdateError(
            f"{module_name}: {len(quantized)} weight(s) are held quantized ({kind}, --quantize), e.g. "
            f"{describe_names(quantized)}; updates into quantized weights are not supported yet. "
            "Nothing was applied: serve without --quantize to train through weight updates"
        )


def plan_update(
    pipe, payload: Mapping[str, Iterable[tuple[str, object]]], *, check_finite: bool = True
) -> UpdatePlan:
    """Validate a whole update (``{module: [(name, tensor), ...]}``) against the live pipeline."""
    problems = Problems()
    copies: list[PlannedCopy] = []
    for module_name, named in payload.items():
        module = get_module(pipe, module_name)
        live = live_tensors(module)
        spec = {n: TensorSpec(tuple(t.shape), t.dtype) for n, t in live.items()}
        converted = check_and_convert(module_name, named, spec, problems, check_finite=check_finite)
        requantize = getattr(module, REQUANTIZE_ATTR, None)
        if requantize is None:
            _refuse_quantized(module_name, {n: live[n] for n in converted})
        for n, t in converted.items():
            if requantize is not None and held_quantized(live[n]):
                owner = module.get_submodule(n.rsplit(".", 1)[0]) if "." in n else module
                copies.append(PlannedCopy(module_name, n, live[n], t, requantize, owner))
            else:
                copies.append(PlannedCopy(module_name, n, live[n], t))
    problems.raise_if_any()
    if not copies:
        raise WeightUpdateError("the update holds no tensors")
    return UpdatePlan(copies)


def _backup(c: PlannedCopy) -> torch.Tensor:
    if c.requantize is not None:
        return c.target  # replaced, not written: the old parameter object is the backup
    t = c.target
    try:
        return t.detach().clone()
    except torch.cuda.OutOfMemoryError:
        # Rollback needs exact bytes, not speed: keep them on the CPU when the device is full.
        return t.detach().to("cpu", copy=True)


def apply_copies(copies: list[PlannedCopy], *, before_copy: BeforeCopy | None = None) -> list[torch.Tensor]:
    """Copy every planned tensor in place; on any failure restore all of them, then raise.

    Returns the backups (previous values, in ``copies`` order): a caller that must be able to undo
    a successful update (a cluster replica, until every replica has applied) keeps them."""
    with torch.no_grad():
        try:
            backups = [_backup(c) for c in copies]
        except Exception as exc:
            raise WeightApplyError(
                f"could not back up the {len(copies)} tensors to update (nothing changed): "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        done = 0
        try:
            for c in copies:
                if before_copy is not None:
                    before_copy(c.module, c.name)
                if c.requantize is None:
                    c.target.data.copy_(c.source)
                else:
                    c.install(c.requantize(c.source, c.target))
                done += 1
        except Exception as exc:
            failed = copies[done]
            try:
                # The failing tensor may be half written: restore it too.
                for c, saved in zip(copies[: done + 1], backups, strict=False):
                    restore_copy(c, saved)
            except Exception as restore_exc:  # pragma: no cover - the device itself is failing
                logger.critical("weight rollback failed; weights are inconsistent: %s", restore_exc)
                raise WeightApplyError(
                    f"copy failed at {failed.module}.{failed.name} ({exc}) and the rollback failed too "
                    f"({restore_exc}); reload the weights"
                ) from exc
            raise WeightApplyError(
                f"copy failed at {failed.module}.{failed.name} after {done} of {len(copies)} tensors: "
                f"{type(exc).__name__}: {exc}; the previous weights were restored"
            ) from exc
    return backups


def restore_copy(c: PlannedCopy, saved: torch.Tensor) -> None:
    """Put back what :func:`apply_copies` saved for ``c`` (its bytes, or its replaced parameter)."""
    with torch.no_grad():
        if c.requantize is None:
            c.target.data.copy_(saved)
        else:
            attr = c.name.rsplit(".", 1)[-1]
            setattr(c.owner, attr, saved)


def encoder_modules_touched(modules: Iterable[str]) -> bool:
    """Whether a change to these modules can change prompt encodings (anything but denoisers/VAE)."""
    return any(not (m.startswith("transformer") or m == "vae") for m in modules)
