"""Every fenced code block of README.md and of the documentation (``docs/**/*.md``) runs here, so
the docs cannot rot; and the site builds with ``mkdocs build --strict``.

Blocks are grouped by file and ``## `` section; each group runs in a fresh temporary working
directory, where the snippets' relative paths (``runs/a/buffer``, ``hopper.hdf5``) land.

- ``python`` blocks of a group run in order in one namespace. A line ``print(...)  # -> text``
  shows the output: the block must print exactly those texts, in order, and nothing else.
- ``bash`` blocks: each ``diskreplay ...`` line runs (``python -m diskreplay``) and must exit 0; a
  ``python tools/NAME.py ...`` line is a benchmark or report (minutes, large files): not run, and
  ``tools/NAME.py`` must exist; every other line must be listed in `SKIPPED`, exactly as
  documented, with why it is not run.
- A block whose whole body is a ``--8<-- "path"`` snippet line is "included": the site shows the
  file at ``path``, which must exist and be named by a test under ``tests/`` (that test runs it).
- A block preceded by ``<!-- not run: reason -->`` is not run. Language-less, ``text`` and ``json``
  blocks of the internals pages (`SPECIFICATION`) are layout listings and records, not code. Any
  other block that is not run (an unknown language, an unlisted command, an unlisted output
  block) fails `test_every_block_runs_or_says_why`.

What the test supplies that the docs leave to the reader: `INPUTS`, the files the commands read (a
small stand-in for D4RL's ``hopper-medium-v2.hdf5``), `SETUPS`, the names a page's blocks take as
given (docs/format.md's ``url`` of a buffer), and `S3_ENDPOINT`, replaced by a local moto S3
server's address (the only text substitution).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import io
import os
import re
import shlex
import subprocess
import sys
import textwrap
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from s3server import s3

import diskreplay as dr

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").rglob("*.md"))]

SKIPPED = {  # command lines (comments cut) not run, and why
    'pip install "diskreplay[torch]"': "installs: downloads diskreplay and torch",
    'python3 -m venv .venv && . .venv/bin/activate && python -m pip install "torch==2.13.0" -e ".[test]" '
    '&& diskreplay demo': "installs: makes a virtualenv and downloads torch",
    "python -m pytest -q -n auto": "the whole test suite, which runs this file",
    "python -m ruff check diskreplay tests tools examples && python -m mypy": "lint and types: .ci/run runs them",
    "diskreplay demo": "about 10 s; tests/test_cli.py::test_demo_runs_and_resumes runs it with small sizes",
    "diskreplay bench --quick": "runs every benchmark in tools/ (minutes)",
    'python -m venv .bench && . .bench/bin/activate && python -m pip install "torch==2.14.1" "torchvision==0.29.1" '
    '-e ".[s3,torch]" "mosaicml-streaming==0.13.0" "datasets==5.0.1" pylance "moto[server]" pytest':
    "installs: a separate virtualenv for the S3 benchmark's further peers (5 GB of CUDA torch)",
}
TOOL = re.compile(r"(?:[A-Z_]+=\S+ )*python (tools/\w+\.py)(?: .*)?")  # a benchmark or report
OUTPUT_BLOCKS = {  # language-less blocks under these headings are printed output, not code
    "DataLoader throughput": "the target lines tools/bench_loader.py printed",
}
SPECIFICATION = {"docs/format.md", "docs/design.md", "docs/architecture.md"}
SNIPPET = re.compile(r'--8<-- "([^"]+)"')
S3_ENDPOINT = "http://127.0.0.1:9000"


def make_d4rl_file(path: Path) -> None:
    """A 1,000-step stand-in for hopper-medium-v2.hdf5 in the D4RL layout: 4 episodes of 250 steps."""
    import h5py

    rng = np.random.default_rng(0)
    with h5py.File(path, "w") as f:
        f["observations"] = rng.standard_normal((1000, 11)).astype(np.float32)
        f["actions"] = rng.uniform(-1, 1, (1000, 3)).astype(np.float32)
        f["rewards"] = rng.random(1000).astype(np.float32)
        f["terminals"] = np.arange(1000) % 250 == 249
        f["timeouts"] = np.zeros(1000, bool)


INPUTS = {"hopper-medium-v2.hdf5": make_d4rl_file}


def wrapped_ring(namespace: dict) -> None:
    """docs/format.md's ``url``: a 3-lane compressed ring that wrapped; the reader's rows are checked after."""
    fields = {"obs": dr.Field((17,), "float32"), "done": dr.Field((), "bool")}
    with dr.ReplayBuffer.create("runs/ring", fields, capacity=48, num_envs=3, chunk_rows=4, compression="zstd") as buf:
        steps = np.arange(40, dtype=np.float32)
        buf.extend({"obs": np.repeat(steps[:, None, None], 3, 1) * np.ones(17, np.float32) + np.arange(3)[:, None],
                    "done": np.zeros((40, 3), bool)})
    namespace["url"] = "runs/ring"


def check_wrapped_ring(namespace: dict) -> None:
    with dr.ReplayBuffer.open(namespace["url"]) as buf:  # the last lane's rows, read as the page says
        np.testing.assert_array_equal(namespace["obs"], buf[namespace["ids"]]["obs"])
        assert len(namespace["ids"]) == 16


SETUPS: dict[str, tuple[Callable[[dict], None], Callable[[dict], None]]] = {
    "docs/format.md": (wrapped_ring, check_wrapped_ring),
}


@dataclasses.dataclass
class Block:
    file: str  # relative to the repository root
    lang: str
    code: str
    line: int  # line of the opening fence
    section: str  # the "## " heading above it
    heading: str  # the nearest heading above it
    not_run: str | None  # the reason of a `<!-- not run: ... -->` comment just before it

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line} ({self.heading})"


def parse(text: str, file: str) -> list[Block]:
    blocks, section, heading, previous, fence, body = [], "", "", "", None, []
    for number, line in enumerate(text.splitlines(), 1):
        if fence is not None:
            if line.strip() == "```":
                lang, start, marker = fence
                blocks.append(Block(file, lang, textwrap.dedent("\n".join(body)), start, section, heading, marker))
                fence, body = None, []
            else:
                body.append(line)
            continue
        if match := re.match(r"\s*```(\S*)\s*$", line):
            marker = re.fullmatch(r"\s*<!--\s*not run:(.*)-->\s*", previous)
            fence = (match.group(1), number, marker.group(1).strip() if marker else None)
        elif match := re.match(r"(#+) (.*)", line):
            heading = match.group(2).strip()
            section = heading if match.group(1) == "##" else section
        if line.strip():
            previous = line
    return blocks


def command(line: str) -> str:
    """A shell line without its comment."""
    return re.sub(r"(^|\s)#\s.*$", "", line).strip()


@functools.cache
def text_of_tests() -> str:
    """Every test file but this one: where an included file must be named."""
    return "\n".join(p.read_text() for p in sorted((ROOT / "tests").rglob("*.py")) if p.name != "test_docs.py")


def included(block: Block) -> str:
    """The fate of a ``--8<-- "path"`` block: "included", or what is wrong with it."""
    match = SNIPPET.fullmatch(block.code.strip())
    assert match is not None
    path = match.group(1)
    if not (ROOT / path).is_file():
        return f"{block.where}: --8<-- {path!r} names no file"
    text = text_of_tests()
    if path not in text and Path(path).name not in text:
        return f"{block.where}: {path} is included but no test under tests/ names it"
    return "included"


def fate(block: Block) -> str:
    """What happens to ``block``: "run", "skipped" (every line in SKIPPED or a tools/ script),
    "output", "specification", "included", "not run" (marked), or why it would go unrun unnoticed."""
    if block.not_run is not None:
        return "not run" if block.not_run else f"{block.where}: a not-run mark needs a reason"
    if SNIPPET.fullmatch(block.code.strip()):
        return included(block)
    if block.lang == "python":
        return "run"
    if block.lang == "bash":
        lines = [command(line) for line in block.code.splitlines() if command(line)]
        for line in lines:
            if (tool := TOOL.fullmatch(line)) and not (ROOT / tool.group(1)).is_file():
                return f"{block.where}: {tool.group(1)} does not exist"
        kept = [c for c in lines if c not in SKIPPED and not TOOL.fullmatch(c)]
        unlisted = [c for c in kept if not c.startswith("diskreplay ")]
        if unlisted:
            return f"{block.where}: {unlisted[0]!r} is neither a diskreplay command nor in SKIPPED"
        return "run" if kept else "skipped"
    if block.lang in ("", "text", "json") and block.file in SPECIFICATION:
        return "specification"
    if block.lang == "" and any(block.heading.startswith(h) for h in OUTPUT_BLOCKS):
        return "output"
    return f"{block.where}: a {block.lang or 'language-less'} block that is not run; mark it <!-- not run: why -->"


BLOCKS = [block for path in DOCS for block in parse(path.read_text(), path.relative_to(ROOT).as_posix())]
GROUPS = list(dict.fromkeys((b.file, b.section) for b in BLOCKS if fate(b) == "run"))


def group_id(group: tuple[str, str]) -> str:
    file, section = group
    return re.sub(r"\W+", "-", f"{Path(file).stem} {section.split(':')[0]}").strip("-").lower()


def run_python(block: Block, namespace: dict) -> None:
    expected = re.findall(r"^\s*print\(.*#\s*->\s?(.*?)\s*$", block.code, re.MULTILINE)
    out = io.StringIO()
    code = compile("\n" * block.line + block.code, str(ROOT / block.file), "exec")  # tracebacks name the doc's lines
    with contextlib.redirect_stdout(out):
        exec(code, namespace)
    assert out.getvalue().splitlines() == expected, f"{block.file}:{block.line}: output differs from the docs"


def run_commands(block: Block, cwd: Path) -> None:
    for line in block.code.splitlines():
        if command(line) and command(line) not in SKIPPED and not TOOL.fullmatch(command(line)):
            argv = shlex.split(command(line))
            proc = subprocess.run([sys.executable, "-m", "diskreplay", *argv[1:]], cwd=cwd, check=False,
                                  capture_output=True, text=True, timeout=300)
            assert proc.returncode == 0, f"{block.file}:{block.line}: {line!r} failed:\n{proc.stdout}{proc.stderr}"


@pytest.mark.parametrize("group", GROUPS, ids=group_id)
def test_section(group, tmp_path, monkeypatch, request):
    monkeypatch.chdir(tmp_path)
    blocks = [b for b in BLOCKS if (b.file, b.section) == group and fate(b) == "run"]
    text = "\n".join(b.code for b in blocks)
    for name, make in INPUTS.items():
        if name in text:
            make(tmp_path / name)
    namespace: dict = {"__name__": "__docs__"}
    setup, check = SETUPS.get(group[0], (None, None))
    try:
        if setup:
            setup(namespace)
        for block in blocks:
            if S3_ENDPOINT in block.code:
                moto = request.getfixturevalue("s3")
                moto.client().create_bucket(Bucket="bucket")
                block = dataclasses.replace(block, code=block.code.replace(S3_ENDPOINT, moto.endpoint))
            if block.lang == "python":
                run_python(block, namespace)
            else:
                run_commands(block, tmp_path)
        if check:
            check(namespace)
    finally:
        for value in list(namespace.values()):
            if isinstance(value, (dr.ReplayBuffer, dr.RolloutBuffer)):
                value.close()
        namespace.clear()
        gc.collect()  # DataLoader workers end with their loader


def test_every_block_runs_or_says_why():
    fates = Counter(fate(block) for block in BLOCKS)
    unnoticed = [f for f in fates if f not in ("run", "skipped", "output", "specification", "included", "not run")]
    assert unnoticed == [], f"blocks: {dict(fates)}"
    documented = {command(line) for b in BLOCKS if b.lang == "bash" for line in b.code.splitlines()}
    assert set(SKIPPED) <= documented, f"SKIPPED names commands the docs lack: {set(SKIPPED) - documented}"
    assert {file for file, _ in GROUPS} >= {"README.md", "docs/index.md", "docs/format.md"}


def test_the_checks_can_fail(tmp_path):
    text = ("## A\n```python\nprint(1)  # -> 2\n```\n```bash\nrm -rf build\n```\n"
            "<!-- not run: needs a GPU -->\n```python\nraise SystemExit\n```\n```text\nout\n```\n"
            '```python\n--8<-- "examples/nothing.py"\n```\n```python\n--8<-- "tests/test_docs.py"\n```\n'
            "```bash\npython tools/bench_nothing.py --quick\n```\n")
    printing, shell, marked, output, missing, untested, tool = parse(text, "docs/x.md")
    with pytest.raises(AssertionError, match=r"docs/x.md:2: output differs"):
        run_python(printing, {})
    assert marked.not_run == "needs a GPU" and fate(marked) == "not run"
    assert fate(shell) == "docs/x.md:5 (A): 'rm -rf build' is neither a diskreplay command nor in SKIPPED"
    assert "not run; mark it" in fate(output)
    assert fate(dataclasses.replace(output, file="docs/format.md")) == "specification"
    assert fate(missing) == "docs/x.md:15 (A): --8<-- 'examples/nothing.py' names no file"
    assert fate(untested) == "docs/x.md:18 (A): tests/test_docs.py is included but no test under tests/ names it"
    assert fate(tool) == "docs/x.md:21 (A): tools/bench_nothing.py does not exist"
    with pytest.raises(AssertionError, match="docs/x.md:1: 'diskreplay verify nothing-here' failed"):
        run_commands(Block("docs/x.md", "bash", "diskreplay verify nothing-here", 1, "A", "A", None), tmp_path)


def test_ci_installs_as_the_readmes_development_section_says():
    """.ci/run installs the contributor line of README's "Development" (with pip's -q), then runs the demo."""
    readme = [b for b in BLOCKS if b.file == "README.md"]
    block = next(b for b in readme if b.heading == "Development" and b.lang == "bash")
    line = command(block.code).split(" && ")
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert line[2:] == ['python -m pip install "torch==2.13.0" -e ".[test]"', "diskreplay demo"]
    assert 'python -m pip install -q "torch==2.13.0" -e ".[test]" && diskreplay demo' in ci
    assert [b.section for b in readme if 'pip install "diskreplay[torch]"' in b.code] == ["Install"]


def test_readme_links_point_at_files():
    """The site's strict build checks the links of docs/; README.md is outside it, so its relative
    links are checked here."""
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README.read_text())
    local = [link for link in links if "://" not in link]
    assert local and [link for link in local if not (ROOT / link).exists()] == []


def mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    pytest.importorskip("mkdocs", reason="the site needs the docs extra: pip install -e '.[docs]'")
    pytest.importorskip("material", reason="the site needs the docs extra: pip install -e '.[docs]'")
    pytest.importorskip("mkdocstrings", reason="the site needs the docs extra: pip install -e '.[docs]'")
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config),
                           "--site-dir", str(site)], cwd=config.parent, capture_output=True, text=True, timeout=300,
                          check=False, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})


def test_site_builds_strict(tmp_path):
    """``mkdocs build --strict``: every page in the nav, every link and anchor resolves, every
    docstring of the API reference parses."""
    proc = mkdocs_build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert (tmp_path / "site" / "api" / "buffer" / "index.html").is_file()


@pytest.mark.parametrize(("link", "error"), [("guide/concepts.md", None), ("guide/nowhere.md", "nowhere.md"),
                                             ("guide/concepts.md#no-such-heading", "no-such-heading")])
def test_a_broken_link_fails_the_strict_build(tmp_path, link, error):
    """The validation settings of mkdocs.yml turn a link to a missing page or anchor into a failed build."""
    import yaml

    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    (tmp_path / "docs" / "guide").mkdir(parents=True)
    (tmp_path / "docs" / "guide" / "concepts.md").write_text("# Concepts\n\n## Lanes\n")
    (tmp_path / "docs" / "index.md").write_text(f"# Home\n\nSee [the guide]({link}).\n")
    config.update(nav=["index.md", "guide/concepts.md"], plugins=["search"])
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(config))
    proc = mkdocs_build(tmp_path / "mkdocs.yml", tmp_path / "site")
    if error is None:
        assert proc.returncode == 0, proc.stderr
    else:
        assert proc.returncode == 1 and error in proc.stderr, proc.stderr


def test_readme_names_every_extra():
    """Each extra of pyproject.toml but ``test`` has its row in the README's table of extras."""
    import tomllib

    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]) - {"test"}
    install = next(b for b in BLOCKS if b.file == "README.md" and b.section == "Install").line
    table = README.read_text().splitlines()[install:]
    named = {name for row in table if row.startswith("| `") for name in re.findall(r"`(\w+)`", row.split("|")[1])}
    assert named == extras
