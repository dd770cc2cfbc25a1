"""One ``/metrics`` text for a cluster: totals plus every replica's series under a ``replica`` label.

Design decisions:

- Each replica renders its own engine's metrics (``server/core/metrics.py``); the front parses those
  texts (the subset of the exposition format that module writes) and re-emits every family once,
  as Prometheus wants: first the totals with the labels the single server uses (so dashboards
  written for one process keep working), then each replica's samples with ``replica="<id>"`` added.
  Sum over the ``replica`` label, or read the unlabelled total; never add the two.
- Totals: counters and histograms are the sum over replicas plus the front's own series (the front
  records HTTP responses and client disconnects); additive gauges (queue depth, busy, images per
  second) are the sum over replicas. State gauges (status, paused, uptime, weight_version) come
  from the front, which owns them for the cluster.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from diffusion_rollout.server.core.metrics import PREFIX

# Gauges whose total is the front's value, not a sum over replicas.
FRONT_GAUGES = {
    PREFIX + n for n in ("status", "paused", "uptime_seconds", "weight_version", "weight_version_info")
}

_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?P<labels>\{.*\})?\s+(?P<value>\S+)$")


@dataclass
class Family:
    name: str
    help: str = ""
    kind: str = "untyped"
    # (sample name, label text without braces) -> value, in first-seen order
    samples: dict[tuple[str, str], float] = field(default_factory=dict)


def parse(text: str) -> dict[str, Family]:
    """Families by name from exposition text written by ``Metrics.render``."""
    families: dict[str, Family] = {}
    current: Family | None = None
    for line in text.splitlines():
        if not line.strip():
            continue
        if line.startswith("# HELP "):
            name, _, help_text = line[7:].partition(" ")
            current = families.setdefault(name, Family(name))
            current.help = help_text
            continue
        if line.startswith("# TYPE "):
            name, _, kind = line[7:].partition(" ")
            current = families.setdefault(name, Family(name))
            current.kind = kind.strip()
            continue
        if line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m is None or current is None:
            continue
        labels = (m.group("labels") or "{}")[1:-1]
        current.samples[(m.group("name"), labels)] = float(m.group("value"))
    return families


def _num(value: float) -> str:
    if value != value:  # NaN
        return "NaN"
    if value in (float("inf"), float("-inf")):
        return "+Inf" if value > 0 else "-Inf"
    return str(int(value)) if value == int(value) and abs(value) < 2**53 else repr(value)


def _with_label(labels: str, key: str, value: str) -> str:
    extra = f'{key}="{value}"'
    return f"{extra},{labels}" if labels else extra


def merge(front_text: str, replica_texts: Sequence[tuple[str, str]]) -> str:
    """``front_text`` (the front's own metrics) and ``(replica_id, text)`` pairs -> one text."""
    front = parse(front_text)
    replicas = [(rid, parse(text)) for rid, text in replica_texts]
    names = list(front)
    for _, fams in replicas:
        names.extend(n for n in fams if n not in names)
    out: list[str] = []
    for name in names:
        base = front.get(name) or next(f[name] for _, f in replicas if name in f)
        out.append(f"# HELP {name} {base.help}")
        out.append(f"# TYPE {name} {base.kind}")
        if name in FRONT_GAUGES and name in front:
            totals = dict(front[name].samples)
        else:
            # Counters and histograms: the front's events plus the replicas'. Other gauges (queue
            # depth, busy, images/s) describe the replicas' work: their sum alone.
            counted = base.kind != "gauge" and name in front
            totals: dict[tuple[str, str], float] = dict(front[name].samples) if counted else {}
            for _, fams in replicas:
                for key, value in fams[name].samples.items() if name in fams else ():
                    totals[key] = totals.get(key, 0.0) + value
        for (sample, labels), value in totals.items():
            out.append(f"{sample}{{{labels}}} {_num(value)}" if labels else f"{sample} {_num(value)}")
        for rid, fams in replicas:
            if name not in fams:
                continue
            for (sample, labels), value in fams[name].samples.items():
                out.append(f"{sample}{{{_with_label(labels, 'replica', rid)}}} {_num(value)}")
    return "\n".join(out) + "\n"
