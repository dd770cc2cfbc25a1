"""Image-conditioned rollouts (FLUX.1 Kontext, Wan image-to-video) on tiny models, through HTTP.

Exactness is equality (``torch.equal``): ``rollout=false`` and ODE rollouts against the stock
pipeline given the same image (latents and decoded outputs); replay of every step from
``denoising_env`` (image latents included) against the recorded model outputs and log-probs, so the
policy ratio is exactly 1; an image sent by path, as base64 and as a data URI is the same request.
Every bad image is a 400 naming its field.
"""

from __future__ import annotations

import base64
import filecmp
import io
import os

import numpy as np
import pytest
import torch
from diffusers import DiffusionPipeline, FlowMatchEulerDiscreteScheduler
from PIL import Image

from diffusion_rollout.client.replay import replay_log_prob, replay_model_output, stack_envs
from diffusion_rollout.models import TINY_CALL_DEFAULTS, build_tiny_pipeline, family_of, save_tiny_model
from tests.conftest import ServedModel

T = 4
FAMILIES = ["flux-kontext", "wan-i2v", "wan2.2-ti2v-i2v"]
ODE = {"rollout_sde_type": "ode", "rollout_log_prob_no_const": True}


def _png(width: int, height: int, seed: int = 0, fmt: str = "PNG") -> bytes:
    pixels = (np.random.RandomState(seed).rand(height, width, 3) * 255).astype("uint8")
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format=fmt)
    return buf.getvalue()


IMAGE = _png(48, 40)
IMAGE_B64 = base64.b64encode(IMAGE).decode()


def pil(data: bytes = IMAGE) -> Image.Image:
    return Image.open(io.BytesIO(data)).convert("RGB")


def call_defaults(family: str) -> dict:
    d = dict(TINY_CALL_DEFAULTS[family])
    d.pop("max_area", None)  # the server derives it from width * height
    return d


def body(family: str, **kw) -> dict:
    return {"prompt": "a red cat", "seed": 7, "image_data": [IMAGE_B64], **call_defaults(family), **kw}


@pytest.fixture(scope="module")
def image_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("images")
    (root / "cat.png").write_bytes(IMAGE)
    (root / "sub").mkdir()
    (root / "sub" / "cat.png").write_bytes(IMAGE)
    (root / "notes.txt").write_text("not an image")
    return root


@pytest.fixture(scope="module")
def image_server(tiny_model_path, image_root):
    servers: dict[str, ServedModel] = {}

    def get(family: str) -> ServedModel:
        if family not in servers:
            servers[family] = ServedModel(
                tiny_model_path(family), image_path_root=str(image_root), max_image_bytes=64 * 1024
            )
        return servers[family]

    yield get
    for s in servers.values():
        s.close()


_stock: dict = {}


def stock(path, family, *, seeds, output_type, euler=False, image=IMAGE):
    """The stock pipeline from the same folder, called as a user would (Wan: UniPC, or Euler at its shift)."""
    key = (str(path), euler)
    if key not in _stock:
        pipe = DiffusionPipeline.from_pretrained(str(path), dtype=torch.float32)
        pipe.set_progress_bar_config(disable=True)
        if euler:
            pipe.scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
        _stock[key] = pipe
    pipe = _stock[key]
    gens = [torch.Generator("cpu").manual_seed(s) for s in seeds]
    args = {**TINY_CALL_DEFAULTS[family], "prompt": "a red cat", "image": pil(image)}
    if family.startswith("wan"):
        # WanImageToVideoPipeline repeats its CLIP image embedding by the number of prompts, not of
        # videos, so num_videos_per_prompt > 1 fails in the stock pipeline; a user passes the batch's
        # prompt embeddings instead (the prompt encoded once, repeated: what the server does too).
        prompt = args.pop("prompt")
        with torch.no_grad():  # as inside the pipeline: autograd's kernels may round differently
            pe, npe = pipe.encode_prompt(
                prompt,
                do_classifier_free_guidance=True,
                num_videos_per_prompt=len(seeds),
                max_sequence_length=16,
            )
        out = pipe(
            generator=gens, output_type=output_type, prompt_embeds=pe, negative_prompt_embeds=npe, **args
        )
        return out.frames if output_type == "latent" else out.frames.permute(0, 2, 1, 3, 4)
    return pipe(generator=gens, output_type=output_type, num_images_per_prompt=len(seeds), **args).images


