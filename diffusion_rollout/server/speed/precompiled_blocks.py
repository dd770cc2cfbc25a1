"""Blocks precompiled ahead of time, so a restart skips Dynamo's tracing.

Why: a fast-tier restart on a warm compile cache still has Dynamo trace every kind of block again,
then load its graphs (the compile cache holds inductor's output, not Dynamo's): most of its warm-up.
``torch.compile(...).forward.aot_compile`` traces a block once and saves the whole result (bytecode,
guards, the compiled graph); loading it skips the tracing (benchmarks/RESULTS.md#fast-start-warm).

Design decisions:

- **A restart accelerator beside the ordinary compile, never instead of it.** The blocks keep their
  regional ``torch.compile`` (``warmup.compile_block``). After a warm-up that traced them, each kind
  of block (one artifact per block class, structure, and call signature; a batch of 1 separately,
  as Dynamo specialises it) is compiled ahead of time and saved in the compile cache's key folder.
  A restart loads them before its warm-up, and a block call whose signature has an artifact runs it;
  every other call (a new shape, a failed guard) goes to the ordinary compiled path. A restart's
  warm-up that makes a kind of call with no artifact (a shape an earlier start served, remembered in
  ``served_shapes.json``: server/speed/served_shapes.py) saves that kind beside those loaded, once
  the server is first idle after ready (server/speed/idle_save.py), so that the restart is not
  kept from serving while it saves.
- **Our own guard on top of torch's.** Saving needs torch's guards filtered to the portable ones
  (tensor and shape guards: identity guards on modules cannot be saved), so what those drop is checked
  here: the block's structure (module and parameter names, classes, shapes and dtypes, attention
  processors) must equal the saved one's, the call's non-tensor arguments must equal the traced
  ones, and every tensor's non-batch dimensions, strides, dtype and device must match. Any call
  through hooks (a request's feature cache wraps the blocks), or with grad mode on, goes to the
  ordinary path. Torch's guard check itself is off when an artifact serves (its dispatch-key guards
  refuse the server's inference tensors, and its symbolic shape guards go with it), so before an
  artifact is saved it must match the ordinary path at several batch sizes: bit for bit, or (GPUs:
  the second compile may pick other kernels) within a relative L2 of ``MAX_REL_DIFF``, reported.
- **Off at the first change of weights or modules.** A LoRA load or any weight update (the engine's
  ``invalidate_captures``) turns the artifacts off for the rest of the process: the ordinary path,
  which guards on everything, takes over, as it did before this module existed.
- **Nothing stops the server.** A torch without ``aot_compile``, a block with a graph break, a file
  that does not load: logged, reported, and the blocks run as before. A cold start that saved none
  leaves the reason in the folder (``NOT_SAVED``), so restarts on that cache key do not pay again.
- **FP8 weights.** torchao's ``Float8Tensor`` weights need two mends to be saved (the subclass's
  ``empty_like`` for Dynamo's guard serializer, a picklable ``extra_repr`` and a named padded forward
  on each linear): ``fast_tier.fp8_precompilable`` and ``fast_tier.PaddedLinear`` make them, and the
  subclass is allowed here. Weights of any other tensor subclass are skipped up front (``why_not``).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch.utils import _pytree as pytree

from diffusion_rollout.errors import UntrustedFileError
from diffusion_rollout.own_files import (
    make_private_dirs,
    private_temp_name,
    read_own,
    why_not_own_tree,
    write_private,
)

logger = logging.getLogger(__name__)

FOLDER = "blocks"  # inside the compile cache's key folder

# How far a saved artifact's output may be from the ordinary compiled path's (relative L2, per output
# tensor). Equal on the CPU; on an H100 (SD3.5-medium, FP8) every kind of block differed in its last
# bits, which left the restart with nothing precompiled. A graph that assumed its batch wrongly gets
# whole rows wrong (a relative L2 near 1); bfloat16's own rounding is 2**-8 per element.
MAX_REL_DIFF = 1e-2


def rel_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """||x - y|| / ||y|| in float32 (0 when both are zero)."""
    x, y = x.detach().float(), y.detach().float()
    scale = torch.linalg.vector_norm(y).item()
    gap = torch.linalg.vector_norm(x - y).item()
    return gap / scale if scale else (0.0 if gap == 0 else float("inf"))


def structure_digest(block: torch.nn.Module) -> str:
    """The block's class, modules, parameters and buffers (names, classes, shapes, dtypes), and its
    attention processors: what the saved graph assumed and torch's portable guards do not check."""
    parts: list[Any] = [type(block).__module__ + "." + type(block).__qualname__]
    for name, m in block.named_modules():
        proc = getattr(m, "processor", None)
        parts.append((name, type(m).__qualname__, type(proc).__qualname__ if proc is not None else None))
    for name, t in (*block.named_parameters(), *block.named_buffers()):
        parts.append((name, type(t).__qualname__, tuple(t.shape), str(t.dtype), t.requires_grad))
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:16]


