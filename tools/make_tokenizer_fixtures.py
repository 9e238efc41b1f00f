#!/usr/bin/env python3
"""Reference token ids for tests/tokenizer: HF `tokenizers` (the truth loramux must equal) run over the
real tokenizers in ../shared/data/tokenizers and a corpus built here; writes
tests/tokenizer/fixtures/tokenizer_reference.json. Re-run after changing the corpus:
    /opt/tv/bin/python tools/make_tokenizer_fixtures.py   (needs `pip install tokenizers`)

Random byte strings: HF takes a Python str, so each is decoded with errors='replace' (U+FFFD per maximal
invalid subpart); loramux's encode() is given the raw bytes and must do the same replacement itself.
"""
import copy
import json
import os
import random
import sys

import tokenizers
from tokenizers import Tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "..", "shared", "data")
OUT = os.path.join(ROOT, "tests", "tokenizer", "fixtures", "tokenizer_reference.json")
NAMES = ["gpt-oss", "qwen3", "deepseek-v3"]

HANDWRITTEN = [
    # multilingual prose
    "The quick brown fox jumps over the lazy dog.",
    "Zwölf Boxkämpfer jagen Viktor quer über den großen Sylter Deich.",
    "Portez ce vieux whisky au juge blond qui fume ; l'œuvre d'été coûte 15 €.",
    "¿Dónde está la biblioteca? ¡Qué día tan bonito! Añadir piñata.",
    "Съешь же ещё этих мягких французских булок, да выпей чаю.",
    "Ξεσκεπάζω την ψυχοφθόρα βδελυγμία. Αυτό είναι ελληνικά.",
    "我能吞下玻璃而不伤身体。今天天气很好，我们去公园散步吧！",
    "いろはにほへと ちりぬるを。カタカナとひらがなと漢字が混ざった文です。",
    "키스의 고유조건은 입술끼리 만나야 하고 특별한 기술은 필요치 않다.",
    "نص حكيم له سر قاطع وذو شأن عظيم مكتوب على ثوب أخضر ومغلف بجلد أزرق.",
    "שלום עולם! זהו טקסט בעברית עם ניקוד: שָׁלוֹם.",
    "ऋषियों को सताने वाले दुष्ट राक्षसों के राजा रावण का सर्वनाश करने वाले विष्णुवतार भगवान श्रीराम।",
    "เป็นมนุษย์สุดประเสริฐเลิศคุณค่า กว่าบรรดาฝูงสัตว์เดรัจฉาน",
    "Tiếng Việt có dấu: Chào bạn, hôm nay trời đẹp quá!",
    "Pijamalı hasta yağız şoföre çabucak güvendi. İstanbul'da ılık bir gün.",
    "Mixed: English 中文 العربية हिन्दी ไทย 日本語 한국어 Русский.",
    # emoji: single, skin tones, ZWJ families, flags, keycaps, variation selectors
    "😀😃😄😁 🎉🎊 👍🏽👍🏿 ❤️ ✨",
    "Family: 👨‍👩‍👧‍👦 and 👩‍❤️‍💋‍👨 and 🧑🏽‍🚀 and 🏳️‍🌈 and 🏴‍☠️",
    "Flags: 🇺🇸🇬🇧🇯🇵🇩🇪 keycaps: 1️⃣ #️⃣ *️⃣",
    "emoji🙂inside🙃words and ☕️ with VS16, ☕︎ with VS15",
    # code
    "def fib(n: int) -> int:\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i] * b[i];  // dot\n}\n",
    '{"key": [1, 2.5e-3, null, true], "nested": {"a": "b\\n"}}',
    "<html><body><div class=\"x\">Hello &amp; welcome</div></body></html>",
    "$ grep -rn 'TODO' src/ | awk -F: '{print $1}' | sort | uniq -c",
    "x=>x**2; y := z ?? w; a !== b && c || d; i++; --j; x <<= 3;",
    "SELECT id, name FROM users WHERE age >= 18 ORDER BY name DESC LIMIT 10;",
    "#include <vector>\nstd::vector<std::pair<int,float>> v{{1,2.f}};",
    # whitespace runs
    "a" + " " * 17 + "b",
    "\t\t\tindented\n\n\n\nfour newlines",
    "line one\r\nline two\r\n\r\nline four",
    "   leading and trailing   ",
    " \n \n\t \n   ",
    "x" + " " * 200 + "y",
    "\n" * 50,
    "tab\tseparated\tvalues\t\t\tend",
    "nbsp\u00a0ideographic\u3000space\u2028line\u2029para\u0085nel\u000bvt\u000cff",
    # digits
    "1234567890 12 123 1234 12345 3.14159265358979 1,234,567.89 -42 +7 1e10",
    "Call +1 (555) 123-4567 or 555.987.6543 on 2024-02-29 at 23:59:59.",
    "Arabic-Indic ٠١٢٣٤٥٦٧٨٩ Devanagari ०१२३ fullwidth １２３４５ superscript ²³ fractions ½ ¾",
    "v1.2.3-rc.4+build.567 0x1F 0b1011 0o777 1_000_000",
    # NFC-sensitive inputs (decomposed, compatibility and reordering cases)
    "cafe\u0301 na\u0308ive A\u030angstro\u0308m",
    "\u212b \u2126 \u00c5 \u03a9 ﬁ ﬃ ㎏ Ⅸ",
    "\u1100\u1161\u11a8 \uac00 e\u0323\u0302 e\u0302\u0323 o\u0328\u0304",
    "q\u0307\u0323 \u0041\u0301\u0301 \u0e01\u0e34\u0e4d",
    # apostrophes and contractions (the (?i:'s|...) alternatives)
    "I'm sure you'll say it's what we've done, they'd said; DON'T SHOUT, It'S fine.",
    "rock 'n' roll, ’curly’ quotes, “double”, l’amour, ’tis",
    # punctuation runs
    "!!!??? ... --- === *** ~~~ ___ ^^^ ||| \\\\ /// ((( ))) [[[ ]]] {{{ }}}",
    "Hello, world! How are you? I'm fine: thanks; bye.",
]

