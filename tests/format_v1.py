"""Buffers in format ``diskreplay/1`` for the tests, made from new ones: diskreplay's own objects
moved from ``diskreplay/objects/`` to the location's root (docs/format.md, section 11)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

OWN = "diskreplay"


def downgrade(path: str | Path) -> None:
    """Rewrite the closed buffer, or sharded buffer, at local ``path`` (and its side stores and
    shards) in format ``diskreplay/1``."""
    root = Path(path)
    for group in sorted(root.rglob("zarr.json")):
        folder = group.parent
        if (folder / OWN / "objects").is_dir() and folder.name != OWN:
            _move_objects(folder)
            _downgrade_attributes(group)


def _move_objects(folder: Path) -> None:
    objects = folder / OWN / "objects"
    for item in objects.iterdir():
        if item.name in ("shard-indexes", "shard-index-tables"):  # newer than the format: diskreplay/1 has none
            shutil.rmtree(item)
        elif item.name != "zarr.json":
            item.rename(folder / item.name)
    shutil.rmtree(folder / OWN)


def _downgrade_attributes(group: Path) -> None:
    document = json.loads(group.read_text())
    attributes = document.get("attributes", {})
    if "diskreplay" in attributes:
        attributes["diskreplay"]["format"] = "diskreplay/1"
    if "diskreplay_shards" in attributes:
        attributes["diskreplay_shards"].pop("format")
    group.write_text(json.dumps(document))
