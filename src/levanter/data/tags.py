"""Tags of validation sources: labels under which evaluation reports averages over several sources.

A source's ``tags`` (``data.configs.<name>.tags``, or ``data.tags`` for a single source) are checked here,
in the data layer, when the config is validated; :mod:`levanter.training.eval` turns them into metric names
(``eval/<tag>/loss``), so a tag must be usable as one and must not collide with a source's name.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

__all__ = ["check_tags"]


def check_tags(tags: Optional[Sequence[str]], key: str, source_names: Sequence[str] = ()) -> Tuple[str, ...]:
    """``tags`` as a tuple, refusing what would make an ambiguous metric name: a tag that is not a
    non-empty string, has an empty ``/`` component, or equals the name of another source (its
    ``eval/<name>/loss`` would then mean two things). ``key`` names the config key in the message."""
    if tags is None:
        return ()
    if isinstance(tags, str):
        raise ValueError(f"{key}: expected a list of tags, got the string {tags!r} (write [{tags}])")
    out = []
    for tag in tags:
        if not isinstance(tag, str) or not tag or any(not part for part in tag.split("/")):
            raise ValueError(
                f"{key}: tag {tag!r} is not a name: tags are non-empty strings, '/' separating non-empty "
                "parts (web/en)"
            )
        if tag in source_names:
            raise ValueError(
                f"{key}: tag {tag!r} is also the name of a source, so eval/{tag}/loss would mean both; "
                "rename the tag or the source"
            )
        if tag not in out:
            out.append(tag)
    return tuple(out)
