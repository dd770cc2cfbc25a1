"""Tokenizers generated offline for the tiny model zoo.

No tokenizer is downloaded: each one is built from a vocabulary made here and handed to the
``transformers`` tokenizer class the real checkpoint uses, so ``save_pretrained`` writes an ordinary
``tokenizer.json`` that ``from_pretrained`` reads back without the hub (and without ``protobuf``).

- CLIP (SD3, FLUX): byte-level BPE laid out like the real CLIP vocabulary: the 256 byte symbols, the
  same symbols with the ``</w>`` end-of-word suffix, a few merges, then ``<|startoftext|>`` and
  ``<|endoftext|>`` as the last two ids (so legacy arg-max pooling would also find the EOS token).
- T5 / UMT5 (SD3, FLUX, Wan): a SentencePiece unigram model trained in memory on a generated corpus.
  Its ``(piece, score)`` list goes straight into ``T5Tokenizer``; the ``spiece.model`` file is never
  written because converting it needs ``protobuf`` in transformers 5.
- Qwen3 (FLUX.2 [klein], Z-Image): the same byte-level BPE with Qwen3's chat special tokens
  (``<think>``/``</think>`` included) and a chat template written here that renders a user turn and
  the generation prompt in Qwen3's layout, honouring ``enable_thinking`` (klein encodes with it off,
  which appends an empty think block; Z-Image with it on).
- Qwen2 (Qwen-Image): byte-level BPE whose merges spell out every word of the Qwen-Image prompt
  template, so the template's system prefix is exactly ``prompt_template_encode_start_idx`` (34)
  tokens long, as with the real Qwen2.5 tokenizer; the chat and vision special tokens follow the base
  vocabulary in the real order.
- Qwen2 with a chat template (HunyuanVideo 1.5): the same construction, with merges for the
  pipeline's own system message, so the chat-formatted prefix the pipeline crops is exactly its
  ``prompt_template_encode_start_idx`` (108) tokens, as with the real tokenizer. The chat template is
  the ChatML layout Qwen2.5 uses for text messages, written here.

Every function here is deterministic: the same call gives the same ``tokenizer.json`` bytes. The
SentencePiece trainer runs on one thread for that reason.
"""

from __future__ import annotations

import functools
import io
import itertools
import random
import re

from transformers import CLIPTokenizer, GemmaTokenizer, Qwen2Tokenizer, T5Tokenizer

__all__ = [
    "QWEN_CHAT_TEMPLATE",
    "QWEN_IMAGE_TEMPLATE_PREFIX",
    "QWEN_SPECIAL_TOKENS",
    "make_clip_tokenizer",
    "make_gemma_tokenizer",
    "make_qwen2_tokenizer",
    "make_qwen3_tokenizer",
    "make_t5_tokenizer",
]

# Words that tiny prompts in tests and examples use; they get BPE merges and shape the T5 corpus.
_PROMPT_WORDS = [
    "a",
    "an",
    "the",
    "of",
    "on",
    "in",
    "at",
    "with",
    "and",
    "to",
    "is",
    "painting",
    "photo",
    "picture",
    "portrait",
    "landscape",
    "cat",
    "dog",
    "squirrel",
    "horse",
    "astronaut",
    "eating",
    "riding",
    "burger",
    "moon",
    "city",
    "night",
    "forest",
    "river",
    "red",
    "green",
    "blue",
    "yellow",
    "black",
    "white",
    "big",
    "small",
    "dance",
    "monkey",
    "cinematic",
    "detailed",
]

#: The part of ``QwenImagePipeline.prompt_template_encode`` that the pipeline drops after encoding.
QWEN_IMAGE_TEMPLATE_PREFIX = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, "
    "text, spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n"
)

#: Qwen2.5-VL's special tokens in their real order (ids 151643.. in the real vocabulary).
QWEN_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)


#: Qwen3's chat special tokens in their real order (after the Qwen2.5 ones, ids 151643..).
QWEN3_SPECIAL_TOKENS = (
    *QWEN_SPECIAL_TOKENS,
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
)

# Renders each message as ``<|im_start|>ROLE\nCONTENT<|im_end|>\n``, then the assistant header, and
# with ``enable_thinking=false`` an empty think block (Qwen3's layout for non-thinking generation).
_QWEN3_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}"
    "{{ '<think>\n\n</think>\n\n' }}"
    "{% endif %}"
    "{% endif %}"
)


