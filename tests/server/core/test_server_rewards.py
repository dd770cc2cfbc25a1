"""Rewards scored on the server (``serve --reward``, server/core/reward_runner.py), through the real app on
tiny SD3: the values equal the same callable's in the trainer bit for bit, failures are per output and
named, no pixels travel with ``return_output=false``, metadata and group-wise rewards, batching
across requests, and a reward that cannot load stops the start."""

from __future__ import annotations

import math
import subprocess
import sys
import threading
import time

import pytest
import torch

from diffusion_rollout.client import RolloutClient
from diffusion_rollout.config import ServerConfig
from diffusion_rollout.errors import ServiceUnavailableError
from diffusion_rollout.protocol import wire
from diffusion_rollout.rewards import load_reward
from diffusion_rollout.server.core.reward_runner import RewardLane, RewardRunner
from tests.reliability_helpers import live_server

PLUGIN = '''
import math, threading, time
import torch

def mean_pixel(images, prompts):
    return images.float().mean(dim=tuple(range(1, images.ndim)))

def broken(images, prompts):
    raise RuntimeError("the judge is down")

def second_is_nan(images, prompts):
    out = torch.ones(images.shape[0])
    out[1] = math.nan
    return out

def slow(images, prompts):
    time.sleep(3)
    return torch.zeros(images.shape[0])

def text_length(images, prompts, metadata):
    return torch.tensor([float(len(m.get("text", ""))) for m in metadata])

class GroupRank:
    """Each output's rank of brightness within its group (0 = darkest)."""
    groupwise = True
    def __init__(self):
        self.sizes = []
    def __call__(self, images, prompts):
        self.sizes.append(images.shape[0])
        means = images.float().mean(dim=(1, 2, 3))
        return means.argsort().argsort().float()
'''


@pytest.fixture(scope="module")
def plugin(tmp_path_factory):
    path = tmp_path_factory.mktemp("rewards") / "my_rewards.py"
    path.write_text(PLUGIN)
    return path


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory):
    from benchmarks.judge_builders import save_vlm_judge

    path = tmp_path_factory.mktemp("judge")
    save_vlm_judge(path, size="tiny", dtype=torch.float32, device="cpu", seed=0)
    return path


BODY = {
    "prompt": 'a sign that says "OPEN"',
    "num_outputs_per_prompt": 3,
    "seed": 11,
    "num_inference_steps": 2,
    "output_dtype": "uint8",
    "rollout_sde_step_indices": [0],
}


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    from benchmarks.judge_builders import save_clip_scorer

    return save_clip_scorer(tmp_path_factory.mktemp("clip"), "tiny")


def test_server_rewards_equal_the_trainers_bit_for_bit(fresh_server, plugin, judge_dir, clip_dir):
    judge = f"vlm_ocr_judge?model={judge_dir}&device=cpu&max_new_tokens=4"
    specs = {
        "pick": f"clip:{clip_dir}",
        "jpeg": "jpeg_compressibility",
        "bright": "brightness?target=0.3",
        "ocr": judge,
        "mine": f"{plugin}:mean_pixel",
    }
    server = fresh_server("sd3", reward=[f"{k}={v}" for k, v in specs.items()])
    [out0, *rest] = outputs = server.generate({**BODY, "rewards": list(specs)})
    images = torch.stack([o["generated_output"] for o in outputs])
    assert images.dtype == torch.uint8 and images.shape[0] == 3
    for name, spec in specs.items():
        trainer = load_reward(spec)  # what a recipe scoring in the trainer runs
        expected = trainer(images, [BODY["prompt"]] * 3)
        got = torch.tensor([o["rewards"][name] for o in outputs], dtype=torch.float32)
        assert torch.equal(got, expected), (name, got, expected)
        if name == "ocr":  # the judge's reading travels with its value
            assert [o["reward_extras"]["ocr"]["reading"] for o in outputs] == trainer.last_readings
    assert all("reward_errors" not in o for o in outputs)
    assert out0["rollout_log_probs"].shape[0] == 2 and rest  # the rollout is answered as usual
    # JSON carries the same values (float32 -> double -> float32 is exact).
    r = server.client.post(
        "/rollout/generate", json={**BODY, "rewards": ["jpeg"]}, headers={"Accept": "application/json"}
    )
    assert r.status_code == 200
    assert [o["rewards"]["jpeg"] for o in r.json()] == [o["rewards"]["jpeg"] for o in outputs]
    info = server.client.get("/server_info").json()
    assert info["rewards"]["ocr"]["calls"] >= 1 and info["rewards"]["jpeg"]["spec"] == "jpeg_compressibility"


