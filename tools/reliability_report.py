"""The Reliability table of docs/benchmarks.md: runs the crash, fault, concurrency, bad-input and
model-based tests and sums what they report (SIGKILLs survived and committed rows lost, faults
injected and survived, bad input kinds refused, rows readers checked and found wrong, random
operation sequences checked against the reference model). It prints the table in that page's
format (tests/test_reliability.py checks that the page's table has the same columns and rows).

Usage: python tools/reliability_report.py [--out FILE]      (about two minutes on 2 cores)
       HYPOTHESIS_PROFILE=ci python tools/reliability_report.py   (the model test's CI budget: ~5 min more)
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ["tests/test_crash.py", "tests/test_faults.py", "tests/test_concurrency.py", "tests/test_bad_inputs.py",
         "tests/test_model.py"]
PATTERNS = {  # what each test prints (pytest -s), and the numbers taken from it
    "crash": re.compile(r"crash test (?P<label>[^:]+): (?P<kills>\d+) SIGKILLs survived, "
                        r"(?P<lost>\d+) committed rows lost"),
    "faults": re.compile(r"faults: (?P<injected>\d+) injected, (?P<survived>\d+) survived"),
    "readers": re.compile(r"live ring writer \+ 3 readers \((?P<label>\w+)\): reader rows checked (?P<checked>\d+), "
                          r"wrong (?P<wrong>\d+)"),
    "live": re.compile(r"live writer \+ reader \((?P<label>\w+)\): \d+ batches, (?P<checked>\d+) rows checked"),
    "bad": re.compile(r"bad-input kinds: (?P<kinds>\d+) calls refused"),
    "model": re.compile(r"model test: (?P<sequences>\d+) sequences, (?P<steps>\d+) steps checked, "
                        r"(?P<layouts>\d+) layouts \((?P<covered>[^\n]*)\)"),
}


def run_tests() -> tuple[str, int]:
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", *TESTS],
                          cwd=ROOT, capture_output=True, text=True)
    return done.stdout + done.stderr, done.returncode


def table(output: str, code: int) -> str:
    found = {name: [m.groupdict() for m in pattern.finditer(output)] for name, pattern in PATTERNS.items()}
    total = lambda name, key: sum(int(m[key]) for m in found[name])  # noqa: E731
    summary = re.findall(r"^=*\s*(\d+ passed.*?)\s*=*$", output, re.M)
    rows = [
        ("writer processes killed with SIGKILL (local ring, local dataset, S3)",
         f"{total('crash', 'kills')} survived", f"{total('crash', 'lost')} committed rows lost"),
        ("faults injected: full disk (tmpfs), S3 503 answers, S3 requests never answered",
         f"{total('faults', 'injected')} injected", f"{total('faults', 'survived')} survived"),
        ("bad-input and tampered-file kinds", f"{total('bad', 'kinds')} refused", "store unchanged in each"),
        ("rows returned to readers of a live ring writer (3 reader processes, and one in-process)",
         f"{total('readers', 'checked') + total('live', 'checked'):,} checked", f"{total('readers', 'wrong')} wrong"),
        ("random operation sequences against a reference model "
         f"({found['model'][0]['covered'] if found['model'] else 'not run'})",
         f"{total('model', 'sequences'):,} sequences, {total('model', 'steps'):,} steps, "
         f"{total('model', 'layouts')} layouts", "0 differences" if code == 0 else "FAILURES"),
    ]
    lines = ["| what | done | outcome |", "|---|---:|---:|", *(f"| {a} | {b} | {c} |" for a, b, c in rows)]
    lines.append("")
    lines.append(f"pytest: {summary[-1] if summary else f'exit {code}'}" + ("" if code == 0 else " (FAILURES)"))
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="also write the table to this file")
    args = p.parse_args()
    output, code = run_tests()
    report = table(output, code)
    print(report)
    if args.out:
        Path(args.out).write_text(report + "\n")
    sys.exit(code)


if __name__ == "__main__":
    main()