def _batch(args: tuple, kwargs: dict) -> int | None:
    sizes = {v.shape[0] for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor) and v.dim() > 0}
    return sizes.pop() if len(sizes) == 1 else None


def _signature_parts(args: tuple, kwargs: dict) -> tuple | None:
    """What a call must match to run an artifact, as a hashable tuple: the argument tree, each
    non-tensor value, each tensor's dtype, device, shape and strides (the top-level tensors' batch
    dimension only as "1" or "n": dimension 0 is dynamic, as in ``compile_block``). None: not a call
    this module serves."""
    batch = _batch(args, kwargs)
    if batch is None:
        return None
    top = {id(v) for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor) and v.dim() > 0}
    leaves, spec = pytree.tree_flatten((args, kwargs))
    parts: list[Any] = [spec, batch == 1]
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            cut = 1 if id(leaf) in top else 0
            parts.append((leaf.dtype, leaf.device, leaf.shape[cut:], leaf.stride()[cut:], leaf.requires_grad))
        elif leaf is None or isinstance(leaf, (bool, int, float, str)):
            parts.append((type(leaf), leaf))
        else:  # an object the signature cannot vouch for
            return None
    return tuple(parts)


def call_signature(args: tuple, kwargs: dict) -> str | None:
    """The call's signature as a string that is the same in every process (artifacts' names)."""
    parts = _signature_parts(args, kwargs)
    return None if parts is None else _digest_parts(parts)


def _digest_parts(parts: tuple) -> str:
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:16]


def _hooked(block: torch.nn.Module) -> bool:
    """Hooks or a replaced forward (a request's feature cache, diffusers' hook registry)."""
    return bool(
        "forward" in vars(block)
        or block._forward_hooks
        or block._forward_pre_hooks
        or getattr(block, "_diffusers_hook", None) is not None
    )


# In the blocks folder when a cold start saved none (why, in words): later starts on the same cache key
# (the same torch, GPU, model and flags) skip the capture and the save, which would fail the same way.
NOT_SAVED = "not_saved.txt"


# Tensor subclasses a block's weights may be and still be saved: the owner of the subclass made its
# tensors serializable for Dynamo's guards (fast_tier.fp8_precompilable for torchao's Float8Tensor).
_ALLOWED_SUBCLASSES: set[type] = set()


def allow_subclass_weights(cls: type) -> None:
    _ALLOWED_SUBCLASSES.add(cls)


def _subclass_weights(block: torch.nn.Module) -> list[str]:
    """The tensor-subclass types among the block's parameters and buffers not known to be savable."""
    plain = (torch.Tensor, torch.nn.Parameter, *_ALLOWED_SUBCLASSES)
    return sorted({type(t).__name__ for t in (*block.parameters(), *block.buffers()) if type(t) not in plain})