def test_answers_without_pixels_carry_the_same_rewards(fresh_server, plugin):
    server = fresh_server("sd3", reward=["jpeg=jpeg_compressibility", f"mine={plugin}:mean_pixel"])
    body = {**BODY, "rewards": ["jpeg", "mine"]}
    with_pixels = server.client.post(
        "/rollout/generate", json=body, headers={"Accept": "application/msgpack"}
    )
    without = server.client.post(
        "/rollout/generate", json={**body, "return_output": False}, headers={"Accept": "application/msgpack"}
    )
    a = wire.decode(with_pixels.content, with_pixels.headers["content-type"])
    b = wire.decode(without.content, without.headers["content-type"])
    assert all(o["generated_output"] is None for o in b)
    assert [o["rewards"] for o in a] == [o["rewards"] for o in b]
    assert all(torch.equal(x["rollout_log_probs"], y["rollout_log_probs"]) for x, y in zip(a, b, strict=True))
    # The bytes saved are the images' (3 x 3 x 64 x 64 uint8 on tiny SD3's default size).
    saved = len(with_pixels.content) - len(without.content)
    pixels = sum(o["generated_output"].numel() for o in a)
    assert pixels <= saved < pixels + 1024


def test_a_failing_reward_is_named_per_output_and_the_rest_is_answered(fresh_server, plugin):
    server = fresh_server(
        "sd3",
        reward=[
            f"broken={plugin}:broken", f"nan={plugin}:second_is_nan", f"slow={plugin}:slow",
            "jpeg=jpeg_compressibility",
        ],
        reward_timeout_s=0.5,
    )  # fmt: skip
    outputs = server.generate({**BODY, "rewards": ["broken", "nan", "slow", "jpeg"]})
    for i, o in enumerate(outputs):
        assert o["rewards"]["broken"] is None
        assert o["reward_errors"]["broken"] == "raised RuntimeError: the judge is down"
        assert o["rewards"]["slow"] is None and "timed out after 0.5 s" in o["reward_errors"]["slow"]
        assert math.isfinite(o["rewards"]["jpeg"]) and "jpeg" not in o["reward_errors"]
        if i == 1:
            assert o["rewards"]["nan"] is None and "non-finite" in o["reward_errors"]["nan"]
        else:
            assert o["rewards"]["nan"] == 1.0 and "nan" not in o["reward_errors"]
        assert o["generated_output"] is not None and o["rollout_log_probs"] is not None


@pytest.mark.parametrize(
    ("patch", "field"),
    [
        ({"rewards": ["nope"]}, "rewards"),
        ({"rewards": ["jpeg", "jpeg"]}, "rewards"),
        ({"rewards": ["jpeg"], "return_generated_output": False}, "return_generated_output"),
        ({"rewards": ["jpeg"], "reward_metadata": [{}, {}]}, "reward_metadata"),
        ({"reward_metadata": {"text": "x"}}, "reward_metadata"),
    ],
)
def test_bad_reward_fields_are_a_400_naming_the_field(served_rewards, patch, field):
    r = served_rewards.generate({**BODY, **patch}, accept="application/json", expect=400)
    error = r.json()["error"]
    assert error["type"] == "invalid_request" and field in error["message"], r.text


@pytest.fixture(scope="module")
def served_rewards(tiny_model_path, plugin):
    from tests.conftest import ServedModel

    s = ServedModel(
        tiny_model_path("sd3"),
        reward=["jpeg=jpeg_compressibility", f"meta={plugin}:text_length", f"rank={plugin}:GroupRank"],
    )
    yield s
    s.close()


def test_metadata_per_prompt_and_group_wise_rewards(served_rewards):
    body = {
        **BODY,
        "prompt": ["a cat", "a dog"],
        "num_outputs_per_prompt": 2,
        "rewards": ["meta", "rank"],
        "reward_metadata": [{"text": "abc"}, {"text": "hello"}],
    }
    outputs = served_rewards.generate(body)
    assert [o["rewards"]["meta"] for o in outputs] == [3.0, 3.0, 5.0, 5.0]
    rank = served_rewards.engine.rewards.lanes["rank"].reward
    assert rank.sizes[-2:] == [2, 2]  # one call per group, never merged across requests
    ranks = [o["rewards"]["rank"] for o in outputs]
    assert sorted(ranks[:2]) == [0.0, 1.0] and sorted(ranks[2:]) == [0.0, 1.0]
    for group in (outputs[:2], outputs[2:]):
        means = [float(o["generated_output"].float().mean()) for o in group]
        assert (means[0] > means[1]) == (group[0]["rewards"]["rank"] > group[1]["rewards"]["rank"])


