"""`diskreplay info` and `diskreplay verify` on sharded buffers (and the side store of derive_next)."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import OWN

import diskreplay as dr
from diskreplay import cli
from diskreplay.audit import buffer_info, format_info, verify
from diskreplay.format.shards import LEARNER_KEY, LearnerProgress

FIELDS = {"obs": dr.Field((2,), "float32"), "next_obs": dr.Field((2,), "float32"),
          "reward": dr.Field((), "float32"), "done": dr.Field((), "bool")}
STEPS = (5, 12, 0)  # steps per lane each shard's actor writes (2 lanes each)
LEGACY_KEYS = ["url", "rows", "lanes", "rows_per_lane", "capacity", "fields", "chunk_rows", "chunks_per_field",
               "inner_chunk_rows", "chunk_files", "compression", "compression_level", "bytes_on_disk", "bytes_raw",
               "compression_ratio", "sampler", "commit_sequence", "last_commit_time", "episodes"]


def steps(first: int, n: int) -> dict[str, np.ndarray]:
    """``n`` steps of both lanes from ``first`` on: an episode ends every 4th step."""
    t = np.arange(first, first + n, dtype=np.float32)[:, None, None] * np.ones((1, 2, 2), np.float32)
    done = (np.arange(first, first + n) % 4 == 3)[:, None].repeat(2, 1)
    return {"obs": t, "next_obs": t + 1, "reward": np.ones((n, 2), np.float32), "done": done}


def make_sharded(path: Path, counts: tuple[int, ...] = STEPS, capacity: int = 64) -> str:
    """A sharded buffer of ``len(counts)`` shards, 2 lanes each (derive_next obs), shard ``i``'s actor
    having written ``counts[i]`` steps per lane in one flush."""
    url = str(path / "sharded")
    dr.ReplayBuffer.create(url, FIELDS, capacity=capacity, shards=len(counts), num_envs=2, chunk_rows=8,
                           derive_next=("obs",)).close()
    for shard, n in enumerate(counts):
        with dr.ReplayBuffer.open_shard(url, shard=shard) as actor:
            if n:
                actor.extend(steps(0, n))
    return url


def commit_time(url: str, shard: int) -> float:
    return json.loads((Path(url) / f"shard-{shard:05d}" / OWN / "commit.json").read_text())["time"]


def when(seconds: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(seconds))


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    code = cli.main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


# ---- info ------------------------------------------------------------------------------------


def test_info_json_reports_each_shard(tmp_path, capsys):
    url = make_sharded(tmp_path)
    code, out, err = run_cli(capsys, "info", "--json", url)
    assert (code, err) == (0, "")
    info = json.loads(out)
    assert (info["sharded"], info["shards"], info["url"]) == (True, 3, url)
    assert (info["rows"], info["lanes"], info["rows_per_lane"]) == (34, 6, [5, 5, 12, 12, 0, 0])
    assert info["capacity"] == 192 and info["sampler"] == "Uniform"
    assert info["per_shard"] == [
        {"shard": s, "name": f"shard-{s:05d}", "rows": 2 * n, "added": 2 * n, "commit_sequence": 2,
         "last_commit_time": commit_time(url, s)} for s, n in enumerate(STEPS)]
    assert info["learner"] is None
    assert "commit_sequence" not in info and "last_commit_time" not in info
    # one chunk of 8 rows for 5 steps, two for 12: per stored field (obs, reward, done)
    assert info["chunks_per_field"] == 6 and info["chunk_files"] == {"obs": 6, "next_obs": 0, "reward": 6, "done": 6}
    assert info["fields"] == {"obs": {"shape": [2], "dtype": "float32"},
                              "next_obs": {"shape": [2], "dtype": "float32",
                                           "derived": "obs of the next step (derive_next; not stored)"},
                              "reward": {"shape": [], "dtype": "float32"}, "done": {"shape": [], "dtype": "bool"}}
    # episodes end at steps 3, 7, 11 of every lane: 1 + 1 in shard 0 (step 4 still running), 3 + 3 in shard 1
    assert info["episodes"] == {"done_fields": ["done"], "count": 8, "in_progress": 2, "length_mean": 4.0,
                                "length_min": 4, "length_max": 4, "return_mean": 4.0}
    on_disk = sum(p.stat().st_size for p in Path(url).rglob("*") if p.is_file())
    assert info["bytes_on_disk"] == on_disk


def test_info_text_shows_the_schema_once_and_a_row_per_shard(tmp_path, capsys):
    url = make_sharded(tmp_path)
    code, out, err = run_cli(capsys, "info", url)
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[0] == f"buffer      {url} (sharded: 3 shards)"
    assert lines[1] == "rows        34 in 6 lanes (5, 5, 12, 12, 0, 0); ring, capacity 192 (64 per shard)"
    assert lines[2:7] == ["fields", "  obs       (2,)           float32", "  reward    ()             float32",
                          "  done      ()             bool",
                          "  next_obs  (2,)           float32  derived: obs of the next step (derive_next; not stored)"]
    assert ("sampler     Uniform (the shards'; the learner's own is recorded in learner.json only by a learner "
            "with a rate_limiter)") in lines
    assert sum(line.startswith("fields") for line in lines) == 1
    assert lines[-6:] == [
        "shards      3",
        "  shard        rows  added  commit  last commit",
        f"  shard-00000    10     10      #2  {when(commit_time(url, 0))}",
        f"  shard-00001    24     24      #2  {when(commit_time(url, 1))}",
        f"  shard-00002     0      0      #2  {when(commit_time(url, 2))}",
        "learner     - (no learner.json: no learner has published its progress)",
    ]
    assert "last commit #" not in out


def test_info_counts_rows_added_beyond_the_ring(tmp_path):
    url = make_sharded(tmp_path, counts=(3, 3), capacity=16)  # 8 steps per lane
    with dr.ReplayBuffer.open_shard(url, shard=1) as actor:
        actor.extend(steps(3, 17))  # 20 steps per lane: the oldest chunk of each lane retired
    info = buffer_info(url, episodes=False)
    assert [(s["rows"], s["added"]) for s in info["per_shard"]] == [(6, 6), (16, 40)]
    sequences = [json.loads((Path(url) / f"shard-{s:05d}" / OWN / "commit.json").read_text())["sequence"]
                 for s in (0, 1)]
    assert [s["commit_sequence"] for s in info["per_shard"]] == sequences == [2, 4]  # the ring's extend commits too
    assert info["rows"] == 22 and info["rows_per_lane"] == [3, 3, 8, 8] and info["episodes"] is None


def test_info_shows_the_learners_progress(tmp_path, capsys):
    url = make_sharded(tmp_path)
    limiter = dr.RateLimiter(samples_per_insert=1.0, error_buffer=100.0)
    with dr.ReplayBuffer.open(url, "r", rate_limiter=limiter, seed=0) as learner:
        learner.sample(7)
    progress = LearnerProgress.from_bytes((Path(url) / OWN / LEARNER_KEY).read_bytes(), url, 3)
    assert (progress.samples, progress.inserts) == (7, (10, 24, 0))
    info = buffer_info(url)
    assert info["learner"] == {"samples": 7, "inserts": [10, 24, 0], "time": progress.time, "sampler": "Uniform"}
    text = format_info(info).splitlines()
    assert text[-6:] == [
        "shards      3",
        "  shard        rows  added  commit  last commit          learner saw",
        f"  shard-00000    10     10      #2  {when(commit_time(url, 0))}           10",
        f"  shard-00001    24     24      #2  {when(commit_time(url, 1))}           24",
        f"  shard-00002     0      0      #2  {when(commit_time(url, 2))}            0",
        f"learner     7 rows sampled, 34 inserts seen, published at {when(progress.time)}",
    ]
    code, out, _ = run_cli(capsys, "info", "--json", url)
    assert code == 0 and json.loads(out)["learner"] == {"samples": 7, "inserts": [10, 24, 0], "time": progress.time,
                                                        "sampler": "Uniform"}


def test_info_says_the_learner_file_is_damaged(tmp_path, capsys):
    url = make_sharded(tmp_path)
    (Path(url) / OWN / LEARNER_KEY).write_text('{"samples": 3, "inserts": [1, 2], "time": 5.0}')
    code, out, err = run_cli(capsys, "info", url)
    assert (code, err) == (0, "")
    assert out.splitlines()[-1] == ("learner     damaged: learner.json field 'inserts': expected 3 ints >= 0, "
                                    "got [1, 2]")
    assert buffer_info(url, episodes=False)["learner"] == {
        "error": "learner.json field 'inserts': expected 3 ints >= 0, got [1, 2]"}


def test_info_of_a_buffer_that_is_not_sharded_keeps_its_keys(tmp_path):
    with dr.ReplayBuffer.create(tmp_path / "b", {"x": dr.Field((), "int8")}, chunk_rows=4) as buf:
        buf.extend({"x": np.arange(6)})
    info = buffer_info(str(tmp_path / "b"))
    assert list(info) == LEGACY_KEYS
    assert (info["commit_sequence"], info["rows"], info["chunk_files"]) == (2, 6, {"x": 2})
    assert format_info(info).splitlines()[-1].startswith("last commit #2 at ")


# ---- verify ----------------------------------------------------------------------------------


def test_verify_checks_every_shard(tmp_path, capsys):
    url = make_sharded(tmp_path)
    code, out, err = run_cli(capsys, "verify", "--no-progress", url)
    assert (code, err) == (0, "")
    # chunks: 6 (lane, chunk) pairs x 3 stored fields, and the side stores' (a chunk per lane with an ended
    # episode); episodes: the complete ones and those still running (2 in shard 0)
    assert out.splitlines() == [
        f"{url}: OK - 3 shards, 34 rows, 22 chunks checked, 10 episodes",
        "  shard-00000: OK - 10 rows, 8 chunks checked, 4 episodes",
        "  shard-00001: OK - 24 rows, 14 chunks checked, 6 episodes",
        "  shard-00002: OK - 0 rows, 0 chunks checked, 0 episodes",
    ]
    report = verify(url)
    assert report.ok and [part.url for part in report.shards] == [f"{url}/shard-{s:05d}" for s in range(3)]


def test_verify_names_the_shard_of_a_corrupt_chunk(tmp_path, capsys):
    url = make_sharded(tmp_path)
    (Path(url) / "shard-00001" / "obs" / "c.1.1.0").write_bytes(b"not zstd at all")
    code, out, err = run_cli(capsys, "verify", "--no-progress", url)
    assert (code, out) == (1, "")
    lines = err.splitlines()
    assert lines[0] == f"{url}: PROBLEMS - 3 shards, 34 rows, 22 chunks checked"
    assert lines[1:4] == ["  shard-00000: OK - 10 rows, 8 chunks checked, 4 episodes",
                          "  shard-00001: PROBLEMS - 24 rows, 14 chunks checked",
                          "  shard-00002: OK - 0 rows, 0 chunks checked, 0 episodes"]
    assert len(lines) == 5 and lines[4].startswith(
        "  problem: shard-00001: chunk 'obs/c.1.1.0' does not decode to 64 bytes (")


def test_verify_reports_a_missing_shard(tmp_path, capsys):
    url = make_sharded(tmp_path)
    shutil.rmtree(Path(url) / "shard-00002")
    code, out, err = run_cli(capsys, "verify", "--no-progress", url)
    assert (code, out) == (1, "")
    assert err.splitlines()[-1] == (f"  problem: shard-00002: the shard is missing ({url!r} declares 3 shards; "
                                    f"shard-00002/ holds nothing)")
    report = verify(url)
    assert report.problems == [err.splitlines()[-1].removeprefix("  problem: ")]
    assert (report.rows, report.episodes) == (34, None)


def test_verify_reports_a_shard_without_commit(tmp_path):
    url = make_sharded(tmp_path)
    (Path(url) / "shard-00000" / OWN / "commit.json").unlink()
    assert verify(url).problems == ["shard-00000: no commit.json: not a diskreplay buffer (or its creation never "
                                    "finished)"]


@pytest.mark.parametrize(("blob", "problem"), [
    (b"{not json", "learner.json is not valid JSON"),
    (b'{"samples": -1, "inserts": [0, 0, 0], "time": 1.0}', "learner.json field 'samples': expected an int >= 0, "
                                                             "got -1"),
    (b'{"samples": 4, "inserts": [0, 0], "time": 1.0}', "learner.json field 'inserts': expected 3 ints >= 0, "
                                                        "got [0, 0]"),
    (b'{"samples": 4, "inserts": [0, 0, 0], "time": "now"}', "learner.json field 'time': expected a number, "
                                                             "got 'now'"),
])
def test_verify_reports_a_damaged_learner_file(tmp_path, capsys, blob, problem):
    url = make_sharded(tmp_path)
    (Path(url) / OWN / LEARNER_KEY).write_bytes(LearnerProgress(4, (1, 2, 3), 1.0).to_bytes())
    assert verify(url).ok
    (Path(url) / OWN / LEARNER_KEY).write_bytes(blob)
    report = verify(url)
    assert not report.ok and len(report.problems) == 1 and report.problems[0].startswith(problem)
    code, _, err = run_cli(capsys, "verify", "--no-progress", url)
    assert code == 1 and err.splitlines()[-1] == f"  problem: {report.problems[0]}"


def test_verify_reports_a_damaged_side_store_of_one_shard(tmp_path):
    url = make_sharded(tmp_path)
    (Path(url) / "shard-00001" / "final" / "obs" / "c.1.0.0").unlink()
    report = verify(url)
    assert report.problems == ["shard-00001: the side store final/ of derive_next: chunk 'obs/c.1.0.0' is missing, "
                               "but commit.json says it holds rows"]
    shutil.rmtree(Path(url) / "shard-00000" / "final")
    assert verify(url).problems == [
        "shard-00000: the side store final/ of derive_next: it is missing (final/ holds nothing)",
        "shard-00001: the side store final/ of derive_next: chunk 'obs/c.1.0.0' is missing, "
        "but commit.json says it holds rows"]


def test_verify_checks_the_side_store_of_a_buffer_that_is_not_sharded(tmp_path):
    url = str(tmp_path / "b")
    with dr.ReplayBuffer.create(url, FIELDS, num_envs=2, chunk_rows=8, derive_next=("obs",)) as buf:
        buf.extend(steps(0, 12))
    healthy = verify(url)
    assert healthy.ok and (healthy.rows, healthy.chunks_checked, healthy.episodes) == (24, 14, 6)
    (Path(url) / "final" / "obs" / "c.0.0.0").write_bytes(b"garbage")
    report = verify(url)
    assert len(report.problems) == 1 and report.problems[0].startswith(
        "the side store final/ of derive_next: chunk 'obs/c.0.0.0' does not decode")


def test_verify_reports_shards_whose_configs_differ(tmp_path):
    url = make_sharded(tmp_path)
    dr.ReplayBuffer.create(f"{url}/shard-00002", FIELDS, capacity=64, num_envs=2, chunk_rows=4,
                           derive_next=("obs",), overwrite=True).close()
    report = verify(url)
    assert report.problems == ["shard-00002: its config differs from shard-00000's (chunk_rows)"]


def test_info_reports_the_learners_sampler_not_the_shards(tmp_path, capsys):
    url = make_sharded(tmp_path)
    limiter = dr.RateLimiter(samples_per_insert=1.0, error_buffer=100.0)
    with dr.ReplayBuffer.open(url, "r", rate_limiter=limiter, seed=0, sampler=dr.Prioritized()) as learner:
        learner.sample(7)
    info = buffer_info(url, episodes=False)
    assert (info["sampler"], info["sampler_source"], info["learner"]["sampler"]) == ("Prioritized", "learner",
                                                                                      "Prioritized")
    code, out, _ = run_cli(capsys, "info", url)
    assert code == 0 and "sampler     Prioritized (the learner's, from learner.json)" in out.splitlines()


def test_learner_file_with_a_bad_sampler_is_damaged(tmp_path):
    url = make_sharded(tmp_path)
    (Path(url) / OWN / LEARNER_KEY).write_text('{"samples": 3, "inserts": [1, 2, 0], "time": 5.0, "sampler": 7}')
    assert buffer_info(url, episodes=False)["learner"] == {
        "error": "learner.json field 'sampler': expected a class name, got 7"}
    old = '{"samples": 3, "inserts": [1, 2, 0], "time": 5.0}'  # written before the sampler was recorded
    assert LearnerProgress.from_bytes(old.encode(), url, 3) == LearnerProgress(3, (1, 2, 0), 5.0, None)


def test_info_marks_the_episodic_return_as_derived(tmp_path):
    fields = {"obs": dr.Field((2,), "float32"), "reward": dr.Field((), "float32"), "done": dr.Field((), "bool")}
    with dr.ReplayBuffer.create(tmp_path / "b", fields, chunk_rows=4,
                                episodic_return=dr.EpisodicReturn(gamma=0.9)) as buf:
        buf.extend({"obs": np.zeros((6, 2), np.float32), "reward": np.ones(6, np.float32), "done": np.arange(6) == 2})
    info = buffer_info(str(tmp_path / "b"))
    assert info["fields"]["return"] == {"shape": [], "dtype": "float32",
                                        "derived": "discounted return of reward, gamma 0.9 (episodic_return)"}
    assert "derived" not in info["fields"]["reward"]
    assert "  return  ()             float32  derived: discounted return of reward, gamma 0.9 (episodic_return)" \
        in format_info(info).splitlines()
