"""A chat tokenizer and chat JSON lines made on the spot (no network), for the chat-format and SFT tests.

:func:`chat_tokenizer` trains a small byte-level BPE (:func:`levanter.ingest.train_bpe`) and writes a chat
template into its ``tokenizer_config.json``: each message is ``<|role|>`` then its content and ``<|end|>``,
the assistant's content and end marker inside ``{% generation %}``; the markers are special tokens of the
tokenizer (as real chat tokenizers have them), so no token straddles a message boundary. :func:`write_chats` writes conversations
whose assistant reply is a fixed function of the user's message (so a model can learn it).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|end|>{% endgeneration %}"
    "{% else %}{{ m['content'] }}<|end|>{% endif %}{% endfor %}"
)
WORDS = ["red", "green", "blue", "cat", "dog", "sun", "moon", "tree", "rock", "fish"]


def chat_tokenizer(directory: Path, template: str | None = TEMPLATE) -> Path:
    """A tokenizer directory (``tokenizer.json`` + ``tokenizer_config.json`` with ``template``)."""
    from levanter.ingest import train_bpe

    texts = [f"<|user|>{a} {b}<|end|><|assistant|>{b} {a} ok<|end|>" for a in WORDS for b in WORDS] * 4
    train_bpe(texts, 320, str(directory))
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    tok.add_special_tokens(["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"])
    tok.save(str(directory / "tokenizer.json"))
    cfg_path = directory / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    if template is not None:
        cfg["chat_template"] = template
    cfg_path.write_text(json.dumps(cfg))
    return directory


def conversation(rng: random.Random) -> list:
    a, b = rng.choice(WORDS), rng.choice(WORDS)
    msgs = []
    if rng.random() < 0.3:
        msgs.append({"role": "system", "content": "be brief"})
    msgs += [{"role": "user", "content": f"{a} {b}"}, {"role": "assistant", "content": f"{b} {a} ok"}]
    if rng.random() < 0.5:  # a second turn
        c = rng.choice(WORDS)
        msgs += [{"role": "user", "content": f"{c} {c}"}, {"role": "assistant", "content": f"{c} {c} ok"}]
    return msgs


def write_chats(path: Path, n: int, seed: int = 0, *, with_text: bool = False) -> list:
    """``n`` conversations as JSON lines under ``messages`` (and, with ``with_text``, a ``text`` field too);
    returns them."""
    rng = random.Random(seed)
    chats = [conversation(rng) for _ in range(n)]
    with open(path, "w") as f:
        for c in chats:
            rec = {"messages": c}
            if with_text:
                rec["text"] = " ".join(m["content"] for m in c)
            f.write(json.dumps(rec) + "\n")
    return chats