@functools.cache
def _byte_symbols() -> tuple[str, ...]:
    """GPT-2 byte-to-unicode table: symbol ``i`` stands for byte ``i`` (printable, no spaces)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    symbols: dict[int, int] = {b: b for b in printable}
    extra = 0
    for b in range(256):
        if b not in symbols:
            symbols[b] = 256 + extra
            extra += 1
    return tuple(chr(symbols[b]) for b in range(256))


def _chain_merges(words: list[list[str]]) -> list[tuple[str, str]]:
    """Merges that build each word left to right (``t h`` -> ``th``, ``th e`` -> ``the``), deduplicated."""
    merges: dict[tuple[str, str], None] = {}
    for symbols in words:
        left = symbols[0]
        for right in symbols[1:]:
            merges.setdefault((left, right), None)
            left += right
    return list(merges)


def _bpe(word: list[str], ranks: dict[tuple[str, str], int]) -> list[str]:
    """``word`` encoded by byte-level BPE with merge ``ranks`` (lowest rank first, leftmost first)."""
    parts = list(word)
    while len(parts) > 1:
        pairs = [(ranks.get(pair), i) for i, pair in enumerate(itertools.pairwise(parts))]
        known = [(r, i) for r, i in pairs if r is not None]
        if not known:
            break
        _, i = min(known)
        parts[i : i + 2] = [parts[i] + parts[i + 1]]
    return parts


def _complete_merges(words: list[list[str]], merges: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """``merges`` plus, appended, what makes every word a single token.

    Chain merges leave runs of one repeated symbol (whitespace runs) in pieces, because BPE applies
    ``(a, a)`` everywhere first. Appended merges rank after all others, so words that were already one
    token are unaffected (and a merge list that needs nothing comes back unchanged).
    """
    out = list(merges)
    ranks = {m: r for r, m in enumerate(out)}
    for word in words:
        parts = _bpe(word, ranks)
        while len(parts) > 1:
            pair = (parts[0], parts[1])
            ranks[pair] = len(out)
            out.append(pair)
            parts = _bpe(word, ranks)
    return out


def make_gemma_tokenizer(model_max_length: int = 1024) -> GemmaTokenizer:
    """Gemma-style BPE (LTX-2's Gemma 3): ``▁`` marks a space, unknown bytes fall back to ``<0xNN>``.

    Ids 0..4 are ``<pad>``, ``<eos>``, ``<bos>``, ``<unk>``, ``<mask>`` as in Gemma's vocabulary, then
    the 256 byte-fallback pieces, ``▁``, printable ASCII, and merges that spell the prompt words.
    """
    vocab: dict[str, int] = {}
    for special in ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>"):
        vocab[special] = len(vocab)
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for symbol in ("\u2581", *(chr(c) for c in range(33, 127))):
        vocab.setdefault(symbol, len(vocab))
    merges = _chain_merges([["\u2581", *w] for w in _PROMPT_WORDS])
    for left, right in merges:
        vocab.setdefault(left + right, len(vocab))
    return GemmaTokenizer(vocab=vocab, merges=merges, model_max_length=model_max_length)


def make_clip_tokenizer(pad_token: str = "<|endoftext|>", model_max_length: int = 77) -> CLIPTokenizer:
    """Byte-level BPE CLIP tokenizer (665 ids). SD3's second CLIP pads with ``"!"`` like CLIP-G."""
    symbols = _byte_symbols()
    vocab: dict[str, int] = {}
    for s in (*symbols, *(s + "</w>" for s in symbols)):
        vocab.setdefault(s, len(vocab))
    words = [[*w[:-1], w[-1] + "</w>"] for w in _PROMPT_WORDS if len(w) > 1]
    merges = _chain_merges(words)
    for left, right in merges:
        vocab.setdefault(left + right, len(vocab))
    for special in ("<|startoftext|>", "<|endoftext|>"):
        vocab[special] = len(vocab)
    return CLIPTokenizer(
        vocab=vocab,
        merges=merges,
        pad_token=pad_token,
        model_max_length=model_max_length,
    )


def _t5_corpus() -> list[str]:
    rng = random.Random(0)
    sentences = [" ".join(rng.choice(_PROMPT_WORDS) for _ in range(8)) for _ in range(2000)]
    # Every printable ASCII character appears, so no prompt maps to <unk> wholesale.
    printable = "".join(chr(c) for c in range(33, 127))
    sentences += [" ".join(printable)] * 20
    return sentences


@functools.cache
def _t5_vocab(vocab_size: int) -> tuple[tuple[str, float], ...]:
    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_t5_corpus()),
        model_writer=model,
        vocab_size=vocab_size,
        model_type="unigram",
        pad_id=0,
        eos_id=1,
        unk_id=2,
        bos_id=-1,
        character_coverage=1.0,
        hard_vocab_limit=False,
        num_threads=1,  # multi-threaded EM can reorder float sums; one thread gives stable scores
        minloglevel=2,
    )
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    vocab = tuple((sp.id_to_piece(i), sp.get_score(i)) for i in range(sp.get_piece_size()))
    if [piece for piece, _ in vocab[:3]] != ["<pad>", "</s>", "<unk>"]:
        raise RuntimeError(f"unexpected SentencePiece special ids: {vocab[:3]}")
    return vocab


