"""The package's shape, checked from its source: layers import downward only, without cycles;
third-party libraries stay behind the layer that owns them; modules, classes and functions stay
small (docs/architecture.md)."""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "diskreplay"
LAYERS = {
    "errors": 0, "checks": 0, "build": 0, "progress": 0,
    "format": 1, "io": 1,
    "storage": 2,
    "sampling": 3, "episodes": 3,
    "buffer": 4,
    "torch": 5, "audit": 5, "rollout": 5,
    "offline": 6, "demo": 6,
    "integrations": 7, "ray": 7,
    "cli": 8, "sb3": 8,
    "__init__": 9, "__main__": 9,
}
UPWARD_ALLOWED = {
    # `ReplayBuffer.as_dataset` is the torch layer's front door on the buffer: made at call time,
    # so that `import diskreplay` never loads torch (the torch layer imports the buffer, not back)
    ("diskreplay.buffer.replay_buffer", "diskreplay.torch.data"),
    # `Mixture.as_dataset`, the same front door for a mixture of buffers
    ("diskreplay.buffer.mixture", "diskreplay.torch.mixtures"),
    # `sample(..., format="torch" | "tensordict")`: the converters live in the torch layer, imported when asked for
    ("diskreplay.buffer.output_format", "diskreplay.torch.formats"),
}
OWNERS = {  # a third-party library -> the only places that may import it
    "zarr": ("diskreplay.format", "diskreplay.offline.formats.zarr_group"),
    "fsspec": ("diskreplay.io",),
    "obstore": ("diskreplay.io",),
    "s3fs": ("diskreplay.io",),
    "aiobotocore": ("diskreplay.io.s3fs_session",),
    "botocore": ("diskreplay.io.s3fs_session", "diskreplay.io.s3_gets"),
    # rollout and demo import torch at call time
    "torch": ("diskreplay.torch", "diskreplay.integrations", "diskreplay.rollout", "diskreplay.demo"),
    "safetensors": ("diskreplay.format.state",),
    "torchrl": ("diskreplay.integrations.torchrl",),
    "tensordict": ("diskreplay.torch", "diskreplay.integrations.torchrl"),
    "stable_baselines3": ("diskreplay.integrations.sb3",),
    "gymnasium": ("diskreplay.integrations", "diskreplay.demo"),
    "yaml": ("diskreplay.buffer.spec",),
    "pyarrow": ("diskreplay.offline.formats.parquet", "diskreplay.ray"),
    "ray": ("diskreplay.ray",),
    # PyAV (extra video) and Pillow (extra images), imported at first use; the importers read MP4
    # (LeRobot) and JPEG / PNG (Minari) files with them
    "av": ("diskreplay.format.frame_codecs", "diskreplay.offline.mp4"),
    "PIL": ("diskreplay.format.frame_codecs", "diskreplay.offline.images"),
}
MAX_LINES = {"module": 400, "class": 250, "function": 50}


def modules() -> dict[str, ast.Module]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = ast.parse(path.read_text(), str(path))
    return found


def is_package(name: str) -> bool:
    return (PACKAGE.parent / name.replace(".", "/") / "__init__.py").exists()


