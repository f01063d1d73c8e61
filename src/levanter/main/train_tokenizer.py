"""Train a byte-level BPE tokenizer on local text; its output directory is what data.tokenizer takes.

``python -m levanter.main.train_tokenizer --train_urls '["embedded://python-docs/train"]' --output_dir
tokenizers/bpe`` (docs/guides/tokenizers.md). The inputs are read like a cache build's (``train_urls``:
JSON lines, parquet, plain text, globs, braces, compressed files, ``embedded://<corpus>/<split>`` URLs);
the tokenizer is :func:`levanter.ingest.tokenization.train_bpe` (the ``tokenizers`` library: GPT-2 style
pre-tokenisation, the 256 byte symbols so that any text encodes, ``<|endoftext|>`` as EOS). The output
directory holds ``tokenizer.json`` and ``tokenizer_config.json``. The same inputs and settings give a
byte-identical ``tokenizer.json``.

Trade-off: the documents are streamed to the trainer, but ``tokenizers`` keeps the word counts of the
whole input in memory; ``max_documents`` bounds a first try on a large corpus.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import sys
import time
from collections.abc import Iterator
from typing import List, Optional

import levanter.config

__all__ = ["TrainTokenizerConfig", "check", "main", "cli_main", "cli"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class TrainTokenizerConfig:
    """What to learn from, where to write, and the vocabulary size."""

    # Input files (JSON lines, parquet, text; globs and braces) or embedded://<corpus>/<split> URLs.
    train_urls: List[str] = dataclasses.field(default_factory=list)
    # Directory written with tokenizer.json and tokenizer_config.json; give it as data.tokenizer.
    output_dir: str = "tokenizers/bpe"
    # Entries in the vocabulary, counting the 256 byte symbols and the <|endoftext|> token.
    vocab_size: int = 8192
    # Key of the text in JSON-lines, parquet and Arrow records.
    text_key: str = "text"
    # Learn from at most this many documents, in input order; null: all of them.
    max_documents: Optional[int] = None


def _documents(config: TrainTokenizerConfig) -> Iterator[str]:
    from levanter.ingest import EMBEDDED_URL_SCHEME, embedded, sources

    for url in config.train_urls:
        if url.startswith(EMBEDDED_URL_SCHEME):
            sources.check_embedded_url(url)
            name, split = embedded.parse_embedded_url(url)
            for doc in embedded.iter_embedded_documents(name, split):
                yield doc["text"]
            continue
        for path in sources.expand_urls([url]):
            for where, doc in sources.iter_located_documents(path, text_key=config.text_key):
                if not isinstance(doc, str):
                    raise ValueError(
                        f"train_urls: {path}, {where}: the value under text_key={config.text_key!r} is not "
                        f"text ({type(doc).__name__}); a tokenizer learns from text"
                    )
                yield doc


def check(config: TrainTokenizerConfig) -> None:
    """Refuse bad settings before any input is read (one error naming the key)."""
    if not config.train_urls:
        raise ValueError("train_urls: give at least one input file or embedded://<corpus>/<split> URL")
    if isinstance(config.train_urls, str):
        raise ValueError(
            f"train_urls must be a list, got the string {config.train_urls!r}: write [{config.train_urls!r}]"
        )
    if config.max_documents is not None and config.max_documents < 1:
        raise ValueError(f"max_documents must be >= 1 or null, got {config.max_documents}")
    from levanter.ingest import EMBEDDED_URL_SCHEME, sources

    for url in config.train_urls:
        if url.startswith(EMBEDDED_URL_SCHEME):
            sources.check_embedded_url(url)
        else:
            sources.expand_urls([url])  # a missing file or an empty glob fails now, naming it


def main(config: TrainTokenizerConfig) -> str:
    """Train and save the tokenizer; returns the output directory."""
    from levanter.ingest.tokenization import train_bpe

    check(config)
    counted = [0]

    def texts() -> Iterator[str]:
        for doc in itertools.islice(_documents(config), config.max_documents):
            counted[0] += 1
            yield doc

    start = time.perf_counter()
    tok = train_bpe(texts(), config.vocab_size, config.output_dir)
    print(
        f"trained a byte-level BPE of {tok.vocab_size:,} entries on {counted[0]:,} documents in "
        f"{time.perf_counter() - start:.1f}s: {config.output_dir} "
        f"(use it as data.tokenizer: {config.output_dir})"
    )
    return config.output_dir


@levanter.config.main
def cli_main(config: TrainTokenizerConfig):
    return main(config)


def cli(argv=None) -> None:
    """The command-line entry point: bad settings or inputs print one ``error:`` paragraph, exit 2."""
    try:
        cli_main(argv=sys.argv[1:] if argv is None else list(argv))
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("interrupted: no tokenizer was written", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cli()