def make_t5_tokenizer(vocab_size: int = 256, model_max_length: int = 512) -> T5Tokenizer:
    """T5/UMT5 unigram tokenizer trained in memory; ids 0 ``<pad>``, 1 ``</s>``, 2 ``<unk>``."""
    return T5Tokenizer(vocab=list(_t5_vocab(vocab_size)), extra_ids=0, model_max_length=model_max_length)


#: ChatML for text messages (``<|im_start|>role\ncontent<|im_end|>\n`` per message, then the
#: assistant header when asked), the layout of Qwen2.5's own chat template for plain text.
QWEN_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_qwen2_tokenizer(
    model_max_length: int = 32768,
    *,
    template_prefix: str = QWEN_IMAGE_TEMPLATE_PREFIX,
    chat_template: str | None = None,
) -> Qwen2Tokenizer:
    """Byte-level BPE Qwen2 tokenizer with the Qwen2.5-VL chat/vision special tokens.

    ``template_prefix`` is the text whose every word gets a merge (the prompt template a pipeline
    crops); ``chat_template`` is set on the tokenizer for pipelines that call ``apply_chat_template``.
    """
    symbols = _byte_symbols()
    vocab = {s: i for i, s in enumerate(symbols)}
    words = [w for w in _qwen_pretokens(template_prefix + " " + " ".join(_PROMPT_WORDS)) if len(w) > 1]
    merges = _complete_merges(words, _chain_merges(words))
    for left, right in merges:
        vocab.setdefault(left + right, len(vocab))
    for special in QWEN_SPECIAL_TOKENS:
        vocab[special] = len(vocab)
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        eos_token="<|im_end|>",  # the chat end token, as in Qwen2.5-VL's tokenizer_config
        model_max_length=model_max_length,
    )
    tokenizer.add_special_tokens({"additional_special_tokens": list(QWEN_SPECIAL_TOKENS[1:])})
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


def make_qwen3_tokenizer(model_max_length: int = 131072) -> Qwen2Tokenizer:
    """Byte-level BPE Qwen3 tokenizer (Qwen3 ships ``Qwen2Tokenizer``) with its chat template."""
    symbols = _byte_symbols()
    vocab = {s: i for i, s in enumerate(symbols)}
    words = _qwen_pretokens("user assistant " + " ".join(_PROMPT_WORDS))
    merges = _chain_merges([w for w in words if len(w) > 1])
    for left, right in merges:
        vocab.setdefault(left + right, len(vocab))
    for special in QWEN3_SPECIAL_TOKENS:
        vocab[special] = len(vocab)
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",  # Qwen3 pads with <|endoftext|>
        model_max_length=model_max_length,
    )
    tokenizer.add_special_tokens({"additional_special_tokens": list(QWEN3_SPECIAL_TOKENS[1:])})
    tokenizer.chat_template = _QWEN3_CHAT_TEMPLATE
    return tokenizer


def _qwen_pretokens(text: str) -> list[list[str]]:
    """``text`` split as Qwen2's own pre-tokenizer splits it, special tokens cut out, in byte symbols."""
    pre_tokenizer = Qwen2Tokenizer().backend_tokenizer.pre_tokenizer
    pieces = re.split("|".join(re.escape(t) for t in QWEN_SPECIAL_TOKENS), text)
    return [list(word) for piece in pieces for word, _ in pre_tokenizer.pre_tokenize_str(piece)]
