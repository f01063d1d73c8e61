"""Small helpers shared by several test modules (not a test module itself)."""

import os


def tree_bytes(directory):
    """``{relative path: bytes}`` of every file under ``directory`` -- for byte-for-byte comparisons."""
    out = {}
    for root, _, files in os.walk(directory):
        for f in files:
            p = os.path.join(root, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, directory)] = fh.read()
    return out
