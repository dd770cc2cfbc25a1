"""Rewards: the built-ins, ``--reward SPEC`` loading and the calling convention, shared by the
recipes (scored in the trainer) and ``serve --reward`` (scored on the server)."""

from diffusion_rollout.rewards.calling import Scores, call_reward, is_groupwise, score, takes_metadata
from diffusion_rollout.rewards.clip_score import ClipScore, clip_score
from diffusion_rollout.rewards.http_reward import HttpReward
from diffusion_rollout.rewards.ocr import OCR_PROMPTS, levenshtein, ocr_similarity, ocr_target
from diffusion_rollout.rewards.simple import Reward, brightness, jpeg_compressibility, jpeg_incompressibility
from diffusion_rollout.rewards.spec import BUILTIN_REWARDS, load_reward, parse_named_reward
from diffusion_rollout.rewards.vlm_judge import VlmOcrJudge, vlm_judge, vlm_ocr_judge

__all__ = [
    "BUILTIN_REWARDS",
    "OCR_PROMPTS",
    "ClipScore",
    "HttpReward",
    "Reward",
    "Scores",
    "VlmOcrJudge",
    "brightness",
    "call_reward",
    "clip_score",
    "is_groupwise",
    "jpeg_compressibility",
    "jpeg_incompressibility",
    "levenshtein",
    "load_reward",
    "ocr_similarity",
    "ocr_target",
    "parse_named_reward",
    "score",
    "takes_metadata",
    "vlm_judge",
    "vlm_ocr_judge",
]