def stack(outs, key="generated_output"):
    return torch.stack([o[key] for o in outs])


# --------------------------------------------------------------------------- the zoo entries
@pytest.mark.parametrize("family", FAMILIES)
def test_zoo_entry_is_byte_identical_per_seed_and_recognised(family, tiny_model_path, tmp_path):
    first = tiny_model_path(family)
    second = save_tiny_model(family, tmp_path / family)
    names = sorted(str(p.relative_to(first)) for p in first.rglob("*") if p.is_file())
    assert names == sorted(str(p.relative_to(second)) for p in second.rglob("*") if p.is_file())
    for name in names:
        assert filecmp.cmp(first / name, second / name, shallow=False), name
    pipe = DiffusionPipeline.from_pretrained(str(first))
    assert family_of(pipe) == family
    other = build_tiny_pipeline(family, seed=1).transformer.state_dict()
    assert not torch.equal(other["proj_out.weight"], pipe.transformer.state_dict()["proj_out.weight"])


# --------------------------------------------------------------------------- the ODE gate
@pytest.mark.parametrize("family", FAMILIES)
def test_rollout_false_is_the_stock_pipeline(image_server, tiny_model_path, family):
    srv, path = image_server(family), tiny_model_path(family)
    lat = srv.generate(body(family, rollout=False, num_outputs_per_prompt=2, return_generated_output=False))
    assert torch.equal(stack(lat), stock(path, family, seeds=[7, 8], output_type="latent"))
    out = srv.generate(body(family, rollout=False, num_outputs_per_prompt=2))
    assert torch.equal(stack(out), stock(path, family, seeds=[7, 8], output_type="pt"))


@pytest.mark.parametrize("family", FAMILIES)
def test_ode_rollout_is_the_stock_pipeline(image_server, tiny_model_path, family):
    srv, path = image_server(family), tiny_model_path(family)
    euler = family.startswith("wan")  # Wan rollouts run flow-match Euler at the checkpoint's shift
    lat = srv.generate(body(family, num_outputs_per_prompt=2, return_generated_output=False, **ODE))
    ref = stock(path, family, seeds=[7, 8], output_type="latent", euler=euler)
    assert torch.equal(stack(lat), ref)
    out = srv.generate(body(family, num_outputs_per_prompt=2, **ODE))
    assert torch.equal(stack(out), stock(path, family, seeds=[7, 8], output_type="pt", euler=euler))
    for o in out:
        assert torch.equal(o["rollout_log_probs"], torch.zeros(T))
    # The image matters: another image gives other latents.
    other = stock(path, family, seeds=[7, 8], output_type="latent", euler=euler, image=_png(48, 40, seed=1))
    assert not torch.equal(other, ref)


# --------------------------------------------------------------------------- replay
@pytest.mark.parametrize("family", FAMILIES)
def test_replay_rebuilds_the_transformer_input_exactly(image_server, family):
    srv = image_server(family)
    outs = srv.generate(
        body(
            family,
            num_outputs_per_prompt=2,
            rollout_return_dit_trajectory=True,
            rollout_return_denoising_env=True,
            rollout_debug_mode=True,
        )
    )
    pipe = srv.engine.pipe
    for out in outs:
        env = out["denoising_env"]
        if family == "wan2.2-ti2v-i2v":  # the image's latent is the model input's first frame
            first = env["latent_first_frame"]
            assert tuple(first["latents"].shape) == (1, 16, 1, 4, 4) and "latent_condition" not in env
            assert first["zero_timestep_tokens"] == 4 and env["timestep_tokens"] == 8  # 2x2 of 2 frames
            assert out["dit_trajectory"]["timesteps"][0] > 900  # the noisy frames' timestep, not 0
            continue
        cond = env["latent_condition"]
        assert cond["dim"] == 1 and cond["latents"].shape[0] == 1
        if family == "wan-i2v":  # channels: 4 mask + 16 first-frame latent; the output is not cut
            assert cond["latents"].shape[1] == 20 and cond["slice_output"] is False
            assert "encoder_hidden_states_image" in env["pos_cond_kwargs"]
        else:  # tokens of the resized input image, after the target's; the output is cut back
            assert cond["slice_output"] is True and cond["latents"].shape[1] > 0
    # Replay the server batch as one batch (its rows were computed together).
    envs = stack_envs([o["denoising_env"] for o in outs])
    traj = [o["dit_trajectory"] for o in outs]
    for step in range(T):
        x = torch.stack([t["latents"][step] for t in traj])
        with torch.no_grad():
            v = replay_model_output(pipe.transformer, x, traj[0]["timesteps"][step], envs, step=step)
        for i, out in enumerate(outs):
            assert torch.equal(v[i], out["rollout_debug_tensors"]["rollout_model_outputs"][step]), (i, step)
            nxt = traj[i]["latents"][step + 1 : step + 2]
            res = replay_log_prob("sde", x[i : i + 1], v[i : i + 1], nxt, traj[i]["sigmas"], step, eta=0.7)
            old = out["rollout_log_probs"][step]
            assert torch.equal(res.log_prob[0], old), (i, step)
            assert torch.exp(res.log_prob[0] - old).item() == 1.0
    # The image latents are really part of the input: other ones give another model output.
    key = "latent_first_frame" if family == "wan2.2-ti2v-i2v" else "latent_condition"
    blank = {**envs, key: {**envs[key], "latents": torch.zeros_like(envs[key]["latents"])}}
    x0 = torch.stack([t["latents"][0] for t in traj])
    with torch.no_grad():
        v = replay_model_output(pipe.transformer, x0, traj[0]["timesteps"][0], blank, step=0)
    assert not torch.equal(v[0], outs[0]["rollout_debug_tensors"]["rollout_model_outputs"][0])