# Special-token strings inside text, for every tokenizer's vocabulary (each is plain text to the others).
SPECIALS_IN_TEXT = [
    "<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text<|endoftext|><|endoftext|>",
    "<think>\nreasoning here\n</think>\n\nanswer",
    "<tool_call>{\"name\": \"f\"}</tool_call>",
    "<|start|>assistant<|channel|>final<|message|>Hi!<|end|><|return|>",
    "<｜begin▁of▁sentence｜>You are helpful.<｜User｜>Hi<｜Assistant｜>Hello<｜end▁of▁sentence｜>",
    "almost special: <|im_end| and |im_end|> and <|im_ and <<|im_end|>> and <|im_end|><|im_end|>",
    "  <|im_end|>  spaced  <|endoftext|>  ",
    "<|startoftext|><|reserved_200000|><|constrain|><|call|>",
    "<｜fim▁begin｜>def f():<｜fim▁hole｜>\n<｜fim▁end｜>",
    "word<|im_start|>word<|im_end|>word",
]


def random_lines(rng):
    lines = []
    ranges = [(0x20, 0x7E), (0xA0, 0x24F), (0x370, 0x3FF), (0x400, 0x4FF), (0x590, 0x6FF), (0x900, 0x97F),
              (0xE00, 0xE7F), (0x3040, 0x30FF), (0x4E00, 0x9FA5), (0xAC00, 0xD7A3), (0x1F300, 0x1F6FF),
              (0x2000, 0x206F), (0x300, 0x36F), (0xFF00, 0xFFEF)]
    for _ in range(120):
        n = rng.randint(1, 60)
        chars = []
        for _ in range(n):
            lo, hi = rng.choice(ranges)
            chars.append(chr(rng.randint(lo, hi)))
            if rng.random() < 0.15:
                chars.append(rng.choice([" ", "  ", "\n", "\t", " \n", "'s", "123"]))
        lines.append("".join(chars))
    words = "the of and to in is you that it he was for on are as with his they at be this".split()
    for _ in range(40):
        lines.append(" ".join(rng.choice(words) for _ in range(rng.randint(1, 25))))
    return lines


