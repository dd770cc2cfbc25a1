"""The model-backed rewards (diffusion_rollout.rewards) on tiny random models built offline: the CLIP
score against its formula computed here, the VLM judge's yes/no probability and per-prompt OCR
target, the HTTP reward against a local service in both of its APIs, and the spec forms that name
them."""

from __future__ import annotations

import base64
import io
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import numpy as np
import pytest
import torch
from PIL import Image

from diffusion_rollout.rewards import load_reward, ocr_similarity, parse_named_reward, score

PROMPTS = ['a sign that says "OPEN"', "a dog", "a red house"]


def _images(n: int = 3) -> torch.Tensor:
    return torch.randint(
        0, 256, (n, 3, 48, 64), generator=torch.Generator().manual_seed(0), dtype=torch.uint8
    )


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    from benchmarks.judge_builders import save_clip_scorer

    return save_clip_scorer(tmp_path_factory.mktemp("clip"), "tiny")


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory):
    from benchmarks.judge_builders import save_vlm_judge

    path = tmp_path_factory.mktemp("judge")
    save_vlm_judge(path, size="tiny", dtype=torch.float32, device="cpu", seed=0)
    return path


# ---------------------------------------------------------------------------------------------- CLIP
def test_clip_score_is_pickscores_formula(clip_dir):
    from transformers import AutoTokenizer, CLIPImageProcessor, CLIPModel

    reward = load_reward(f"clip:{clip_dir}?device=cpu")
    got = reward(_images(), PROMPTS)
    # The formula computed here from the model's parts: scale * cos(projected image, projected text).
    model = CLIPModel.from_pretrained(clip_dir).eval()
    proc, tok = CLIPImageProcessor.from_pretrained(clip_dir), AutoTokenizer.from_pretrained(clip_dir)
    pil = [Image.fromarray(f.permute(1, 2, 0).numpy()) for f in _images()]
    with torch.no_grad():
        img = model.visual_projection(
            model.vision_model(
                pixel_values=proc(images=pil, return_tensors="pt")["pixel_values"]
            ).pooler_output
        )
        text = tok(PROMPTS, padding=True, truncation=True, max_length=77, return_tensors="pt")
        txt = model.text_projection(model.text_model(**text).pooler_output)
    cos = torch.nn.functional.normalize(img, dim=-1) @ torch.nn.functional.normalize(txt, dim=-1).T
    expected = model.logit_scale.exp() * cos.diagonal()
    assert torch.allclose(got, expected, atol=1e-6), (got, expected)
    assert torch.equal(got, reward(_images(), PROMPTS))  # the same call, the same bits
    # clip_score?model= is the same reward; a batch of one per call may move the last bits only.
    one = load_reward(f"clip_score?model={clip_dir}&batch_size=1")(_images(), PROMPTS)
    assert torch.allclose(one, got, atol=1e-6)


def test_the_large_clip_is_pickscores_architecture():
    from transformers import CLIPModel

    from benchmarks.judge_builders import clip_config
    from diffusion_rollout.models.tokenizers import make_clip_tokenizer

    config = clip_config("large", make_clip_tokenizer())
    with torch.device("meta"):
        model = CLIPModel(config)
    params = sum(p.numel() for p in model.parameters())
    assert 0.95e9 < params < 1.0e9, params  # CLIP ViT-H/14: about 986M
    assert config.vision_config.patch_size == 14 and config.projection_dim == 1024


# ---------------------------------------------------------------------------------------------- VLM judge
def test_vlm_judge_yes_no_is_the_probability_of_yes(judge_dir):
    judge = load_reward(
        f"vlm_judge?model={judge_dir}&device=cpu&rule=yes_no&batch_size=2"
        "&template=Does this image show {prompt}? Answer yes or no."
    )
    p = judge(_images(), PROMPTS)
    assert p.shape == (3,) and bool(((p > 0) & (p < 1)).all())
    assert [e["p_yes"] for e in judge.last_extras] == p.tolist()
    # The same probability from the model's next-token logits, computed here for the first image.
    instruction = f"Does this image show {PROMPTS[0]}? Answer yes or no."
    inputs = judge._inputs(_images()[:1], [instruction])
    with torch.no_grad():
        probs = torch.softmax(judge.model(**inputs).logits[0, -1].float(), dim=-1)
    yes, no = judge._answer_ids("yes"), judge._answer_ids("no")
    expected = probs[yes].sum() / (probs[yes].sum() + probs[no].sum())
    assert abs(float(expected) - float(p[0])) < 1e-6


