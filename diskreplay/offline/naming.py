"""Field names in files: the one D4RL convention that importing and exporting share.

A column of a file (HDF5 path, ``.npz`` member or ``.npy`` file name, without suffix) is
imported as the field `d4rl_field_name` gives; a field is exported under `d4rl_name`, its
inverse for the names diskreplay writes, so exporting then importing keeps field names.
"""

from __future__ import annotations

import re

from ..format.schema import RESERVED_NAMES

D4RL_NAMES = {"observations": "obs", "actions": "action", "rewards": "reward", "terminals": "terminated",
              "timeouts": "truncated", "next_observations": "next_obs"}
D4RL_FLAGS = ("terminals", "timeouts")  # D4RL columns stored as bool (often float in the files)
END_FIELDS = tuple(D4RL_NAMES[k] for k in D4RL_FLAGS)  # fields whose set value ends an episode
EXPORT_NAMES = {field: d4rl for d4rl, field in D4RL_NAMES.items()}
EXPORT_ATTR = "diskreplay_export"  # HDF5 file attribute and zip comment set by `diskreplay export`


def field_name(path: str) -> str:
    """A valid, non-reserved field name from an HDF5 path or file name (``group/key`` -> ``group_key``)."""
    name = re.sub(r"\W", "_", path.strip("/").replace("/", "_")) or "field"
    if name[0].isdigit():
        name = f"f_{name}"
    return f"{name}_" if name in RESERVED_NAMES else name


def d4rl_field_name(column: str) -> str:
    """The field a column named ``column`` (HDF5 path, ``.npz`` member or ``.npy`` file name,
    without suffix) is imported as: D4RL names mapped (``observations`` -> ``obs``, ``actions``
    -> ``action``, ``rewards`` -> ``reward``, ``terminals`` -> ``terminated``, ``timeouts`` ->
    ``truncated``, ``next_observations`` -> ``next_obs``, ``infos/<key>`` -> ``info_<key>``),
    any other name made a valid field name by `field_name`."""
    if column in D4RL_NAMES:
        return D4RL_NAMES[column]
    if column.startswith("infos/"):
        return "info_" + field_name(column[len("infos/"):])
    return field_name(column)


def d4rl_name(field: str) -> str:
    """The name field ``field`` is exported under, in either format (the inverse of `d4rl_field_name`)."""
    if field in EXPORT_NAMES:
        return EXPORT_NAMES[field]
    if field.startswith("info_"):
        return "infos/" + field[len("info_"):]
    return field