# --------------------------------------------------------------------------- how images arrive
def test_path_base64_and_data_uri_are_the_same_image(image_server, image_root):
    family = "wan-i2v"
    srv = image_server(family)
    ref = srv.generate(body(family, rollout=False, return_generated_output=False))[0]["generated_output"]
    variants = [
        {"image_data": None, "image_path": [str(image_root / "cat.png")]},
        {"image_data": None, "image_path": ["sub/cat.png"]},  # relative to image_path_root
        {"image_data": None, "image_path": "cat.png"},  # one path, as SGLang's SamplingParams has it
        {"image_data": ["data:image/png;base64," + IMAGE_B64]},
    ]
    for extra in variants:
        (out,) = srv.generate(body(family, rollout=False, return_generated_output=False, **extra))
        assert torch.equal(out["generated_output"], ref), extra


# --------------------------------------------------------------------------- error rules
def _err(srv, b, field):
    r = srv.generate(b, expect=400)
    err = r.json()["error"]
    assert err["code"] == 400 and field in err["message"], err
    return err["message"]


@pytest.mark.parametrize(
    ("extra", "field", "needle"),
    [
        ({"image_data": [base64.b64encode(b"GIF89a not really").decode()]}, "image_data[0]", "not an image"),
        ({"image_data": ["%%% not base64"]}, "image_data[0]", "base64"),
        ({"image_data": [base64.b64encode(_png(300, 300, fmt="BMP")).decode()]}, "image_data[0]", "max_image_bytes"),
        ({"image_data": [base64.b64encode(_png(8, 40)).decode()]}, "image_data[0]", "at least"),
        ({"image_data": [base64.b64encode(_png(16, 200)).decode()]}, "image_data[0]", "aspect"),
        ({"image_data": [IMAGE_B64, IMAGE_B64]}, "image_data", "takes 1"),
        ({"image_data": None}, "image_path", "image-conditioned"),
        ({"image_data": None, "image_path": ["../../etc/passwd"]}, "image_path[0]", "outside"),
        ({"image_data": None, "image_path": ["/etc/hostname"]}, "image_path[0]", "outside"),
        ({"image_data": None, "image_path": ["missing.png"]}, "image_path[0]", "cannot read"),
        ({"image_data": None, "image_path": ["notes.txt"]}, "image_path[0]", "not an image"),
        ({"image_data": None, "image_path": ["sub"]}, "image_path[0]", "not a file"),
    ],
    ids=[
        "not_an_image", "bad_base64", "too_many_bytes", "too_small", "aspect", "too_many_images",
        "no_image", "climb_out", "absolute_outside", "missing_file", "text_file", "directory",
    ],
)  # fmt: skip
def test_bad_images_get_400_naming_the_field(image_server, extra, field, needle):
    msg = _err(image_server("wan-i2v"), body("wan-i2v", **extra), field)
    assert needle in msg


