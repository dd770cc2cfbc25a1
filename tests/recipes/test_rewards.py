"""The recipes' reward plug-ins (examples/rewards.py): the built-in rewards against values computed
here independently with Pillow, and every form of ``--reward SPEC`` that ``load_reward`` accepts."""

from __future__ import annotations

import importlib
import io
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture
def rewards(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    return importlib.import_module("rewards")


def _jpeg_kb(image_chw: torch.Tensor, quality: int = 95) -> float:
    """The JPEG size in kB of one uint8 [3, H, W] image, written plainly with Pillow."""
    buf = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(image_chw.numpy().transpose(1, 2, 0))).save(
        buf, format="JPEG", quality=quality
    )
    return len(buf.getvalue()) / 1000.0


def _images() -> torch.Tensor:
    """[3, 3, 32, 32] uint8: a flat grey image, a smooth gradient, uniform noise."""
    g = torch.Generator().manual_seed(0)
    flat = torch.full((3, 32, 32), 128, dtype=torch.uint8)
    ramp = torch.linspace(0, 255, 32).round().to(torch.uint8).expand(3, 32, 32).contiguous()
    noise = torch.randint(0, 256, (3, 32, 32), generator=g, dtype=torch.uint8)
    return torch.stack([flat, ramp, noise])


PROMPTS3 = ["a cat", "a dog", "a horse"]


# ---------------------------------------------------------------------------------------------- built-ins
def test_jpeg_compressibility_is_minus_the_jpeg_size_in_kb(rewards):
    images = _images()
    r = rewards.jpeg_compressibility()(images, PROMPTS3)
    assert r.dtype == torch.float32 and r.shape == (3,)
    expected = torch.tensor([-_jpeg_kb(im) for im in images], dtype=torch.float32)
    assert torch.equal(r, expected)
    # A flat image compresses better (less negative) than noise.
    assert r[0] > r[1] > r[2]
    assert float(r[2]) < -1.0  # 32x32 noise at quality 95 is well over a kB


def test_jpeg_quality_is_a_parameter(rewards):
    images = _images()
    r80 = rewards.jpeg_compressibility(quality=80)(images, PROMPTS3)
    assert torch.equal(r80, torch.tensor([-_jpeg_kb(im, 80) for im in images], dtype=torch.float32))
    assert r80[2] > rewards.jpeg_compressibility()(images, PROMPTS3)[2]  # lower quality: smaller file


def test_video_reward_is_the_mean_over_frames(rewards):
    images = _images()
    # [N=2, 3, F=3, H, W]: sample 0 is flat, ramp, noise over time; sample 1 the reverse.
    video = torch.stack([images.permute(1, 0, 2, 3), images.flip(0).permute(1, 0, 2, 3)])
    assert video.shape == (2, 3, 3, 32, 32)
    r = rewards.jpeg_compressibility()(video, ["a", "b"])
    per_frame = [_jpeg_kb(im) for im in images]
    expected = -sum(per_frame) / 3
    assert r.shape == (2,) and r[0] == r[1] == torch.tensor(expected, dtype=torch.float32)
    # A video of the flat frame only scores better than one with a noisy frame.
    still = images[0].unsqueeze(1).expand(3, 3, 32, 32).unsqueeze(0).contiguous()
    assert rewards.jpeg_compressibility()(still, ["a"])[0] > r[0]


def test_incompressibility_is_minus_compressibility(rewards):
    images = _images()
    assert torch.equal(
        rewards.jpeg_incompressibility()(images, PROMPTS3), -rewards.jpeg_compressibility()(images, PROMPTS3)
    )
    assert torch.equal(
        rewards.jpeg_incompressibility(quality=70)(images, PROMPTS3),
        -rewards.jpeg_compressibility(quality=70)(images, PROMPTS3),
    )


def test_brightness(rewards):
    images = torch.stack(
        [torch.full((3, 8, 8), v, dtype=torch.uint8) for v in (0, 255, 204)]
        + [torch.cat([torch.zeros(3, 4, 8), torch.full((3, 4, 8), 255.0)], dim=1).to(torch.uint8)]
    )
    r = rewards.brightness(target=0.5)(images, ["p"] * 4)
    assert r.shape == (4,)
    # Mean pixel value in [0, 1]: 0, 1, 0.8, 0.5 -> minus the squared distance to 0.5.
    assert r.tolist() == pytest.approx([-0.25, -0.25, -(0.3**2), 0.0], abs=1e-6)
    assert rewards.brightness()(images[2:3], ["p"])[0] == pytest.approx(0.0, abs=1e-6)  # default 0.8


