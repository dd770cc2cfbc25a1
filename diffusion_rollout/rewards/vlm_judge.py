"""A generative VLM judge: reads each image and scores the reading."""

from __future__ import annotations

import inspect
import json
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from diffusion_rollout.rewards.ocr import ocr_similarity, target_text
from diffusion_rollout.rewards.simple import Reward, first_frames, model_placement


class VlmOcrJudge:
    """A generative VLM (Qwen3-VL, Qwen2.5-VL...) reads the text in each image; the reward is
    ``ocr_similarity(reading, ocr_target(prompt))`` in [0, 1].

    ``model``: a transformers folder that ``AutoModelForImageTextToText`` loads, e.g. a downloaded
    Qwen3-VL-8B-Instruct, or a random-weight one from ``benchmarks.judge_builders.save_vlm_judge``
    (time and memory real, readings meaningless).

    Decoding is greedy with, by default, a fixed budget (``fixed_budget=1``): ``min_new_tokens =
    max_new_tokens``, so every image costs ``max_new_tokens`` decode steps whatever the model says. A
    real judge mostly stops early; this is its worst case, and it keeps a random-weight judge's cost
    from depending on when noise happens to emit an end token. A trained judge kept from ending keeps
    talking after its answer, which the score would count, so for meaningful scores from a real
    checkpoint pass ``fixed_budget=0``: decoding then stops at the end token (and the reading is cut
    there).
    """

    INSTRUCTION = "Read all the text in this image. Answer with the text only."

    def __init__(
        self,
        model: str,
        max_new_tokens: int = 32,
        batch_size: int = 32,
        device: str | None = None,
        dtype: str | None = None,
        attn_implementation: str | None = None,
        fixed_budget: int = 1,
        offload: int | None = None,
        template: str | None = None,
        rule: str = "ocr",
    ) -> None:
        from transformers import AutoModelForImageTextToText

        if rule not in ("ocr", "yes_no"):
            raise ValueError(f"vlm judge: rule must be ocr or yes_no, got {rule!r}")
        self.rule = rule
        # The instruction; {prompt} and {target} (the OCR target text) are filled in per image.
        self.template = self.INSTRUCTION if template is None else str(template)
        if max_new_tokens < 1 or batch_size < 1:
            raise ValueError(
                f"vlm_ocr_judge: max_new_tokens and batch_size must be >= 1, got {max_new_tokens}, {batch_size}"
            )
        path = Path(str(model))
        if not (path / "config.json").is_file():
            raise ValueError(f"vlm_ocr_judge: model={model!r} is not a transformers folder (no config.json)")
        self.device, self.dtype = model_placement(device, dtype)
        self.max_new_tokens = int(max_new_tokens)
        self.batch_size = int(batch_size)
        self.fixed_budget = bool(int(fixed_budget))
        extra = {"attn_implementation": attn_implementation} if attn_implementation else {}
        # ``offload`` (default: on for CUDA): the weights wait in pinned host memory between calls.
        # Colocated beside a rollout replica and the trainer's own copy of a 20B denoiser, an 8B
        # judge's 17.5 GB held through rollout and replay overfilled an H200 (a 4-GPU Qwen-Image run
        # stalled with every GPU full); moving it in and out costs two host copies per call.
        self.offload = self.device.type == "cuda" if offload is None else bool(int(offload))
        self.model = AutoModelForImageTextToText.from_pretrained(
            str(path), dtype=self.dtype, device_map={"": "cpu" if self.offload else str(self.device)}, **extra
        ).eval()
        # The judge never changes its weights: one pinned host copy of each tensor is made here, and
        # moving out is pointing back at it (no copy, no new pinned allocation per call).
        pin = torch.cuda.is_available()  # (a CPU-only build has no pinned memory; the path still runs)
        self._host = (
            [(t, t.data.pin_memory() if pin else t.data) for t in self._tensors()] if self.offload else []
        )
        for t, host in self._host:
            t.data = host
        self.offload_seconds = 0.0
        self.tokenizer, self.image_processor, self.chat_template = _load_vlm_processor(path)
        self.tokenizer.padding_side = "left"  # generation appends on the right of every row
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.image_token = "<|image_pad|>"
        self.image_token_id = self.model.config.image_token_id
        self.merge = int(getattr(self.image_processor, "merge_size", 2))
        eos = self.model.generation_config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        # transformers versions differ in what the forward needs beside input ids (newer ones want
        # the per-token modality, mm_token_type_ids, for mRoPE); pass it only where it is accepted.
        self._pass_token_types = "mm_token_type_ids" in inspect.signature(self.model.forward).parameters
        self.last_seconds = 0.0
        self.tokens_generated = 0
        self.last_readings: list[str] = []

    def _prompt_text(self, instruction: str) -> str:
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": instruction}]}]
        return self.tokenizer.apply_chat_template(
            messages, chat_template=self.chat_template, tokenize=False, add_generation_prompt=True
        )

    def _inputs(self, frames: torch.Tensor, instructions: Sequence[str]) -> dict[str, torch.Tensor]:
        """The model's inputs for uint8 ``[B, 3, H, W]`` and one instruction each: what a Qwen-VL
        processor makes for images (pixel patches, each image's grid, its pad token repeated once per
        merged patch)."""
        from PIL import Image

        pil = [Image.fromarray(f.permute(1, 2, 0).contiguous().numpy()) for f in frames]
        vision = self.image_processor(images=pil, return_tensors="pt")
        grids = vision["image_grid_thw"]
        texts = [
            self._prompt_text(ins).replace(
                self.image_token, self.image_token * (int(g.prod()) // self.merge**2), 1
            )
            for g, ins in zip(grids, instructions, strict=True)
        ]
        text = self.tokenizer(texts, padding=True, return_tensors="pt")
        inputs = {
            "input_ids": text["input_ids"],
            "attention_mask": text["attention_mask"],
            "pixel_values": vision["pixel_values"].to(self.dtype),
            "image_grid_thw": grids,
        }
        if self._pass_token_types:
            inputs["mm_token_type_ids"] = (text["input_ids"] == self.image_token_id).to(torch.int32)
        return {k: v.to(self.device) for k, v in inputs.items()}

    def _until_eos(self, ids: list[int]) -> list[int]:
        """The generated ids up to and including the first end token (what follows is padding)."""
        for k, i in enumerate(ids):
            if i in self.eos_ids:
                return ids[: k + 1]
        return ids

    def _decode(self, ids: list[int]) -> str:
        # Ids past the tokenizer's vocabulary (a random-weight 8B has the real 151936 rows, the offline
        # tokenizer far fewer; a real checkpoint pads its embedding beyond its tokenizer too) are
        # read as nothing.
        known = [i for i in ids if 0 <= i < len(self.tokenizer)]
        return self.tokenizer.decode(known, skip_special_tokens=True)

    @torch.no_grad()
    def __call__(
        self,
        images: torch.Tensor,
        prompts: Sequence[str],
        metadata: Sequence[Mapping[str, Any]] | None = None,
    ) -> torch.Tensor:
        frames = first_frames(images, prompts, "vlm judge")
        meta = list(metadata) if metadata is not None else [{}] * len(prompts)
        # A request's per-prompt text (reward_metadata ocr_text) wins over the prompt's quotes.
        targets = [target_text(p, m) for p, m in zip(prompts, meta, strict=True)]
        instructions = [
            self.template.replace("{prompt}", p).replace("{target}", t)
            for p, t in zip(prompts, targets, strict=True)
        ]
        start = time.perf_counter()
        if self.offload:
            for t, host in self._host:
                t.data = host.to(self.device, non_blocking=True)
        try:
            if self.rule == "yes_no":
                p_yes, generated = self._p_yes(frames, instructions), 0
                readings = []
            else:
                readings, generated = self._read(frames, instructions)
        finally:
            if self.offload:
                self._back_to_host()
        if self.rule == "yes_no":
            scores = p_yes
            self.last_extras = [{"p_yes": v} for v in scores]
        else:
            scores = [ocr_similarity(r, t) for r, t in zip(readings, targets, strict=True)]
            self.last_extras = [{"reading": r} for r in readings]  # travels with the score (rewards.score)
        self.last_readings = readings
        self.tokens_generated = generated
        self.last_seconds = time.perf_counter() - start
        return torch.tensor(scores, dtype=torch.float32)

    def _back_to_host(self) -> None:
        """The weights back to their pinned host copies, and the GPU's cache handed back to the
        driver, so that a server process on the same GPU can use it."""
        t0 = time.perf_counter()
        for t, host in self._host:
            t.data = host
        torch.cuda.empty_cache()
        self.offload_seconds = time.perf_counter() - t0

    def _tensors(self) -> list[torch.Tensor]:
        return [*self.model.parameters(), *self.model.buffers()]

    def _answer_ids(self, word: str) -> list[int]:
        """The first token of each spelling of ``word`` (with and without a leading capital)."""
        ids = []
        for spelling in (word, word.capitalize()):
            tokens = self.tokenizer.encode(spelling, add_special_tokens=False)
            if tokens and tokens[0] not in ids:
                ids.append(tokens[0])
        return ids

    def _p_yes(self, frames: torch.Tensor, instructions: Sequence[str]) -> list[float]:
        """``p(yes) / (p(yes) + p(no))`` of the first answer token: one forward, no generation."""
        yes, no = self._answer_ids("yes"), self._answer_ids("no")
        if not yes or not no or set(yes) & set(no):
            raise ValueError(
                "vlm judge rule=yes_no: the tokenizer has no distinct first tokens for yes and no"
            )
        out: list[float] = []
        for lo in range(0, frames.shape[0], self.batch_size):
            inputs = self._inputs(frames[lo : lo + self.batch_size], instructions[lo : lo + self.batch_size])
            logits = (
                self.model(**inputs).logits[:, -1].float()
            )  # left-padded: the last column is the next token
            probs = torch.softmax(logits, dim=-1)
            p_y, p_n = probs[:, yes].sum(-1), probs[:, no].sum(-1)
            out.extend((p_y / (p_y + p_n)).cpu().tolist())
        return out

    def _read(self, frames: torch.Tensor, instructions: Sequence[str]) -> tuple[list[str], int]:
        readings: list[str] = []
        generated = 0
        for lo in range(0, frames.shape[0], self.batch_size):
            inputs = self._inputs(frames[lo : lo + self.batch_size], instructions[lo : lo + self.batch_size])
            out = self.model.generate(
                **inputs,
                do_sample=False,
                max_new_tokens=self.max_new_tokens,
                min_new_tokens=self.max_new_tokens if self.fixed_budget else 0,
                pad_token_id=self.tokenizer.pad_token_id,
            )
            new = [self._until_eos(row) for row in out[:, inputs["input_ids"].shape[1] :].tolist()]
            generated += sum(len(row) for row in new)
            readings.extend(self._decode(row) for row in new)
        return readings, generated


def _load_vlm_processor(path: Path):
    """(tokenizer, image processor, chat template) of a VLM folder.

    ``AutoProcessor`` first, as for any checkpoint. transformers 5 builds a Qwen-VL processor only
    with torchvision (for its video half, which the judge never uses); without it the same files are
    read part by part.
    """
    from transformers import AutoProcessor, AutoTokenizer

    try:
        processor = AutoProcessor.from_pretrained(str(path))
        return processor.tokenizer, processor.image_processor, getattr(processor, "chat_template", None)
    except Exception:  # the parts below are read on their own, and fail loudly if they must
        pass
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    template = None
    for name in ("chat_template.jinja", "chat_template.json"):
        file = path / name
        if file.is_file():
            text = file.read_text()
            template = json.loads(text)["chat_template"] if name.endswith(".json") else text
            break
    return tokenizer, _load_image_processor(path), template or tokenizer.chat_template


def _load_image_processor(path: Path):
    import transformers

    try:
        return transformers.AutoImageProcessor.from_pretrained(str(path))
    except (ImportError, AttributeError, TypeError, ValueError):
        pass
    # The PIL backend of Qwen2-VL's image processor (Qwen3-VL uses the same one) needs no torchvision.
    for name in ("Qwen2VLImageProcessorPil", "Qwen2VLImageProcessor"):
        cls = getattr(transformers, name, None)
        if cls is not None:
            return cls.from_pretrained(str(path))
    raise ImportError(f"vlm_ocr_judge: no image processor for {path} in this transformers")


def vlm_ocr_judge(model: str | None = None, **options: object) -> Reward:
    """The OCR judge (``VlmOcrJudge``): ``vlm_ocr_judge?model=/path/to/folder&max_new_tokens=32``
    (also ``batch_size``, ``device``, ``dtype`` such as ``bfloat16``, ``attn_implementation`` such as
    ``sdpa`` or ``flash_attention_2``, ``fixed_budget=0`` to let a real judge stop at its end token,
    ``offload=0`` to keep the weights on the GPU between calls: on CUDA they wait in pinned host memory).
    The options are :class:`VlmOcrJudge`'s; this factory only turns a missing ``model`` into a clear error."""
    if model is None:
        raise ValueError(
            "vlm_ocr_judge needs model=/path/to/folder: a Qwen3-VL-8B-Instruct (or other "
            "AutoModelForImageTextToText) folder, e.g. one written by "
            "benchmarks.judge_builders.save_vlm_judge"
        )
    return VlmOcrJudge(model, **options)


def vlm_judge(model: str | None = None, **options: object) -> Reward:
    """A generative VLM judge with its own instruction and scoring rule:
    ``vlm_judge?model=/path&rule=yes_no&template=Does this image show {prompt}? Answer yes or no.``
    (``rule=ocr``: the reading's edit-distance match to the target; ``yes_no``: the probability of
    "yes" against "no" as the first answer token, one forward pass). Options as ``vlm_ocr_judge``."""
    return vlm_ocr_judge(model, **options)