def test_vlm_ocr_judge_scores_against_the_requests_text(judge_dir):
    judge = load_reward(f"vlm_ocr_judge?model={judge_dir}&device=cpu&max_new_tokens=4")
    meta = [{"ocr_text": "HELLO"}, {}, {"text": "BYE"}]
    out = score(judge, _images(), PROMPTS, meta)
    readings = [e["reading"] for e in out.extras]
    targets = ["HELLO", "a dog", "BYE"]  # metadata first, else the prompt's quotes, else the prompt
    expected = [ocr_similarity(r, t) for r, t in zip(readings, targets, strict=True)]
    assert out.values == torch.tensor(expected, dtype=torch.float32).tolist()  # rewards are float32


# ---------------------------------------------------------------------------------------------- HTTP
class _Service(BaseHTTPRequestHandler):
    seen: ClassVar[list] = []

    def log_message(self, *args):  # quiet
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).seen.append((self.path, body))
        if self.path == "/score":
            out = {
                "rewards": [float(len(p)) for p in body["prompts"]],
                "extras": [{"n": i} for i in range(len(body["prompts"]))],
            }
        elif self.path == "/v1/chat/completions":
            text = body["messages"][0]["content"][1]["text"]
            out = {"choices": [{"message": {"content": "OPEN" if "OPEN" in text else "7.5 points"}}]}
        else:
            self.send_response(500)
            self.end_headers()
            self.wfile.write(b"broken")
            return
        data = json.dumps(out).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture(scope="module")
def service():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Service)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def _decoded(png_b64: str) -> torch.Tensor:
    return torch.from_numpy(np.array(Image.open(io.BytesIO(base64.b64decode(png_b64))))).permute(2, 0, 1)


def test_http_reward_json_api_sends_the_exact_pixels(service):
    _Service.seen.clear()
    reward = load_reward(f"{service}/score")
    out = score(reward, _images(), PROMPTS, [{"k": 1}, {}, {}])
    assert out.values == [float(len(p)) for p in PROMPTS] and out.extras == [{"n": 0}, {"n": 1}, {"n": 2}]
    [(path, body)] = _Service.seen
    assert path == "/score" and body["metadata"][0] == {"k": 1}
    for png, image in zip(body["images"], _images(), strict=True):
        assert torch.equal(_decoded(png), image)  # lossless: the uint8 pixels themselves


def test_http_reward_openai_api_scores_the_reply(service):
    _Service.seen.clear()
    ocr = load_reward(f"{service}/v1/chat/completions#api=openai&template=Read {{target}}&model=judge")
    out = score(ocr, _images(), PROMPTS)
    # "OPEN" is read where the instruction names it (the first prompt's quoted text).
    expected = [1.0, ocr_similarity("7.5 points", "a dog"), ocr_similarity("7.5 points", "a red house")]
    assert out.values == torch.tensor(expected, dtype=torch.float32).tolist()
    assert all(b["model"] == "judge" and b["temperature"] == 0 for _, b in _Service.seen)
    number = load_reward(f"{service}/v1/chat/completions#api=openai&rule=number&template=Rate it")
    assert score(number, _images(2), PROMPTS[:2]).values == [7.5, 7.5]


def test_a_failing_service_is_a_named_failure_per_sample(service):
    out = score(load_reward(f"{service}/nowhere"), _images(2), PROMPTS[:2])
    assert out.values == [None, None] and "answered 500" in out.errors[0]


def test_reward_names_and_specs():
    assert parse_named_reward("pick=clip:/models/pickscore") == ("pick", "clip:/models/pickscore")
    assert parse_named_reward("j=http://host:8000/v1/chat/completions#api=openai") == (
        "j", "http://host:8000/v1/chat/completions#api=openai",
    )  # fmt: skip
    for bare in ("clip:/models/x", "http://host/score", "my.mod:f"):
        with pytest.raises(ValueError, match="name it"):
            parse_named_reward(bare)
    with pytest.raises(ValueError, match="clip"):
        load_reward("clip_score")
