"""Rewards for the training recipes, as plug-ins.

A reward is any callable ``reward(images, prompts) -> torch.Tensor``:

- ``images``: ``uint8`` ``[N, 3, H, W]`` (images) or ``[N, 3, F, H, W]`` (videos), on the CPU, as the
  server returns them with ``output_dtype="uint8"`` (``round(x * 255)`` of the pipeline's [0, 1]
  output);
- ``prompts``: the ``N`` prompts, one per sample;
- returns ``[N]`` float32 rewards (higher is better).

The recipes take ``--reward SPEC``: a built-in name below, or ``package.module:callable`` /
``path/to/file.py:callable`` for your own (PickScore, HPS, OCR...). A spec that names a class or a
factory is called once with no arguments if the object it names is not itself a reward (so
``my_rewards:PickScore`` can load its model in ``__init__``); ``SPEC?key=value&...`` passes keyword
arguments to that call (``jpeg_compressibility?quality=80``).

Design decisions:

- **JPEG compressibility is DDPO's task**: minus the size in kB of the image saved as JPEG at a fixed
  quality (Pillow, quality 95 by default, no subsampling options beyond Pillow's defaults), the
  mean over frames for a video. It needs no model and no download, and a random-weight architecture
  can move it (smoother images compress better), which makes it the default.
- **The images arrive as bytes**, not floats: rewards are scored on exactly what a user would save,
  and the server's uint8 answer is a quarter of the float32 one.
- Rewards run in the trainer's process on the CPU; the recipes time them as their own phase. The
  one exception is ``vlm_ocr_judge``, a generative VLM that reads the text in each image (verl-omni's
  OCR task): it runs on the rank's GPU and keeps ``last_seconds`` / ``tokens_generated`` of its last
  call for the recipe to report.
- **A spec is code.** Anything but a built-in name imports a module and calls what it names, in the
  trainer's process and as its user (``subprocess:Popen?args=...`` would run a command), from the
  command line or from ``--config``'s ``reward:`` alike. So only ``module:callable`` or
  ``file.py:callable`` spelled out is taken (a bare unknown name is an error, never a guess), and
  :func:`load_reward` logs once what it imported, from where, with which arguments.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import io
import json
import logging
import re
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol
from urllib.parse import parse_qsl

import torch

logger = logging.getLogger("examples.rewards")

__all__ = [
    "BUILTIN_REWARDS",
    "OCR_PROMPTS",
    "Reward",
    "VlmOcrJudge",
    "brightness",
    "jpeg_compressibility",
    "jpeg_incompressibility",
    "levenshtein",
    "load_reward",
    "ocr_similarity",
    "ocr_target",
    "vlm_ocr_judge",
]


class Reward(Protocol):
    def __call__(self, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor: ...


def _frames(images: torch.Tensor) -> torch.Tensor:
    """``[N, F, 3, H, W]`` uint8 from images ``[N, 3, H, W]`` or videos ``[N, 3, F, H, W]``."""
    if images.dtype != torch.uint8:
        raise TypeError(f"rewards take uint8 images (output_dtype='uint8'), got {images.dtype}")
    if images.ndim == 4:
        return images.unsqueeze(1)
    if images.ndim == 5:
        return images.permute(0, 2, 1, 3, 4)
    raise ValueError(f"expected [N, 3, H, W] or [N, 3, F, H, W], got shape {tuple(images.shape)}")


def _jpeg_kb(frame: torch.Tensor, quality: int) -> float:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(frame.permute(1, 2, 0).contiguous().numpy()).save(buf, format="JPEG", quality=quality)
    return buf.tell() / 1000.0


def jpeg_compressibility(quality: int = 95) -> Reward:
    """Minus the JPEG size in kB at ``quality`` (per-frame mean for videos): DDPO's compressibility."""

    def reward(images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        frames = _frames(images)
        sizes = [[_jpeg_kb(f, quality) for f in sample] for sample in frames]
        return -torch.tensor([sum(s) / len(s) for s in sizes], dtype=torch.float32)

    return reward


def jpeg_incompressibility(quality: int = 95) -> Reward:
    """The JPEG size in kB (DDPO's incompressibility): the inverse task."""
    compress = jpeg_compressibility(quality)

    def reward(images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        return -compress(images, prompts)

    return reward


def brightness(target: float = 0.8) -> Reward:
    """Minus the squared distance of the mean pixel value (in [0, 1]) to ``target``: a simple control task."""

    def reward(images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        mean = _frames(images).float().div(255.0).mean(dim=(1, 2, 3, 4))
        return -((mean - float(target)) ** 2)

    return reward


# ---------------------------------------------------------------------------------------------------
# OCR: a VLM judge reads each image's text; the score is its edit-distance match to the prompt's text
# ---------------------------------------------------------------------------------------------------

#: Prompts that each ask for a text in double quotes (the OCR task's target), for ``--prompt-set ocr``.
OCR_PROMPTS = [
    'A street sign that says "OPEN 24 HOURS"',
    'A coffee cup with the word "LATTE" written on it',
    'A neon sign in a dark alley reading "NIGHT MARKET"',
    'A chalkboard menu that says "SOUP OF THE DAY"',
    'A wooden signpost with the text "TRAIL HEAD"',
    'A birthday cake with "HAPPY 30TH" in icing',
    'A vintage poster with the title "SPACE RACE 1969"',
    'A shop window with a sticker that says "SALE 50% OFF"',
    'A road sign that reads "SLOW DOWN"',
    'A book cover titled "THE LAST LIGHTHOUSE"',
    'A t-shirt printed with the words "KEEP CALM"',
    'A license plate that says "GRPO 2026"',
    'A movie theater marquee showing "NOW PLAYING"',
    'A handwritten note on a fridge saying "BUY MILK"',
    'A train station board displaying "PLATFORM 9"',
    'A protest banner with the slogan "SAVE THE BEES"',
    'A mailbox labeled "SMITH FAMILY"',
    'A cereal box with the brand name "CRUNCHY OATS"',
    'A graffiti wall spelling "DREAM BIG"',
    'A door plaque engraved with "ROOM 404"',
    'A cinema ticket printed with "ADMIT ONE"',
    'A bakery storefront sign reading "FRESH BREAD"',
    'A laptop sticker that says "HELLO WORLD"',
    'A road billboard advertising "VISIT MARS"',
    'A warning sign on a fence that says "HIGH VOLTAGE"',
    'A greeting card with the message "THANK YOU"',
    'A hotel lobby sign reading "WELCOME GUESTS"',
    'A sailboat with the name "SEA BREEZE" painted on its hull',
    'A bottle label that reads "SPRING WATER"',
    'A parking lot sign saying "RESERVED"',
    'A vintage typewriter page typed with "CHAPTER ONE"',
    'A football jersey with "CHAMPIONS" across the back',
]

_QUOTED = re.compile(r'"([^"]*)"|\u201c([^\u201d]*)\u201d')


def ocr_target(prompt: str) -> str:
    """The text a prompt asks to be written: between its first pair of double quotes (straight or
    typographic), else the whole prompt."""
    m = _QUOTED.search(prompt)
    if m is None:
        return prompt
    return m.group(1) if m.group(1) is not None else m.group(2)


def levenshtein(a: str, b: str) -> int:
    """The edit distance (insertions, deletions, substitutions, each 1) between ``a`` and ``b``."""
    if len(a) < len(b):
        a, b = b, a  # one row of the shorter string's length
    row = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        diag, row[0] = row[0], i
        for j, cb in enumerate(b, 1):
            diag, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, diag + (ca != cb))
    return row[-1]


def _normalise(text: str) -> str:
    return " ".join(text.lower().split())


def ocr_similarity(prediction: str, target: str) -> float:
    """``max(0, 1 - edit distance / len(target))``, both texts lower-cased with runs of whitespace
    collapsed to one space (so a reading that differs only in case or spacing scores 1)."""
    pred, tgt = _normalise(prediction), _normalise(target)
    return max(0.0, 1.0 - levenshtein(pred, tgt) / max(len(tgt), 1))


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
    ) -> None:
        from transformers import AutoModelForImageTextToText

        if max_new_tokens < 1 or batch_size < 1:
            raise ValueError(
                f"vlm_ocr_judge: max_new_tokens and batch_size must be >= 1, got {max_new_tokens}, {batch_size}"
            )
        path = Path(str(model))
        if not (path / "config.json").is_file():
            raise ValueError(f"vlm_ocr_judge: model={model!r} is not a transformers folder (no config.json)")
        if device is None:
            # Under torchrun each rank has set its own CUDA device; the judge runs beside it.
            device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        if dtype is None:
            self.dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        else:
            self.dtype = getattr(torch, str(dtype))
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

    def _prompt_text(self) -> str:
        messages = [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": self.INSTRUCTION}]}
        ]
        return self.tokenizer.apply_chat_template(
            messages, chat_template=self.chat_template, tokenize=False, add_generation_prompt=True
        )

    def _inputs(self, frames: torch.Tensor) -> dict[str, torch.Tensor]:
        """The model's inputs for uint8 ``[B, 3, H, W]``: what a Qwen-VL processor makes for images
        (pixel patches, each image's grid, its pad token repeated once per merged patch)."""
        from PIL import Image

        pil = [Image.fromarray(f.permute(1, 2, 0).contiguous().numpy()) for f in frames]
        vision = self.image_processor(images=pil, return_tensors="pt")
        grids = vision["image_grid_thw"]
        template = self._prompt_text()
        texts = [
            template.replace(self.image_token, self.image_token * (int(g.prod()) // self.merge**2), 1)
            for g in grids
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
    def __call__(self, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        frames = _frames(images)[:, 0]  # a video is judged on its first frame
        if len(prompts) != frames.shape[0]:
            raise ValueError(f"vlm_ocr_judge: {frames.shape[0]} images but {len(prompts)} prompts")
        start = time.perf_counter()
        if self.offload:
            for t, host in self._host:
                t.data = host.to(self.device, non_blocking=True)
        try:
            readings, generated = self._read(frames)
        finally:
            if self.offload:
                self._back_to_host()
        scores = [ocr_similarity(r, ocr_target(p)) for r, p in zip(readings, prompts, strict=True)]
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

    def _read(self, frames: torch.Tensor) -> tuple[list[str], int]:
        readings: list[str] = []
        generated = 0
        for lo in range(0, frames.shape[0], self.batch_size):
            inputs = self._inputs(frames[lo : lo + self.batch_size])
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


BUILTIN_REWARDS: dict[str, Callable[..., Reward]] = {
    "jpeg_compressibility": jpeg_compressibility,
    "jpeg_incompressibility": jpeg_incompressibility,
    "brightness": brightness,
    "vlm_ocr_judge": vlm_ocr_judge,
}


def _coerce(value: str) -> object:
    for cast in (int, float):
        try:
            return cast(value)
        except ValueError:
            pass
    return value


def _import_object(target: str) -> tuple[object, str]:
    """The object ``module:attr`` or ``file.py:attr`` names, and the file it came from."""
    where, _, attr = target.rpartition(":")
    if not where or not attr:
        raise ValueError(
            f"reward {target!r}: expected a built-in name {sorted(BUILTIN_REWARDS)} or 'module:callable'"
        )
    if where.endswith(".py"):
        path = Path(where)
        if not path.is_file():
            raise ValueError(f"reward {target!r}: no file {path}")
        spec = importlib.util.spec_from_file_location(f"user_reward_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    try:
        return getattr(module, attr), str(getattr(module, "__file__", None) or module.__name__)
    except AttributeError:
        raise ValueError(f"reward {target!r}: {where} has no attribute {attr!r}") from None


def load_reward(spec: str) -> Reward:
    """The reward a ``--reward`` spec names (see the module docstring)."""
    name, _, query = spec.partition("?")
    kwargs = {k: _coerce(v) for k, v in parse_qsl(query, strict_parsing=bool(query))}
    if name in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[name](**kwargs)
    obj, origin = _import_object(name)
    logger.info(
        "reward %r: imported %s from %s%s; it runs in this process as this user (a reward spec is code)",
        spec, name, origin,
        f" and called with {kwargs}" if kwargs else "",
    )  # fmt: skip
    # A class or a factory (no positional parameters) is instantiated; a reward function is used as is.
    if inspect.isclass(obj) or kwargs or _takes_no_arguments(obj):
        obj = obj(**kwargs)
    if not callable(obj):
        raise ValueError(f"reward {spec!r} is not callable")
    return obj


def _takes_no_arguments(obj: object) -> bool:
    try:
        params = inspect.signature(obj).parameters.values()
    except (TypeError, ValueError):
        return False
    return all(p.default is not p.empty or p.kind in (p.VAR_KEYWORD,) for p in params)