def test_image_pixel_limit(tiny_model_path, image_root):
    srv = ServedModel(tiny_model_path("wan-i2v"), image_path_root=str(image_root), max_image_pixels=40 * 40)
    try:
        msg = _err(srv, body("wan-i2v"), "image_data[0]")  # 48x40 > 1600 pixels
        assert "max_image_pixels" in msg
        msg = _err(srv, body("wan-i2v", image_data=None, image_path=["cat.png"]), "image_path[0]")
        assert "max_image_pixels" in msg
    finally:
        srv.close()


def test_image_path_is_refused_without_a_root(fresh_server, image_root):
    srv = fresh_server("wan-i2v")
    msg = _err(srv, body("wan-i2v", image_data=None, image_path=[str(image_root / "cat.png")]), "image_path")
    assert "image_path_root" in msg


@pytest.mark.parametrize("family", ["flux-kontext", "wan-i2v"])
def test_readiness_probe_sends_an_image(image_server, family):
    r = image_server(family).client.get("/health_generate")
    assert r.status_code == 200, r.text[:500]


def test_server_info_reports_the_image_limits(image_server):
    limits = image_server("wan-i2v").client.get("/server_info").json()["limits"]
    assert limits["max_image_bytes"] == 64 * 1024 and limits["max_image_pixels"] == 4096 * 4096


def test_text_only_family_refuses_images(served):
    b = {"prompt": "a red cat", "seed": 7, "image_data": [IMAGE_B64], **TINY_CALL_DEFAULTS["flux"]}
    msg = _err(served("flux"), b, "image_data")
    assert "takes no input images" in msg


def test_symlink_out_of_the_root_is_refused(image_server, image_root, tmp_path):
    outside = tmp_path / "secret.png"
    outside.write_bytes(IMAGE)
    link = image_root / "link.png"
    if not link.exists():
        os.symlink(outside, link)
    msg = _err(
        image_server("wan-i2v"), body("wan-i2v", image_data=None, image_path=["link.png"]), "image_path"
    )
    assert "outside" in msg


def test_msgpack_body_carries_raw_image_bytes(image_server):
    """A remote trainer sends the image file's raw bytes in a msgpack body: the same request as base64."""
    import msgpack

    from diffusion_rollout.protocol import wire

    srv = image_server("wan-i2v")
    ref = srv.generate(body("wan-i2v", rollout=False, return_generated_output=False))[0]["generated_output"]
    raw = {**body("wan-i2v", rollout=False, return_generated_output=False), "image_data": [IMAGE]}
    headers = {"Content-Type": "application/msgpack", "Accept": wire.MSGPACK}
    r = srv.client.post("/rollout/generate", content=msgpack.packb(raw), headers=headers)
    assert r.status_code == 200, r.text[:500]
    (out,) = wire.decode(r.content, r.headers["content-type"])
    assert torch.equal(out["generated_output"], ref)
    # Rules hold in msgpack as in JSON: a bad image is a 400 naming it, a bad body a 400, a typo is
    # accepted and named in ignored_fields.
    bad = {**raw, "image_data": [b"not an image"]}
    r = srv.client.post("/rollout/generate", content=msgpack.packb(bad), headers=headers)
    assert r.status_code == 400 and "image_data[0]" in r.json()["error"]["message"]
    r = srv.client.post("/rollout/generate", content=b"\xc1 not msgpack", headers=headers)
    assert r.status_code == 400 and "msgpack" in r.json()["error"]["message"]
    r = srv.client.post("/rollout/generate", content=msgpack.packb({**raw, "sead": 1}), headers=headers)
    assert r.status_code == 200, r.text[:500]
    assert wire.decode(r.content, r.headers["content-type"])[0]["ignored_fields"] == ["sead"]


def test_trainer_client_sends_image_bytes(image_server):
    """``RolloutClient.generate(image_data=[bytes])``: the client base64s the file; same output."""
    from diffusion_rollout.client import RolloutClient

    srv = image_server("wan-i2v")
    ref = srv.generate(body("wan-i2v", rollout=False, return_generated_output=False))[0]["generated_output"]
    client = RolloutClient("http://testserver", http_client=srv.client)
    fields = {k: v for k, v in body("wan-i2v", rollout=False, return_generated_output=False).items()}
    fields.pop("prompt")
    fields["image_data"] = [IMAGE]
    (out,) = client.generate("a red cat", **fields)
    assert torch.equal(out.generated_output, ref)
