"""The OCR task: the text a prompt asks for, and how close a reading of the image comes to it."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

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


def target_text(prompt: str, metadata: Mapping[str, Any] | None) -> str:
    """The text an OCR-style rule compares with: the request's ``ocr_text`` (or ``text``), else the
    prompt's quoted text."""
    meta = metadata or {}
    for key in ("ocr_text", "text"):
        if isinstance(meta.get(key), str):
            return meta[key]
    return ocr_target(prompt)
