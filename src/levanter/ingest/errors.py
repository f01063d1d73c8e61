"""Errors about input data, in a module light enough for tokenizer worker processes to import."""

__all__ = ["SourceError"]


class SourceError(ValueError):
    """Bad input data: names the file (and line or document) at fault."""