def random_bytes(rng):
    out = []
    for i in range(80):
        n = rng.randint(1, 40)
        if i % 2 == 0:  # fully random bytes
            b = bytes(rng.randint(0, 255) for _ in range(n))
        else:  # mostly text with cut multi-byte characters and stray continuation bytes
            text = "".join(rng.choice(["a", "é", "中", "😀", " ", "\n", "ü", "ก"]) for _ in range(n)).encode()
            b = bytearray(text)
            for _ in range(rng.randint(1, 3)):
                pos = rng.randrange(len(b))
                if rng.random() < 0.5:
                    del b[pos]
                else:
                    b.insert(pos, rng.choice([0x80, 0xBF, 0xC0, 0xE2, 0xF0, 0xFF, 0xED, 0xF4]))
            b = bytes(b)
        out.append(b)
    return out


def variant_patches(spec):
    """Edits of Qwen3's tokenizer.json (JSON pointer -> new value) that exercise components the three
    real files do not use: every Split behaviour with and without invert, ByteLevel with
    add_prefix_space/use_regex, lstrip/rstrip/single_word/normalized added tokens, TemplateProcessing,
    NFKC/Replace/Prepend normalizers, ignore_merges. The C++ test applies the same edits."""
    added = {t["content"]: i for i, t in enumerate(spec["added_tokens"])}
    split = "/pre_tokenizer/pretokenizers/0"
    patches = {}
    for behavior in ["Removed", "Isolated", "MergedWithPrevious", "MergedWithNext", "Contiguous"]:
        for invert in [False, True]:
            patches[f"split_{behavior}_{invert}"] = {split + "/behavior": behavior, split + "/invert": invert}
    patches["byte_level_regex_prefix"] = {"/pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": True,
                                                             "trim_offsets": True, "use_regex": True}}
    patches["split_then_prefix_space"] = {"/pre_tokenizer/pretokenizers/1/add_prefix_space": True}
    patches["added_strip_single_word"] = {
        f"/added_tokens/{added['<think>']}/lstrip": True, f"/added_tokens/{added['<think>']}/rstrip": True,
        f"/added_tokens/{added['<tool_call>']}/single_word": True,
        f"/added_tokens/{added['</think>']}/normalized": True}
    patches["template_processing"] = {"/post_processor": {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<|im_start|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                   {"SpecialToken": {"id": "<|im_end|>", "type_id": 0}}],
        "pair": [], "special_tokens": {
            "<|im_start|>": {"id": "<|im_start|>", "ids": [151644], "tokens": ["<|im_start|>"]},
            "<|im_end|>": {"id": "<|im_end|>", "ids": [151645], "tokens": ["<|im_end|>"]}}}}
    patches["nfkc_replace_prepend"] = {"/normalizer": {"type": "Sequence", "normalizers": [
        {"type": "NFKC"}, {"type": "Replace", "pattern": {"String": "ab"}, "content": "X"},
        {"type": "Prepend", "prepend": "_"}]}}
    patches["ignore_merges"] = {"/model/ignore_merges": True}
    return patches


def apply_patch(spec, patch):
    spec = copy.deepcopy(spec)
    for pointer, value in patch.items():
        parts = pointer.strip("/").split("/")
        node = spec
        for part in parts[:-1]:
            node = node[int(part)] if isinstance(node, list) else node[part]
        node[int(parts[-1]) if isinstance(node, list) else parts[-1]] = value
    return spec