class PrecompiledBlocks:
    """The artifacts of one engine's compiled blocks: captured during a warm-up, saved after it,
    loaded at the next start, used until the weights change."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.active = False
        self._lock = threading.Lock()
        self._table: dict[tuple[str, str], Any] = {}  # (structure, signature) -> compiled function
        # (structure, signature) -> (a block, its arguments described, their batch, inference tensors)
        self._examples: dict[tuple[str, str], tuple[torch.nn.Module, Any, bool, bool]] | None = {}
        self._fallback: dict[int, Callable[..., Any]] = {}  # id(block) -> the ordinary compiled call
        self._digest: dict[int, str] = {}
        # Signature tuples -> their digest: the hot path hashes a tuple, not a SHA-256 of its repr.
        self._signatures: dict[tuple, str] = {}
        self.loaded = 0
        self.saved = 0
        self.not_saved = 0  # kinds of call the save skipped or refused: a restart traces those
        self.save_s: float | None = None
        self.max_rel_diff: float | None = None  # of the saved artifacts against the ordinary path
        self.calls = 0
        self.why_not: str | None = None
        self.off_because: str | None = None
        self._held: dict | None = None  # captured kinds kept for a save once idle (idle_save.py)
        self.save_pending = False

    # ------------------------------------------------------------------ wiring
    def attach(self, blocks: Iterable[torch.nn.Module]) -> None:
        """Route each compiled block's calls through :meth:`_call` (``compile_block`` ran first)."""
        for block in blocks:
            ordinary = block._compiled_call_impl
            if ordinary is None:
                continue
            self._fallback[id(block)] = ordinary
            self._digest[id(block)] = structure_digest(block)

            def call(*args: Any, _block: torch.nn.Module = block, **kwargs: Any) -> Any:
                return self._call(_block, args, kwargs)

            block._compiled_call_impl = call

    def _call(self, block: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
        ordinary = self._fallback[id(block)]
        if not self.active and self._examples is None:
            return ordinary(*args, **kwargs)
        if _hooked(block) or torch.is_grad_enabled():  # traced without autograd, as generation runs
            return ordinary(*args, **kwargs)
        parts = _signature_parts(args, kwargs)
        if parts is None:
            return ordinary(*args, **kwargs)
        sig = self._signatures.get(parts)
        if sig is None:
            sig = self._signatures[parts] = _digest_parts(parts)
        key = (self._digest[id(block)], sig)
        # Capturing (a warm-up): each kind of call without an artifact, to save after it.
        if self._examples is not None and key not in self._examples and key not in self._table:
            inference = any(
                v.is_inference() for v in pytree.tree_leaves((args, kwargs)) if isinstance(v, torch.Tensor)
            )
            self._examples[key] = (block, _describe((args, kwargs)), _batch(args, kwargs), inference)
        fn = self._table.get(key) if self.active else None
        if fn is None:
            return ordinary(*args, **kwargs)
        # No guard check runs here (it is off: load); what it would have refused, _verify checked.
        self.calls += 1
        return fn(block, *args, **kwargs)

    def captured(self) -> int:
        """Kinds of call captured so far without an artifact (what :meth:`save` would save)."""
        return len(self._examples or self._held or {})

    def stop_capture(self) -> None:
        """No warm-up to save after (``warmup_shapes=none``): nothing more is recorded."""
        self._examples = None

    def hold_capture(self) -> None:
        """Keep the kinds captured so far for a save after ready, and capture no more."""
        self._held, self._examples = self._examples, None
        self.save_pending = True

    def turn_off(self, why: str) -> None:
        """The weights or modules changed: the ordinary compiled path serves every call from now on
        (and a save still pending is dropped: it would trace the changed blocks)."""
        if self.save_pending:
            self.save_pending, self.not_saved = False, self.captured()
            self._held = None
            logger.info("precompiled blocks: %d kind(s) not saved (%s before the server was idle)",
                        self.not_saved, why)  # fmt: skip
        if self.active:
            self.active = False
            self.off_because = why
            logger.info("precompiled blocks: off (%s); the ordinary compiled path serves from now on", why)

    # ------------------------------------------------------------------ restart
    def load(self) -> int:
        """Load the artifacts saved for these blocks' structures; returns how many loaded."""
        if not self.folder.is_dir():
            return 0
        refused = why_not_own_tree(self.folder)  # as the compile cache checked it (compile_cache.py)
        if refused is not None:
            self.why_not = f"refused: {refused}"
            logger.warning("precompiled blocks: refusing %s: %s", self.folder, refused)
            return 0
        marker = self.folder / NOT_SAVED
        if marker.is_file():  # an earlier start could save none: neither capture nor pay for it again
            try:
                self.why_not = (
                    read_own(marker).decode(errors="replace").strip() or "an earlier start saved none"
                )
            except UntrustedFileError as exc:
                self.why_not = str(exc)
            self.stop_capture()
            return 0
        wanted = set(self._digest.values())
        try:
            from torch.compiler import load_compiled_function
        except ImportError as exc:
            self.why_not = f"this torch cannot load compiled functions ({exc})"
            return 0
        for meta_path in sorted(self.folder.glob("*.json")):
            try:
                meta = json.loads(read_own(meta_path))
                if meta["structure"] not in wanted:
                    continue
                # Read through read_own: the cache folder was checked as the server's own (compile_cache),
                # and a file swapped in since is refused here, before torch unpickles it.
                blob = io.BytesIO(read_own(meta_path.with_suffix(".pt")))
                with _aot_compile_enabled():
                    fn = load_compiled_function(blob)
                # Torch's tensor guards would also compare dispatch keys, and the server's calls carry
                # inference tensors where the trace had plain ones; the signature above checks the
                # rest of what they check (dtype, device, shape, stride, requires_grad, batch >= 2).
                # A symbolic guard beyond those (a batch assumed even) is checked by running, before the
                # artifact was saved (_verify).
                fn.disable_guard_check()
            except Exception as exc:  # a damaged or foreign file: that kind compiles as before
                logger.warning("precompiled blocks: could not load %s (%s)", meta_path.name, exc)
                continue
            self._table[(meta["structure"], meta["signature"])] = fn
        self.loaded = len(self._table)
        self.active = self.loaded > 0
        # Still capturing: a warm-up shape with no artifact yet (one an earlier start served, remembered
        # in served_shapes.json) is saved after this warm-up, beside those loaded.
        self._examples = {}
        if self.active:
            logger.info("precompiled blocks: %d artifact(s) loaded from %s; Dynamo traces none of them",
                        self.loaded, self.folder)  # fmt: skip
        return self.loaded

    # ------------------------------------------------------------------ after a cold warm-up
    def save(self) -> int:
        """Compile ahead of time each kind of call the warm-up made that has no artifact yet, and save
        it (the graphs come from inductor's cache, filled by the warm-up). Returns how many were saved."""
        examples, self._examples, self._held = self._examples or self._held or {}, None, None
        if not examples:
            return 0
        try:
            from torch.compiler import keep_portable_guards_unsafe
        except ImportError as exc:
            self.why_not, self.save_pending = f"this torch cannot save compiled functions ({exc})", False
            return 0
        make_private_dirs(self.folder)
        t0 = time.perf_counter()
        for (structure, sig), (block, described, batch, inference) in examples.items():
            name = f"{type(block).__name__}-{structure}-{sig}"
            subclasses = _subclass_weights(block)
            if subclasses:
                self.why_not = (
                    f"{type(block).__name__}: weights of tensor subclass {', '.join(subclasses)} are not "
                    "compiled ahead of time: Dynamo's guard serializer needs their empty_like and their "
                    "modules picklable (torchao's Float8Tensor failed there after 34 s on an H200 before "
                    "fast_tier.fp8_precompilable)"
                )
                continue
            # Traced as the calls run (inference tensors or not): torch's tensor guards check it.
            mode = torch.inference_mode if inference else torch.no_grad
            try:
                with mode():
                    args, kwargs = _materialize(described)
                if batch != 1:  # the dynamic graph, as compile_block marks it
                    for v in (*args, *kwargs.values()):
                        if isinstance(v, torch.Tensor) and v.dim() > 0:
                            torch._dynamo.maybe_mark_dynamic(v, 0)
                # The class's forward with the block as its first argument: the block's own __call__
                # runs the ordinary compiled path (and its dynamic marking), which must not be traced.
                with _aot_compile_enabled():  # torch.compile attaches .aot_compile only under the flag
                    compiled = torch.compile(
                        type(block).forward,
                        fullgraph=True,
                        options={"guard_filter_fn": keep_portable_guards_unsafe},
                    )
                    with mode():
                        fn = compiled.aot_compile(((block, *args), kwargs))
                        fn.disable_guard_check()  # as it will serve (load)
                        differs = self._verify(fn, block, described, batch)
                if differs is not None:
                    self.why_not = f"{type(block).__name__}: {differs}"
                    logger.warning("precompiled blocks: %s not saved (%s)", name, self.why_not)
                    continue
                tmp = private_temp_name(self.folder, name + ".pt")  # never a planted name or link
                try:
                    fn.save_compiled_function(tmp)
                    os.replace(tmp, self.folder / (name + ".pt"))
                finally:
                    with contextlib.suppress(OSError):
                        os.unlink(tmp)
                meta = {"structure": structure, "signature": sig, "block": type(block).__name__}
                write_private(self.folder / (name + ".json"), json.dumps(meta))
                self.saved += 1
            except Exception as exc:  # a graph break, an unsupported torch: that kind keeps tracing
                self.why_not = f"{type(block).__name__}: {type(exc).__name__}: {str(exc)[:300]}"
                logger.warning("precompiled blocks: %s not saved (%s)", name, self.why_not)
        self.save_s, self.save_pending = time.perf_counter() - t0, False  # pending until saved (report)
        self.not_saved = len(examples) - self.saved
        if not self.saved and self.why_not and not self.loaded:  # never hides the artifacts that load
            write_private(self.folder / NOT_SAVED, self.why_not + "\n")
        logger.info("precompiled blocks: %d artifact(s) saved in %s in %.1f s, for the next start",
                    self.saved, self.folder, self.save_s)  # fmt: skip
        return self.saved

    def _verify(self, fn: Any, block: torch.nn.Module, described: Any, traced: int) -> str | None:
        """Run the artifact and the ordinary compiled path on the same random inputs, at the traced
        batch and at others (an odd one among them): torch's symbolic shape guards are off when it
        serves, so a graph that assumed more about its batch size is caught here, before it is saved.
        Outputs equal bit for bit pass; so do outputs within :data:`MAX_REL_DIFF` of the ordinary
        path's (relative L2 per tensor, the largest kept in ``max_rel_diff``): on GPUs the two compiles
        of one graph may pick other kernels, a rounding difference, where a wrong batch assumption
        changes whole rows. Returns what differed, or None."""
        ordinary = self._fallback[id(block)]
        batches = sorted({2, 3, traced, traced + 1}) if traced != 1 else [1]
        gen = torch.Generator(device="cpu").manual_seed(0)
        worst = 0.0
        for b in batches:
            args, kwargs = _materialize(described, batch=b, generator=gen)
            mine, theirs = (
                pytree.tree_leaves(fn(block, *args, **kwargs)),
                pytree.tree_leaves(ordinary(*args, **kwargs)),
            )
            if len(mine) != len(theirs):
                return f"its output at batch {b} has another structure than the ordinary compiled path's"
            for x, y in zip(mine, theirs, strict=True):
                if not isinstance(x, torch.Tensor):
                    if x != y:
                        return f"its output at batch {b} differs from the ordinary compiled path's"
                    continue
                if torch.equal(x, y):
                    continue
                # Only floating outputs may differ by rounding; anything else must be equal.
                close = x.shape == y.shape and x.is_floating_point() and y.is_floating_point()
                diff = rel_diff(x, y) if close else float("inf")
                if not diff <= MAX_REL_DIFF:  # (a NaN fails too)
                    return (
                        f"its output at batch {b} differs from the ordinary compiled path's "
                        f"(relative L2 {diff:.3g}, more than {MAX_REL_DIFF:g})"
                    )
                worst = max(worst, diff)
        self.max_rel_diff = max(self.max_rel_diff or 0.0, worst)
        return None

    def report(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "active": self.active,
            "loaded": self.loaded,
            "saved": self.saved,
            "calls": self.calls,
        }
        if self.save_s is not None:
            out["save_s"] = round(self.save_s, 3)
            out["not_saved"] = self.not_saved
        if self.save_pending:
            out["save"] = "pending: saved once the server has been idle (or saving now)"
        if self.max_rel_diff is not None:
            out["max_rel_diff"] = self.max_rel_diff  # 0.0: every saved artifact bit-identical
        if self.why_not is not None:
            out["why_not"] = self.why_not
        if self.off_because is not None:
            out["off_because"] = self.off_because
        return out


def _describe(tree: Any) -> Any:
    """The arguments without their values: tensors as (shape, stride, dtype, device, requires_grad)."""

    def one(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return _TensorSpec(tuple(v.shape), tuple(v.stride()), v.dtype, v.device, v.requires_grad)
        return v

    return pytree.tree_map(one, tree)


class _TensorSpec:
    __slots__ = ("device", "dtype", "requires_grad", "shape", "stride")

    def __init__(self, shape, stride, dtype, device, requires_grad) -> None:
        self.shape, self.stride, self.dtype, self.device = shape, stride, dtype, device
        self.requires_grad = requires_grad


def _materialize(
    described: Any, *, batch: int | None = None, generator: torch.Generator | None = None
) -> tuple[tuple, dict]:
    """Tensors for described arguments: empty, or random from ``generator``; the top-level ones
    (dimension 0 the batch) with ``batch`` rows when given."""
    args, kwargs = described
    top = {id(v) for v in (*args, *kwargs.values()) if isinstance(v, _TensorSpec) and len(v.shape) > 0}

    def one(v: Any) -> Any:
        if not isinstance(v, _TensorSpec):
            return v
        shape = (batch, *v.shape[1:]) if batch is not None and id(v) in top else v.shape
        t = torch.empty_strided(shape, v.stride, dtype=v.dtype, device=v.device)
        if generator is not None:
            if v.dtype.is_floating_point:
                t.copy_(torch.randn(shape, generator=generator).to(v.dtype))
            else:
                t.zero_()
        return t.requires_grad_(v.requires_grad) if v.dtype.is_floating_point and not t.is_inference() else t

    args, kwargs = pytree.tree_map(one, described, is_leaf=lambda x: isinstance(x, _TensorSpec))
    return tuple(args), dict(kwargs)


def _aot_compile_enabled() -> contextlib.AbstractContextManager[Any]:
    """Torch's ``enable_aot_compile`` flag on: torch 2.11 ships it off (so ``torch.compile(fn)`` has
    no ``.aot_compile``), later releases on; a torch without the flag needs nothing."""
    config = torch._dynamo.config
    return (
        config.patch(enable_aot_compile=True)
        if hasattr(config, "enable_aot_compile")
        else contextlib.nullcontext()
    )
