"""A reward computed by an external service over HTTP (``--reward http://host:port/path#api=...``).

The spec is the URL; the reward's own options go in the URL's fragment (``#api=openai&rule=ocr``),
which never reaches the service, so the URL's query stays the service's. Two APIs:

- ``api=json`` (default): one ``POST`` per call with ``{"prompts": [...], "images": [base64 PNG,
  ...], "metadata": [...]}``; the answer is ``{"rewards": [N floats]}`` and optionally
  ``{"extras": [N objects]}``.
- ``api=openai``: an OpenAI-compatible chat-completions endpoint (an SGLang- or vLLM-served VLM judge,
  as flow_grpo's OCR and UnifiedReward rewards call): one request per image, the image as a
  ``data:image/png;base64,...`` part and ``template`` as the text (``{prompt}`` and ``{target}``
  filled in), temperature 0, ``max_tokens``; ``concurrency`` requests in flight. The reply's text is
  scored by ``rule``: ``ocr`` (edit-distance match to the target, as ``vlm_ocr_judge``), ``number``
  (the first number in the reply) or ``yes_no`` (1 if it starts with "yes", else 0).

Images travel as PNG of the exact uint8 pixels (lossless). Any failure (connection, HTTP status, a
malformed answer, a wrong count) raises, naming the URL, so the caller's calling convention reports
it per sample rather than scoring a silent 0.
"""

from __future__ import annotations

import base64
import io
import re
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from diffusion_rollout.rewards.ocr import ocr_similarity, target_text
from diffusion_rollout.rewards.simple import first_frames

RULES = ("ocr", "number", "yes_no")
_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")


def png_base64(frame: torch.Tensor) -> str:
    """One uint8 ``[3, H, W]`` frame as base64 PNG text."""
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(frame.permute(1, 2, 0).contiguous().numpy()).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def score_reply(reply: str, rule: str, target: str) -> float:
    if rule == "ocr":
        return ocr_similarity(reply, target)
    if rule == "yes_no":
        return 1.0 if reply.strip().lower().startswith("yes") else 0.0
    m = _NUMBER.search(reply)
    if m is None:
        raise ValueError(f"rule=number: no number in the reply {reply[:200]!r}")
    return float(m.group(0))


class HttpReward:
    """See the module docstring."""

    def __init__(
        self,
        url: str,
        api: str = "json",
        timeout: float = 120.0,
        concurrency: int = 8,
        model: str | None = None,
        template: str = "Read all the text in this image. Answer with the text only.",
        rule: str = "ocr",
        max_tokens: int = 32,
        api_key: str | None = None,
    ) -> None:
        import httpx

        if api not in ("json", "openai"):
            raise ValueError(f"http reward: api must be json or openai, got {api!r}")
        if rule not in RULES:
            raise ValueError(f"http reward: rule must be one of {list(RULES)}, got {rule!r}")
        self.url, self.api, self.rule, self.template = url, api, rule, str(template)
        self.model, self.max_tokens, self.concurrency = model, int(max_tokens), max(1, int(concurrency))
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(timeout=float(timeout), headers=headers)
        self.last_extras: list[dict[str, Any]] = []

    def __call__(
        self,
        images: torch.Tensor,
        prompts: Sequence[str],
        metadata: Sequence[Mapping[str, Any]] | None = None,
    ) -> torch.Tensor:
        frames = first_frames(images, prompts, "http reward")
        n = frames.shape[0]
        meta = list(metadata) if metadata is not None else [{}] * n
        pngs = [png_base64(f) for f in frames]
        if self.api == "json":
            return self._json(pngs, list(prompts), meta)
        with ThreadPoolExecutor(self.concurrency, thread_name_prefix="http-reward") as pool:
            replies = list(pool.map(self._chat, pngs, prompts, meta))
        self.last_extras = [{"reply": r} for r in replies]
        targets = [target_text(p, m) for p, m in zip(prompts, meta, strict=True)]
        return torch.tensor(
            [score_reply(r, self.rule, t) for r, t in zip(replies, targets, strict=True)], dtype=torch.float32
        )

    def _post(self, body: dict[str, Any]) -> Any:
        r = self._http.post(self.url, json=body)
        if r.status_code != 200:
            raise RuntimeError(f"{self.url} answered {r.status_code}: {r.text[:300]}")
        try:
            return r.json()
        except ValueError:
            raise RuntimeError(f"{self.url} answered no JSON: {r.text[:300]!r}") from None

    def _json(self, pngs: list[str], prompts: list[str], meta: list[Any]) -> torch.Tensor:
        answer = self._post({"prompts": prompts, "images": pngs, "metadata": meta})
        values = answer.get("rewards") if isinstance(answer, dict) else None
        if not isinstance(values, list) or len(values) != len(pngs):
            raise RuntimeError(
                f"{self.url}: expected {{'rewards': [{len(pngs)} numbers]}}, got {str(answer)[:300]}"
            )
        extras = answer.get("extras")
        self.last_extras = extras if isinstance(extras, list) and len(extras) == len(pngs) else []
        return torch.tensor([float(v) for v in values], dtype=torch.float32)

    def _chat(self, png: str, prompt: str, meta: Mapping[str, Any]) -> str:
        text = self.template.replace("{prompt}", prompt).replace("{target}", target_text(prompt, meta))
        body = {
            "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png}"}},
                {"type": "text", "text": text},
            ]}],
            "temperature": 0, "max_tokens": self.max_tokens,
            **({"model": self.model} if self.model else {}),
        }  # fmt: skip
        answer = self._post(body)
        try:
            return str(answer["choices"][0]["message"]["content"])
        except (KeyError, IndexError, TypeError):
            raise RuntimeError(f"{self.url}: not a chat-completions answer: {str(answer)[:300]}") from None
