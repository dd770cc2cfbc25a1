"""``--speed exact|fast``: one word that expands to the fastest measured set of speed options.

Design decisions:

- A preset only fills in options the user did not give: every fine flag (``--compile``,
  ``--no-compile``, ``--quantize``, ``--pipeline-lanes``) stays and overrides it. The config
  (``config.py``) applies the expansion once, at validation, from the fields that were set.
- Each choice names the row of ``benchmarks/RESULTS.md`` that measured it; an option is added only
  where it was measured to help. Nothing was measured on a CPU, so there ``exact`` is the plain
  eager path and ``fast`` is regional compile alone (FP8 needs a CUDA GPU of compute capability
  >= 8.9; the reason it was left out is reported).
- ``exact`` on CUDA adds two pipeline lanes (``server/speed/lanes.py``: every call bit-identical to one
  lane), unless an option that lanes exclude (compile, CUDA graphs, context parallelism) or an
  inexact option was given: a server asked for any of those is not asking for the exact default.
- Pure Python, no torch import: the caller passes what it knows of the device.

The result (:class:`SpeedChoice`) is logged at start-up and reported by ``/server_info`` under
``speed.choice``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

SpeedPreset = Literal["exact", "fast"]
RESULTS = "benchmarks/RESULTS.md"


@dataclass(frozen=True)
class SpeedChoice:
    """What ``--speed`` chose: the options it set, the ones the user's flags kept, and why."""

    preset: str
    device: str
    applied: dict[str, Any] = field(default_factory=dict)  # option -> value the preset set
    overridden: tuple[str, ...] = ()  # options the preset would set but the user gave
    why: str = ""
    results_rows: tuple[str, ...] = ()  # RESULTS.md row ids behind the choice

    def report(self) -> dict[str, Any]:
        out = asdict(self)
        out["overridden"] = list(self.overridden)
        out["results_rows"] = [f"{RESULTS}#{row}" for row in self.results_rows]
        return out

    def describe(self) -> str:
        """One log line."""
        applied = ", ".join(f"{k}={v}" for k, v in self.applied.items()) or "nothing added"
        kept = f"; kept your {', '.join(self.overridden)}" if self.overridden else ""
        rows = f" ({', '.join(f'{RESULTS}#{r}' for r in self.results_rows)})" if self.results_rows else ""
        return f"--speed {self.preset} on {self.device}: {applied}{kept}. {self.why}{rows}"


def choose(
    preset: str,
    *,
    device: str,
    given: dict[str, Any],
    fp8_unavailable: str | None,
) -> SpeedChoice:
    """The options ``preset`` adds on ``device``, given the options the user set (name -> value).

    ``fp8_unavailable``: why FP8 cannot run here (``fast_tier_checks.unsupported_reason``), or None."""
    cuda = device.startswith("cuda")
    if preset == "fast":
        wanted: dict[str, Any] = {"compile": True}
        rows: tuple[str, ...] = ("grpo-compiled",)
        why = "regional torch.compile of the transformer blocks (not bit-exact)"
        if fp8_unavailable is None:
            wanted["quantize"] = "fp8"
            rows = ("grpo-fast-all", "grpo-compiled")
            why = "FP8 linears + regional compile: the fastest measured Flow-GRPO set (not bit-exact)"
        else:
            why += f"; FP8 left out: {fp8_unavailable}"
        blockers = [n for n in ("cuda_graphs", "context_parallel") if _on(n, given.get(n))]
        if blockers:
            return SpeedChoice(
                preset, device, why=f"compile cannot be combined with {', '.join(blockers)}: nothing added"
            )
    else:
        if not cuda:
            return SpeedChoice(
                preset, device, why="the plain eager path: the exact options are measured on CUDA only"
            )
        wanted = {"pipeline_lanes": 2}
        rows = ("grpo-lanes2", "grpo-1lane", "grpo-lanes2-rerun")
        why = "two pipeline lanes: bit-identical calls, faster than one lane on a Flow-GRPO iteration"
        excluded = [
            n
            for n in ("compile", "cuda_graphs", "context_parallel", "quantize", "attention_backend")
            if _on(n, given.get(n))
        ]
        if excluded:
            return SpeedChoice(
                preset,
                device,
                overridden=tuple(n for n in wanted if n in given),
                why=f"lanes left out: {', '.join(excluded)} given (lanes are for the plain eager path)",
            )
    applied = {k: v for k, v in wanted.items() if k not in given}
    overridden = tuple(k for k in wanted if k in given)
    return SpeedChoice(preset, device, applied, overridden, why, rows)


def _on(name: str, value: Any) -> bool:
    """Whether a given option is in force (a flag given as off, or as its default, is not)."""
    if name == "context_parallel":
        return value is not None and int(value) > 1
    if name == "attention_backend":
        return value is not None and str(value).lower() != "native"
    return bool(value)
