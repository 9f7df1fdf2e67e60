"""The package as installed: every third-party library it imports is declared (pyproject.toml), the
core works without torch (an extra), and `dr.build_info` says which compiled fast paths are active."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest
from test_architecture import ALL, imports

import diskreplay as dr
from diskreplay import build
from diskreplay.cli import BENCH_EXTRA

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
DISTRIBUTIONS = {"google_crc32c": "google-crc32c", "yaml": "pyyaml", "PIL": "pillow", "stable_baselines3":
                 "stable-baselines3", "sklearn": "scikit-learn"}
"""Import names whose distribution is named otherwise."""


def names(requirements: list[str]) -> set[str]:
    return {re.match(r"[A-Za-z0-9._-]+", r).group(0).lower().replace("_", "-") for r in requirements}


CORE = names(PROJECT["dependencies"])
EXTRAS = {extra: names(reqs) for extra, reqs in PROJECT["optional-dependencies"].items()}


def distribution(module: str) -> str:
    return DISTRIBUTIONS.get(module, module).lower().replace("_", "-")


def third_party_imports() -> dict[str, set[str]]:
    """Top-level third-party module -> the package's modules that import it (anywhere in them)."""
    found: dict[str, set[str]] = {}
    for name, tree in ALL.items():
        for target, _ in imports(name, tree):
            top = target.split(".")[0]
            if top != "diskreplay" and top not in sys.stdlib_module_names and top != "__future__":
                found.setdefault(top, set()).add(name)
    for module in BENCH_EXTRA:  # `diskreplay bench` looks these up by name
        found.setdefault(module, set()).add("diskreplay.cli")
    return found


def test_every_imported_library_is_declared_in_the_core_or_an_extra():
    users = {"numpy", "zarr", "google_crc32c", "torch", "yaml", "stable_baselines3", "psutil", "cpprb"}
    assert users <= set(third_party_imports())  # the parse finds module-level, lazy and by-name imports
    user_extras = set().union(*(reqs for extra, reqs in EXTRAS.items() if extra != "test"))
    undeclared = sorted(f"{module} (imported by {sorted(by)})" for module, by in third_party_imports().items()
                        if distribution(module) not in CORE | user_extras)
    assert not undeclared, f"imported but not declared in pyproject.toml: {undeclared}"


def test_what_import_diskreplay_imports_is_a_core_dependency():
    loaded = set(subprocess.run([sys.executable, "-c", "import sys, diskreplay; print(' '.join(sys.modules))"],
                                capture_output=True, text=True, check=True).stdout.split())
    direct = sorted({target.split(".")[0] for name, tree in ALL.items() if name in loaded
                     for target, top in imports(name, tree) if top} - set(sys.stdlib_module_names) - {"diskreplay"})
    assert direct == ["fsspec", "google_crc32c", "lz4", "numcodecs", "numpy", "safetensors", "zarr", "zstandard"]
    assert [m for m in direct if distribution(m) not in CORE] == []


def test_torch_is_an_extra_that_the_test_extra_includes():
    assert "torch" not in CORE
    assert EXTRAS["torch"] == {"torch"}
    assert {"torch", "pytest"} <= EXTRAS["test"]


NO_TORCH = """
import sys

class NoTorch:  # as if torch were not installed
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, NoTorch())
"""


def run_without_torch(code: str) -> str:
    script = NO_TORCH + textwrap.dedent(code)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_the_core_works_without_torch(tmp_path):
    out = run_without_torch(f"""
        import numpy as np
        import diskreplay as dr

        url, dest = {str(tmp_path / "b")!r}, {str(tmp_path / "b.npz")!r}
        fields = {{"obs": dr.Field((3,), "float32"), "action": dr.Field((), "int64"), "done": dr.Field((), "bool")}}
        with dr.ReplayBuffer.create(url, fields, capacity=100, chunk_rows=16) as buf:
            t = np.arange(40)
            buf.extend({{"obs": np.ones((40, 3), np.float32), "action": t, "done": t % 10 == 9}})
            print(len(buf.sample(8, rng=np.random.default_rng(0))["index"]))
        with dr.ReplayBuffer.open(url) as buf:
            print(len(buf), buf[[3, 39]]["action"].tolist())
        print(dr.offline.verify(url).ok)
        print(dr.export_buffer(url, dest, progress=False), sorted(np.load(dest)))
        print("torch" in sys.modules)
    """)
    assert out.splitlines() == ["8", "40 [3, 39]", "True", "40 ['actions', 'done', 'observations']", "False"]