def imports(name: str, tree: ast.Module) -> list[tuple[str, bool]]:
    """``(imported module, at module level)`` for every import in ``tree``; relative ones resolved."""
    base = name.split(".") if is_package(name) else name.split(".")[:-1]
    top_level = {id(node) for node in tree.body}
    type_only = {id(n) for node in tree.body if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
                 for n in ast.walk(node)}
    found = []
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.ImportFrom):
            if node.level:
                target = ".".join(base[:len(base) - node.level + 1] + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = [f"{target}.{alias.name}" for alias in node.names]
            resolved = [n for n in names if (PACKAGE.parent / (n.replace(".", "/") + ".py")).exists() or is_package(n)]
            found += [(t, id(node) in top_level) for t in (resolved or [target])]
        elif isinstance(node, ast.Import):
            found += [(alias.name, id(node) in top_level) for alias in node.names]
    return found


def layer(name: str) -> int:
    parts = name.split(".")
    return LAYERS[parts[1] if len(parts) > 1 else "__init__"]


def package_of(name: str) -> str:
    return ".".join(name.split(".")[:2])


ALL = modules()


def test_layers_import_downward_only():
    upward = [f"{name} (layer {layer(name)}) imports {target} (layer {layer(target)})"
              for name, tree in ALL.items() for target, _ in imports(name, tree)
              if target.startswith("diskreplay.") and package_of(target) != package_of(name)
              and layer(target) >= layer(name) and (name, target) not in UPWARD_ALLOWED]
    assert not upward, "\n".join(upward)


def test_no_import_cycles():
    graph = {name: {t for t, top in imports(name, tree) if top and t in ALL and t != name}
             for name, tree in ALL.items()}
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> None:
        if node in path:
            raise AssertionError(f"import cycle: {' -> '.join(path[path.index(node):] + [node])}")
        if node in done:
            return
        for nxt in graph[node]:
            visit(nxt, path + [node])
        done.add(node)

    for name in graph:
        visit(name, [])


@pytest.mark.parametrize("library", sorted(OWNERS))
def test_third_party_libraries_stay_behind_their_layer(library):
    users = {name for name, tree in ALL.items()
             for target, _ in imports(name, tree) if target == library or target.startswith(library + ".")}
    strays = sorted(u for u in users if not u.startswith(OWNERS[library]))
    assert not strays, f"{library} is imported outside {OWNERS[library]}: {strays}"


def code_line_numbers(source: str, tree: ast.Module) -> set[int]:
    """Numbers of the lines that hold code: blank lines, comment lines and docstrings excluded."""
    skip = {tok.start[0] for tok in tokenize.generate_tokens(io.StringIO(source).readline)
            if tok.type == tokenize.COMMENT and tok.line.strip().startswith("#")}
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            skip.update(range(body[0].lineno, body[0].end_lineno + 1))
    return {i for i, line in enumerate(source.splitlines(), 1) if line.strip() and i not in skip}


def test_modules_classes_and_functions_stay_small():
    too_big = []
    for name, tree in ALL.items():
        path = name.replace(".", "/") + ("/__init__.py" if is_package(name) else ".py")
        code = code_line_numbers((PACKAGE.parent / path).read_text(), tree)
        if len(code) > MAX_LINES["module"]:
            too_big.append(f"{name}: module of {len(code)} lines")
        for node in ast.walk(tree):
            kind = ("class" if isinstance(node, ast.ClassDef)
                    else "function" if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else None)
            lines = sum(1 for i in range(node.lineno, node.end_lineno + 1) if i in code) if kind else 0
            if kind and lines > MAX_LINES[kind]:
                too_big.append(f"{name}: {kind} {node.name} of {lines} lines")  # type: ignore[attr-defined]
    assert not too_big, f"at most {MAX_LINES} lines of code: " + "; ".join(too_big)


def private_attributes_set(tree: ast.Module) -> list[str]:
    """Assignments in ``tree`` that set (or set through) a ``_private`` attribute of an object
    other than ``self``, as ``line: target``."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            continue
        for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
            if any(isinstance(a, ast.Attribute) and a.attr.startswith("_")
                   and not (isinstance(a.value, ast.Name) and a.value.id == "self") for a in ast.walk(target)):
                found.append(f"{node.lineno}: {ast.unparse(target)}")
    return found


def test_buffers_and_storages_are_assembled_by_their_factories():
    """A `ReplayBuffer` gets everything from its factory through its constructor (`buffer.parts`),
    a storage through its own (`storage.opening`): nothing in these layers sets another object's
    private attributes after it is made."""
    found = [f"{name}:{where}" for name, tree in ALL.items()
             if name.startswith(("diskreplay.buffer", "diskreplay.storage")) for where in private_attributes_set(tree)]
    assert not found, "private attributes set from outside their object: " + "; ".join(found)
