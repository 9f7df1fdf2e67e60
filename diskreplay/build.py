"""What this install has: which compiled fast paths are active (and why one is not), and the
ImportError that names the extra an optional library comes with.

Each module with a C extension loads it through `load_extension`, which records whether it
imported and, if not, why. A self-check that finds a built extension unfit here (it disagrees with
this numpy, or a library symbol it calls is missing) turns it, or one part of it, off through
`disable`, which records why and warns once. `build_info` reports what was recorded.
"""

from __future__ import annotations

import copy
import importlib
import warnings
from typing import Any

EXTENSIONS = ("diskreplay.format._batch", "diskreplay.sampling._draws", "diskreplay.episodes._search")
"""The optional C extensions (setup.py builds them where a C compiler is found)."""

_STATUS: dict[str, dict[str, Any]] = {}
_WARNED: set[str] = set()


def load_extension(name: str) -> Any:
    """The compiled module ``name`` (one of `EXTENSIONS`), or None where it is not built or its
    import fails; either way recorded for `build_info`. (Any: the callers use its functions.)"""
    try:
        module = importlib.import_module(name)
    except ImportError as error:
        if isinstance(error, ModuleNotFoundError) and error.name == name:
            status, reason = "not built", "no compiled module: no C compiler was found when the package was installed"
        else:
            status, reason = "import error", f"{type(error).__name__}: {error}"
        _STATUS[name] = {"active": False, "status": status, "reason": reason, "path": None, "disabled": {}}
        return None
    _STATUS[name] = {"active": True, "status": "active", "reason": None, "path": module.__file__, "disabled": {}}
    return module


def disable(name: str, why: str, part: str | None = None) -> None:
    """Record that a self-check turned the built extension ``name`` off (or only its function
    ``part``), and why; the first time, warn (RuntimeWarning)."""
    entry = _STATUS[name]
    if part is None:
        entry.update(active=False, status="disabled", reason=why)
    else:
        entry["disabled"][part] = why
    what = name if part is None else f"{name}.{part}"
    if what not in _WARNED:
        _WARNED.add(what)
        warnings.warn(f"{what} is built but disabled: {why}; the slower path without it is used "
                      f"(diskreplay.build_info() lists the fast paths)", RuntimeWarning, stacklevel=2)


def build_info() -> dict[str, dict[str, Any]]:
    """Which compiled fast paths are active in this install, and why one is not.

    Returns one entry per extension of `EXTENSIONS` (``"diskreplay.format._batch"``: checksums and
    LZ4 frames of a batch in one call without the GIL; ``"diskreplay.sampling._draws"``: uniform
    draws and PCG64 states; ``"diskreplay.episodes._search"``: episode bounds and stack windows),
    each a dict:

    * ``"active"``: bool, whether the extension is imported and in use;
    * ``"status"``: ``"active"``, ``"not built"`` (no compiled module: no C compiler at install),
      ``"import error"`` (the compiled module failed to import) or ``"disabled"`` (built, but a
      self-check turned it off);
    * ``"reason"``: None when active, else why not (the import error's text, the failed check);
    * ``"path"``: the compiled module's file, or None where it did not import;
    * ``"disabled"``: ``{function: why}``, the parts of an active extension a self-check turned off.

    Without an extension the same batches come out, more slowly (docs/guide/concepts.md, "Compiled fast paths").
    """
    missing = {"active": False, "status": "not imported", "reason": "the module that loads it was not imported",
               "path": None, "disabled": {}}
    return {name: copy.deepcopy(_STATUS.get(name, missing)) for name in EXTENSIONS}


def missing_extra(module: str, extra: str, needed_by: str) -> ImportError:
    """The ImportError for an optional library ``module`` that is not installed: it names the
    extra that installs it (raise it ``from`` the original error)."""
    return ImportError(f"{needed_by} needs {module}, which is not installed: pip install \"diskreplay[{extra}]\"")


def format_build_info(info: dict[str, dict[str, Any]]) -> str:
    """`build_info` as text, a line per extension and per disabled part (``diskreplay info --build``)."""
    lines = []
    for name, entry in info.items():
        lines.append(f"{name}: active ({entry['path']})" if entry["active"] else f"{name}: {entry['status']}: "
                     f"{entry['reason']}")
        lines += [f"  {part}: disabled: {why}" for part, why in entry["disabled"].items()]
    return "\n".join(lines)