def main():
    rng = random.Random(1234)
    corpus = HANDWRITTEN + SPECIALS_IN_TEXT + random_lines(rng)
    byte_strings = random_bytes(rng)
    with open(os.path.join(DATA, "sonnet.txt"), encoding="utf-8") as f:
        sonnet = f.read()
    sonnet_lines = sonnet.split("\n")

    result = {
        "generator": f"tools/make_tokenizer_fixtures.py, tokenizers {tokenizers.__version__}",
        "corpus": corpus,
        "random_bytes_hex": [b.hex() for b in byte_strings],
        "tokenizers": {},
    }
    for name in NAMES:
        tok = Tokenizer.from_file(os.path.join(DATA, "tokenizers", name, "tokenizer.json"))
        ids = lambda s, special=False: tok.encode(s, add_special_tokens=special).ids
        ref = {
            "sonnet": ids(sonnet),
            "sonnet_lines": [ids(line) for line in sonnet_lines],
            "corpus": [ids(s) for s in corpus],
            "corpus_special": [ids(s, True) for s in corpus[:20]],
            "random_bytes": [ids(b.decode("utf-8", errors="replace")) for b in byte_strings],
        }
        # decode(encode(s)) where it is not s (lossy), with specials kept; and with them skipped where
        # that differs from keeping them. None means "equals the input" / "equals the kept version".
        ref["corpus_decode"] = [None if tok.decode(i, skip_special_tokens=False) == s
                                else tok.decode(i, skip_special_tokens=False)
                                for s, i in zip(corpus, ref["corpus"])]
        ref["corpus_decode_skip"] = [None if tok.decode(i, skip_special_tokens=True) ==
                                     tok.decode(i, skip_special_tokens=False)
                                     else tok.decode(i, skip_special_tokens=True) for i in ref["corpus"]]
        # Arbitrary id sequences (split characters, added tokens between partial bytes, unknown ids).
        vocab_size = tok.get_vocab_size(with_added_tokens=True)
        added = sorted(tok.get_added_tokens_decoder().keys())
        seqs = []
        for _ in range(100):
            seq = []
            for _ in range(rng.randint(1, 30)):
                r = rng.random()
                seq.append(rng.choice(added) if r < 0.1 else rng.randrange(256) if r < 0.5
                           else rng.randrange(vocab_size))
            seqs.append(seq)
        ref["decode_ids"] = seqs
        ref["decode_keep"] = [tok.decode(s, skip_special_tokens=False) for s in seqs]
        ref["decode_skip"] = [tok.decode(s, skip_special_tokens=True) for s in seqs]
        result["tokenizers"][name] = ref
        print(f"{name}: sonnet {len(ref['sonnet'])} tokens, corpus {sum(map(len, ref['corpus']))} tokens",
              file=sys.stderr)

    # Variants of Qwen3's tokenizer.json over part of the corpus plus added-token edge cases.
    qwen_path = os.path.join(DATA, "tokenizers", "qwen3", "tokenizer.json")
    with open(qwen_path, encoding="utf-8") as f:
        qwen = json.load(f)
    variant_texts = corpus[:80] + SPECIALS_IN_TEXT + [
        "  <think> x</think>y <tool_call>  a<tool_call>b", "word<think>word <think> <think>", " a  b   c", "ab abab"]
    result["variant_texts"] = variant_texts
    result["variants"] = {}
    for name, patch in variant_patches(qwen).items():
        tok = Tokenizer.from_str(json.dumps(apply_patch(qwen, patch)))
        result["variants"][name] = {"patch": patch,
                                    "ids": [tok.encode(s, add_special_tokens=True).ids for s in variant_texts]}

    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w", encoding="utf-8") as f:
        json.dump(result, f, ensure_ascii=False, separators=(",", ":"))
    print(f"wrote {OUT} ({os.path.getsize(OUT)} bytes), corpus {len(corpus)} lines, "
          f"{len(byte_strings)} byte strings", file=sys.stderr)


if __name__ == "__main__":
    main()