def test_the_client_returns_rewards(fresh_server, plugin):
    # Private servers for the live (uvicorn) tests: live_server drains its engine at the end.
    server = fresh_server("sd3", reward=["jpeg=jpeg_compressibility", f"meta={plugin}:text_length"])
    with live_server(server) as (url, _), RolloutClient(url, timeout=60) as client:
        [outs] = client.generate_many(
            [{"prompt": "a cat", "reward_metadata": {"text": "four"}}],
            rewards=["jpeg", "meta"], return_output=False, num_outputs_per_prompt=2, seed=3,
            num_inference_steps=2, output_dtype="uint8",
        )  # fmt: skip
    assert [o.rewards["meta"] for o in outs] == [4.0, 4.0]
    assert all(o.generated_output is None and o.rewards["jpeg"] < 0 for o in outs)


def test_the_async_client_returns_rewards(fresh_server):
    import asyncio

    from diffusion_rollout.client import AsyncRolloutClient

    async def go(url: str):
        async with AsyncRolloutClient(url, timeout=60) as client:
            return await client.generate_many(
                ["a cat", "a dog"], rewards=["jpeg"], seed=3, num_inference_steps=2, output_dtype="uint8",
                num_outputs_per_prompt=2,
            )  # fmt: skip

    with live_server(fresh_server("sd3", reward=["jpeg=jpeg_compressibility"])) as (url, _):
        answers = asyncio.run(go(url))
    from diffusion_rollout.rewards import jpeg_compressibility

    for outs in answers:
        images = torch.stack([o.generated_output for o in outs])
        expected = jpeg_compressibility()(images, [o.prompt for o in outs])
        assert torch.equal(torch.tensor([o.rewards["jpeg"] for o in outs]), expected)


def test_a_reward_lane_batches_waiting_requests_and_halves_on_out_of_memory():
    gate = threading.Event()
    sizes: list[int] = []

    def reward(images, prompts):
        sizes.append(images.shape[0])
        if len(sizes) == 1:
            gate.wait(10)  # hold the thread while more requests queue
        if images.shape[0] > 4:
            raise torch.cuda.OutOfMemoryError("too big")
        return images.float().mean(dim=(1, 2, 3))

    lane = RewardLane("r", "test", reward, "cpu", batch_size=16)
    try:
        imgs = [torch.full((n, 3, 4, 4), v, dtype=torch.uint8) for n, v in ((1, 1), (3, 2), (3, 3), (2, 4))]
        first = lane.submit(imgs[0], ["p"], [{}])
        time.sleep(0.2)
        rest = [lane.submit(im, ["p"] * im.shape[0], [{}] * im.shape[0]) for im in imgs[1:]]
        gate.set()
        values = [f.result(10).values for f in (first, *rest)]
    finally:
        lane.close()
    assert values == [[1.0], [2.0] * 3, [3.0] * 3, [4.0] * 2]
    # The three waiting requests went as one call of 8, which ran out of memory and was retried in
    # halves of 4; the limit stays halved.
    assert sizes == [1, 8, 4, 4] and lane.batch_size == 4


def test_a_reward_that_cannot_load_stops_the_start(tmp_path):
    runner = RewardRunner(ServerConfig(reward=[f"x={tmp_path}/missing.py:f"]), "cpu")
    with pytest.raises(ServiceUnavailableError, match=r"reward 'x' .* failed to load: ValueError: .*no file"):
        runner.load()


def test_serve_exits_naming_a_reward_that_cannot_load(tmp_path, tiny_model_path):
    proc = subprocess.run(
        [sys.executable, "-m", "diffusion_rollout.entrypoints.cli", "serve", "--model", str(tiny_model_path("sd3")),
         "--device", "cpu", "--port", "0", "--reward", f"x={tmp_path}/missing.py:f"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode != 0
    assert "reward 'x'" in proc.stderr and "failed to load" in proc.stderr, proc.stderr[-2000:]


def test_scoring_leaves_the_worker_free_for_the_next_batch(fresh_server, tmp_path):
    # A reward held mid-call: another request is generated and answered meanwhile, so scoring is off
    # the worker's critical path; the held request is answered once its reward returns.
    import concurrent.futures

    gate = tmp_path / "gate.py"
    gate.write_text(
        "import threading\nimport torch\nRELEASE = threading.Event()\nENTERED = threading.Event()\n"
        "def held(images, prompts):\n    ENTERED.set()\n    RELEASE.wait(30)\n"
        "    return torch.zeros(images.shape[0])\n"
    )
    server = fresh_server("sd3", reward=[f"held={gate}:held"])
    module = server.engine.rewards.lanes["held"].reward.__globals__
    body = {**BODY, "num_outputs_per_prompt": 1}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        scored = pool.submit(server.generate, {**body, "rewards": ["held"]})
        assert module["ENTERED"].wait(30)  # the first request is being scored now
        other = server.generate({**body, "seed": 99})  # generated and answered while it waits
        assert other[0]["generated_output"] is not None and not scored.done()
        module["RELEASE"].set()
        assert scored.result(30)[0]["rewards"] == {"held": 0.0}
