"""Every fenced code block of README.md runs here, so the guide cannot rot.

Blocks are grouped by their ``## `` section; each section runs in a fresh temporary working
directory, where the snippets' relative paths (``runs/a/buffer``, ``hopper.hdf5``) land.

- ``python`` blocks of a section run in order in one namespace. A line ``print(...)  # -> text``
  shows the output: the block must print exactly those texts, in order, and nothing else.
- ``bash`` blocks: each ``diskreplay ...`` line runs (``python -m diskreplay``) and must exit 0;
  every other line must be listed in `SKIPPED`, exactly as documented, with why it is not run.
- A block preceded by ``<!-- not run: reason -->`` is not run. Any other block that is not run
  (an unknown language, an unlisted command, an unlisted output block) fails
  `test_every_block_runs_or_says_why`.

What the test supplies that the README leaves to the reader: `INPUTS`, the files the commands
read (a small stand-in for D4RL's ``hopper-medium-v2.hdf5``), and `S3_ENDPOINT`, replaced by a
local moto S3 server's address (the only text substitution).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import io
import re
import shlex
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from s3server import s3

import diskreplay as dr

README = Path(__file__).resolve().parents[1] / "README.md"

BENCH = "a benchmark: minutes, and large files"
SKIPPED = {  # command lines (comments cut) not run, and why
    'pip install "diskreplay[torch]"': "installs: downloads diskreplay and torch",
    'python3 -m venv .venv && . .venv/bin/activate && python -m pip install "torch==2.13.0" -e ".[test]" '
    '&& diskreplay demo': "installs: makes a virtualenv and downloads torch",
    "python -m pytest -q -n auto": "the whole test suite, which runs this file",
    "python -m ruff check diskreplay tests tools examples && python -m mypy": "lint and types: .ci/run runs them",
    "diskreplay demo": "about 10 s; tests/test_cli.py::test_demo_runs_and_resumes runs it with small sizes",
    "diskreplay bench --quick": "runs every benchmark in tools/ (minutes)",
    "python tools/bench_core.py --dir /tmp/drb": BENCH,
    "python tools/bench_sampling.py": BENCH,
    "python tools/bench_loader.py": BENCH,
    "python tools/bench_pixels.py --rows 300000": BENCH,
    "python tools/bench_pixels.py --rows 300000 --frames atari": BENCH,
    "python tools/bench_frame_codecs.py --threads 1,2": BENCH,
    "python tools/bench_frame_codecs.py --threads 1,2 --frames atari": BENCH,
    "python tools/bench_cloud.py --quick": BENCH,
    "python tools/bench_device.py --matmuls 8": "a benchmark that needs a CUDA device",
    "python tools/reliability_report.py": "about 2 min; the tests it runs are part of the suite",
    "HYPOTHESIS_PROFILE=ci python tools/reliability_report.py": "about 5 min; CI runs the model test so",
    'python tools/bench_scale.py --sizes 1M,10M,50M --per-sizes ""': BENCH,
    "python tools/bench_scale.py --sizes 200M --per-sizes 16M,64M --memory-size 1 --keep": BENCH + " (66 GB)",
    "python tools/bench_state.py --sizes 1M,16M,64M,256M": BENCH + " (about 11 min, 8 GB on disk)",
}
OUTPUT_BLOCKS = {  # language-less blocks under these headings are printed output, not code
    "DataLoader throughput": "the target lines tools/bench_loader.py printed",
}
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


@dataclasses.dataclass
class Block:
    lang: str
    code: str
    line: int  # line of the opening fence
    section: str  # the "## " heading above it
    heading: str  # the nearest heading above it
    not_run: str | None  # the reason of a `<!-- not run: ... -->` comment just before it


def parse(text: str) -> list[Block]:
    blocks, section, heading, previous, fence, body = [], "", "", "", None, []
    for number, line in enumerate(text.splitlines(), 1):
        if fence is not None:
            if line.strip() == "```":
                lang, start, marker = fence
                blocks.append(Block(lang, textwrap.dedent("\n".join(body)), start, section, heading, marker))
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


def fate(block: Block) -> str:
    """What happens to ``block``: "run", "skipped" (every line in SKIPPED), "output", "not run"
    (marked), or why it would go unrun unnoticed."""
    where = f"README.md:{block.line} ({block.heading})"
    if block.not_run is not None:
        return "not run" if block.not_run else f"{where}: a not-run mark needs a reason"
    if block.lang == "python":
        return "run"
    if block.lang == "bash":
        lines = [command(line) for line in block.code.splitlines() if command(line)]
        unlisted = [c for c in lines if not c.startswith("diskreplay ") and c not in SKIPPED]
        if unlisted:
            return f"{where}: {unlisted[0]!r} is neither a diskreplay command nor in SKIPPED"
        return "skipped" if all(c in SKIPPED for c in lines) else "run"
    if block.lang == "" and any(block.heading.startswith(h) for h in OUTPUT_BLOCKS):
        return "output"
    return f"{where}: a {block.lang or 'language-less'} block that is not run; mark it <!-- not run: why -->"


BLOCKS = parse(README.read_text())
SECTIONS = list(dict.fromkeys(b.section for b in BLOCKS if fate(b) == "run"))


def run_python(block: Block, namespace: dict) -> None:
    expected = re.findall(r"^\s*print\(.*#\s*->\s?(.*?)\s*$", block.code, re.MULTILINE)
    out = io.StringIO()
    code = compile("\n" * block.line + block.code, str(README), "exec")  # tracebacks name README lines
    with contextlib.redirect_stdout(out):
        exec(code, namespace)
    assert out.getvalue().splitlines() == expected, f"README.md:{block.line}: output differs from the README"


def run_commands(block: Block, cwd: Path) -> None:
    for line in block.code.splitlines():
        if command(line) and command(line) not in SKIPPED:
            argv = shlex.split(command(line))
            proc = subprocess.run([sys.executable, "-m", "diskreplay", *argv[1:]], cwd=cwd, check=False,
                                  capture_output=True, text=True, timeout=300)
            assert proc.returncode == 0, f"README.md:{block.line}: {line!r} failed:\n{proc.stdout}{proc.stderr}"


@pytest.mark.parametrize("section", SECTIONS, ids=lambda s: re.sub(r"\W+", "-", s.split(":")[0]).strip("-").lower())
def test_section(section, tmp_path, monkeypatch, request):
    monkeypatch.chdir(tmp_path)
    blocks = [b for b in BLOCKS if b.section == section and fate(b) == "run"]
    text = "\n".join(b.code for b in blocks)
    for name, make in INPUTS.items():
        if name in text:
            make(tmp_path / name)
    namespace: dict = {"__name__": "__readme__"}
    try:
        for block in blocks:
            if S3_ENDPOINT in block.code:
                moto = request.getfixturevalue("s3")
                moto.client().create_bucket(Bucket="bucket")
                block = dataclasses.replace(block, code=block.code.replace(S3_ENDPOINT, moto.endpoint))
            if block.lang == "python":
                run_python(block, namespace)
            else:
                run_commands(block, tmp_path)
    finally:
        for value in list(namespace.values()):
            if isinstance(value, (dr.ReplayBuffer, dr.RolloutBuffer)):
                value.close()
        namespace.clear()
        gc.collect()  # DataLoader workers end with their loader


def test_every_block_runs_or_says_why():
    fates = Counter(fate(block) for block in BLOCKS)
    unnoticed = [f for f in fates if f not in ("run", "skipped", "output", "not run")]
    assert unnoticed == [], f"blocks: {dict(fates)}"
    documented = {command(line) for b in BLOCKS if b.lang == "bash" for line in b.code.splitlines()}
    assert set(SKIPPED) <= documented, f"SKIPPED names commands the README lacks: {set(SKIPPED) - documented}"


def test_the_checks_can_fail(tmp_path):
    text = ("## A\n```python\nprint(1)  # -> 2\n```\n```bash\nrm -rf build\n```\n"
            "<!-- not run: needs a GPU -->\n```python\nraise SystemExit\n```\n```text\nout\n```\n")
    printing, shell, marked, output = parse(text)
    with pytest.raises(AssertionError, match="output differs"):
        run_python(printing, {})
    assert marked.not_run == "needs a GPU" and fate(marked) == "not run"
    assert "'rm -rf build' is neither" in fate(shell)
    assert "not run; mark it" in fate(output)
    with pytest.raises(AssertionError, match="failed"):
        run_commands(Block("bash", "diskreplay verify nothing-here", 1, "A", "A", None), tmp_path)


def test_ci_installs_as_the_readmes_development_section_says():
    """.ci/run installs the contributor line of README's "Development" (with pip's -q), then runs the demo."""
    block = next(b for b in BLOCKS if b.heading == "Development" and b.lang == "bash")
    readme = command(block.code).split(" && ")
    ci = (README.parent / ".ci" / "run").read_text().splitlines()
    assert readme[2:] == ['python -m pip install "torch==2.13.0" -e ".[test]"', "diskreplay demo"]
    assert 'python -m pip install -q "torch==2.13.0" -e ".[test]" && diskreplay demo' in ci
    assert [b.section for b in BLOCKS if 'pip install "diskreplay[torch]"' in b.code] == ["Install"]