def test_the_torch_layer_without_torch_names_the_extra(tmp_path):
    out = run_without_torch(f"""
        import numpy as np
        import diskreplay as dr

        buf = dr.ReplayBuffer.create({str(tmp_path / "b")!r}, {{"x": dr.Field((), "int64")}}, capacity=10)
        buf.extend({{"x": np.arange(5)}})
        rollout = dr.RolloutBuffer({{k: dr.Field((), "float32") for k in ("reward", "value", "log_prob", "done")}}, 2)
        for attempt in (lambda: buf.as_dataset(batch_size=2), lambda: dr.RowDataset, lambda: dr.to_device,
                        lambda: buf.sample(2, format="torch"), lambda: buf.rows([0, 1], format="torch"),
                        lambda: next(rollout.minibatches(1))):
            try:
                attempt()
            except ImportError as error:
                print(error)
    """)
    install = 'needs torch, which is not installed: pip install "diskreplay[torch]"'
    layer = f"diskreplay's torch layer (as_dataset, format='torch', RowDataset, Loader, to_device) {install}"
    assert out.splitlines() == [layer] * 5 + [f"RolloutBuffer.minibatches {install}"]


def test_build_info_says_each_extension_is_active_here():
    info = dr.build_info()
    assert list(info) == list(build.EXTENSIONS) == [
        "diskreplay.format._batch", "diskreplay.sampling._draws", "diskreplay.episodes._search"]
    for name, entry in info.items():
        if entry["status"] == "not built":  # an install without a C compiler
            continue
        folder = ROOT.joinpath(*name.split(".")[:-1])
        assert entry["path"].startswith(str(folder / name.split(".")[-1]))
        assert entry == {"active": True, "status": "active", "reason": None, "path": entry["path"], "disabled": {}}
    info["diskreplay.format._batch"]["disabled"]["x"] = "changed"  # a copy: the record stays
    assert dr.build_info()["diskreplay.format._batch"]["disabled"] == {}


def run_with(prelude: str, code: str = "print(json.dumps(dr.build_info()))") -> tuple[dict, str]:
    """``code`` after ``prelude`` (which runs before ``import diskreplay``); its JSON and stderr."""
    script = textwrap.dedent(prelude) + "\nimport json, sys, warnings\nimport numpy as np\n" \
        "warnings.simplefilter('always')\nimport diskreplay as dr\n" + textwrap.dedent(code)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout), done.stderr


def test_build_info_says_why_an_extension_is_not_active():
    info, stderr = run_with("""
        import sys

        class Broken:
            def find_spec(self, name, path=None, target=None):
                if name == "diskreplay.format._batch":
                    raise ImportError("_batch.so: undefined symbol: LZ4_decompress_safe")
                return None

        sys.meta_path.insert(0, Broken())
        sys.modules["diskreplay.episodes._search"] = None  # as if setup.py had found no C compiler
    """)
    assert info["diskreplay.format._batch"] == {
        "active": False, "status": "import error", "reason": "ImportError: _batch.so: undefined symbol: "
        "LZ4_decompress_safe", "path": None, "disabled": {}}
    assert info["diskreplay.episodes._search"] == {
        "active": False, "status": "not built", "path": None, "disabled": {},
        "reason": "no compiled module: no C compiler was found when the package was installed"}
    assert info["diskreplay.sampling._draws"]["active"] is True
    assert "warning" not in stderr.lower()  # not built is no surprise: nothing warns