def test_rewards_refuse_float_images_and_other_shapes(rewards):
    floats = _images().float() / 255
    for reward in (rewards.jpeg_compressibility(), rewards.jpeg_incompressibility(), rewards.brightness()):
        with pytest.raises(TypeError, match=r"uint8.*torch\.float32"):
            reward(floats, PROMPTS3)
        with pytest.raises(ValueError, match=r"\[N, 3, H, W\].*\(3, 32, 32\)"):
            reward(_images()[0], ["a"])


# ---------------------------------------------------------------------------------------------- load_reward
def test_load_reward_builtin_names_and_kwargs(rewards):
    images = _images()
    for name, make in rewards.BUILTIN_REWARDS.items():
        if name in ("vlm_ocr_judge", "vlm_judge", "clip_score"):  # need model=FOLDER: test_reward_models.py
            continue
        assert torch.equal(rewards.load_reward(name)(images, PROMPTS3), make()(images, PROMPTS3)), name
    q80 = rewards.load_reward("jpeg_compressibility?quality=80")(images, PROMPTS3)
    assert torch.equal(q80, rewards.jpeg_compressibility(quality=80)(images, PROMPTS3))
    assert not torch.equal(q80, rewards.jpeg_compressibility()(images, PROMPTS3))  # the kwarg took effect
    half = rewards.load_reward("brightness?target=0.5")(images, PROMPTS3)
    assert torch.equal(half, rewards.brightness(target=0.5)(images, PROMPTS3))


_PLUGIN = """
import torch

CALLS = []
THRESHOLD = 3


def score(images, prompts):
    CALLS.append(list(prompts))
    return images.float().mean(dim=(1, 2, 3))


def make_scaled():
    return lambda images, prompts: 2 * images.float().mean(dim=(1, 2, 3))


class Scorer:
    instances = 0

    def __init__(self, scale=1.0):
        type(self).instances += 1
        self.scale = scale

    def __call__(self, images, prompts):
        return self.scale * images.float().mean(dim=(1, 2, 3))
"""


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """A reward module in tmp_path, importable by a name unique to this test."""
    name = f"user_rewards_{uuid.uuid4().hex[:8]}"
    path = tmp_path / f"{name}.py"
    path.write_text(_PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    return name, path


def test_load_reward_module_callable(rewards, plugin):
    name, _ = plugin
    reward = rewards.load_reward(f"{name}:score")
    module = importlib.import_module(name)
    assert reward is module.score  # a reward function is used as is, not called at load
    images = _images()
    assert torch.equal(reward(images, PROMPTS3), images.float().mean(dim=(1, 2, 3)))
    assert module.CALLS == [PROMPTS3]


def test_load_reward_file_path_callable(rewards, plugin):
    _, path = plugin
    reward = rewards.load_reward(f"{path}:score")
    images = _images()
    assert torch.equal(reward(images, PROMPTS3), images.float().mean(dim=(1, 2, 3)))


def test_load_reward_instantiates_a_class_or_factory_once(rewards, plugin):
    name, path = plugin
    module = importlib.import_module(name)
    images = _images()
    mean = images.float().mean(dim=(1, 2, 3))
    reward = rewards.load_reward(f"{name}:Scorer")
    assert isinstance(reward, module.Scorer) and module.Scorer.instances == 1
    for _ in range(3):
        assert torch.equal(reward(images, PROMPTS3), mean)
    assert module.Scorer.instances == 1  # built once at load, not per call
    scaled = rewards.load_reward(f"{name}:Scorer?scale=3")
    assert scaled.scale == 3 and torch.equal(scaled(images, PROMPTS3), 3 * mean)
    assert module.Scorer.instances == 2
    factory = rewards.load_reward(f"{name}:make_scaled")  # a no-argument factory is called
    assert torch.equal(factory(images, PROMPTS3), 2 * mean)
    # The same class through a file path.
    from_file = rewards.load_reward(f"{path}:Scorer?scale=2")
    assert torch.equal(from_file(images, PROMPTS3), 2 * mean)


def test_load_reward_errors_name_the_problem(rewards, plugin, tmp_path):
    name, path = plugin
    with pytest.raises(ValueError, match=r"no_such_reward.*jpeg_compressibility.*module:callable"):
        rewards.load_reward("no_such_reward")
    with pytest.raises(ValueError, match=rf"{name} has no attribute 'missing'"):
        rewards.load_reward(f"{name}:missing")
    with pytest.raises(ValueError, match=r"has no attribute 'missing'"):
        rewards.load_reward(f"{path}:missing")
    with pytest.raises(ValueError, match=r"no file .*nowhere\.py"):
        rewards.load_reward(f"{tmp_path / 'nowhere.py'}:score")
    with pytest.raises(ValueError, match=r"THRESHOLD' is not callable"):
        rewards.load_reward(f"{name}:THRESHOLD")
    with pytest.raises(ValueError, match="bad query"):
        rewards.load_reward("jpeg_compressibility?quality")