DRAWS = sorted((ROOT / "diskreplay" / "sampling").glob("_draws*.so"))
FAKE_DRAWS = """
    import importlib.util, sys, types

    spec = importlib.util.spec_from_file_location("_draws", {path!r})
    real = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(real)
    fake = types.ModuleType("diskreplay.sampling._draws")
    fake.__file__ = {path!r}
    fake.integers = {integers}

    def set_pcg64(capsules, words):
        raise NotImplementedError

    fake.set_pcg64 = set_pcg64
    sys.modules["diskreplay.sampling._draws"] = fake
"""


@pytest.mark.skipif(not DRAWS, reason="the _draws extension is not built here")
def test_a_guard_that_disables_an_extension_warns_once_and_build_info_says_why():
    wrong = "lambda capsule, low, span, out: out.fill(low)"  # draws that are not numpy's
    info, stderr = run_with(FAKE_DRAWS.format(path=str(DRAWS[0]), integers=wrong), """
        from diskreplay import build
        from diskreplay.sampling import draws

        build.disable("diskreplay.sampling._draws", "again")  # warned already: not twice
        print(json.dumps(dr.build_info()))
        print(draws.integers(np.random.default_rng(0), 0, 10, 5).tolist() == np.random.default_rng(0).integers(0, 10, 5)
              .tolist(), file=sys.stderr)
    """)
    entry = info["diskreplay.sampling._draws"]
    assert entry == {"active": False, "status": "disabled", "reason": "again", "path": str(DRAWS[0]), "disabled": {}}
    warned = [line for line in stderr.splitlines() if "RuntimeWarning" in line]
    assert len(warned) == 1 and re.search(
        r"RuntimeWarning: diskreplay\.sampling\._draws is built but disabled: its uniform draws differ from numpy "
        r"\S+'s Generator\.integers; the slower path without it is used \(diskreplay\.build_info\(\) lists the fast "
        r"paths\)", warned[0])
    assert stderr.splitlines()[-1] == "True"  # numpy's draws instead


@pytest.mark.skipif(not DRAWS, reason="the _draws extension is not built here")
def test_a_guard_that_disables_one_function_of_an_extension_warns_once():
    info, stderr = run_with(FAKE_DRAWS.format(path=str(DRAWS[0]), integers="real.integers"))
    entry = info["diskreplay.sampling._draws"]
    assert entry["active"] is True and entry["status"] == "active"
    assert list(entry["disabled"]) == ["set_pcg64"]
    assert re.fullmatch(r"it does not set PCG64 states as numpy \S+ does", entry["disabled"]["set_pcg64"])
    warned = [line for line in stderr.splitlines() if "RuntimeWarning" in line]
    assert len(warned) == 1 and "diskreplay.sampling._draws.set_pcg64 is built but disabled: it does not" in warned[0]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "diskreplay", *args], capture_output=True, text=True)


def test_info_build_prints_the_fast_paths():
    done = run_cli("info", "--build")
    assert done.returncode == 0, done.stderr
    assert done.stdout == build.format_build_info(dr.build_info()) + "\n"
    assert [line.split(":")[0] for line in done.stdout.splitlines()] == list(build.EXTENSIONS)
    as_json = run_cli("info", "--build", "--json")
    assert json.loads(as_json.stdout) == dr.build_info()


def test_format_build_info_says_why_and_which_parts_are_off():
    info = {"a._x": {"active": True, "status": "active", "reason": None, "path": "/p/_x.so",
                     "disabled": {"f": "it disagrees"}},
            "a._y": {"active": False, "status": "not built", "reason": "no compiled module", "path": None,
                     "disabled": {}}}
    assert build.format_build_info(info) == ("a._x: active (/p/_x.so)\n  f: disabled: it disagrees\n"
                                             "a._y: not built: no compiled module")


def test_info_without_a_url_or_build_is_an_error():
    done = run_cli("info")
    assert (done.returncode, done.stdout, done.stderr) == (
        1, "", "diskreplay: error: info needs the URL of a buffer (or --build)\n")
