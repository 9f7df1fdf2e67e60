"""What a new user meets on day one: helpful errors and warnings, `latest`, `clear`, dataset
`len`/`repr`, DataLoader defaults, typing, docstrings, logging."""

from __future__ import annotations

import importlib.resources
import inspect
import logging
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from conftest import logged
from torch.utils.data import DataLoader

import diskreplay as dr

FIELDS = {"obs": dr.Field((3,), "float32"), "action": dr.Field((), "int64"), "reward": dr.Field((), "float32"),
          "done": dr.Field((), "bool")}


def steps(first: int, count: int, episode: int = 10) -> dict[str, np.ndarray]:
    t = np.arange(first, first + count)
    return {"obs": np.repeat(t[:, None], 3, 1).astype(np.float32), "action": t, "reward": t.astype(np.float32),
            "done": t % episode == episode - 1}


def test_the_sb3_habit_of_calling_the_class_points_to_create_and_open(tmp_path):
    with pytest.raises(TypeError, match=r"ReplayBuffer\(str, \.\.\.\) is not how a buffer is made: use "
                                        r"dr\.ReplayBuffer\.create\(url, fields, capacity\).*dr\.ReplayBuffer\.open"):
        dr.ReplayBuffer(str(tmp_path / "b"), FIELDS, 1000)
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("num_envs", [1, 3])
def test_latest_gives_the_newest_rows_oldest_first(tmp_path, num_envs):
    with dr.ReplayBuffer.create(tmp_path / "b", FIELDS, capacity=60, num_envs=num_envs, chunk_rows=8) as buf:
        for first in range(0, 100 * num_envs, 7 * num_envs):  # wraps the ring
            rows = steps(first, 7 * num_envs)
            buf.extend({k: v.reshape(7, num_envs, *v.shape[1:]) for k, v in rows.items()} if num_envs > 1 else rows)
        ids = buf.row_ids()
        newest = np.sort(ids)[-25:]
        got = buf.latest(25)
        np.testing.assert_array_equal(got["index"], newest)
        np.testing.assert_array_equal(got["action"], buf[newest]["action"])
        assert len(buf.latest(10_000)["index"]) == len(buf) == 60
        assert len(buf.latest(0)["index"]) == 0
        with pytest.raises(ValueError, match="n must be an int >= 0, got -1"):
            buf.latest(-1)


@pytest.mark.parametrize("capacity", [40, None])
def test_clear_forgets_every_row_and_ids_go_on(tmp_path, capacity):
    url = tmp_path / "b"
    buf = dr.ReplayBuffer.create(url, FIELDS, capacity=capacity, chunk_rows=8, sampler=dr.Prioritized())
    buf.extend(steps(0, 35))  # ends inside an episode (steps 30..34)
    buf.flush()
    reader = dr.ReplayBuffer.open(url, "r")
    buf.clear()
    assert len(buf) == 0 and len(reader) == 35
    with pytest.raises(dr.EmptyBufferError):
        buf.sample(4)
    buf.flush()
    reader.refresh()
    assert len(reader) == 0
    buf.extend(steps(35, 50))  # a ring of 40 wraps over the cleared rows
    buf.flush()
    assert buf.row_ids()[0] == (45 if capacity else 35) and len(buf) == (40 if capacity else 50)
    drawn = buf.sample(2000, seed=0)["index"]
    assert drawn.min() >= buf.row_ids()[0]
    episodes = buf.episodes()  # the episode open at the clear was cut there: the next one starts at 35
    assert 34 not in episodes.start.tolist() or capacity
    assert buf.episode_index.episode_start(np.zeros(1, np.int64), np.array([36]))[0] == 35
    reader.refresh()
    np.testing.assert_array_equal(reader[buf.row_ids()]["action"], buf.row_ids())
    reader.close()
    buf.close()
    with dr.ReplayBuffer.open(url, "r") as again:
        assert len(again) == len(buf.row_ids() if False else again.row_ids()) == (40 if capacity else 50)


def test_a_reader_cannot_clear(tmp_path):
    with dr.ReplayBuffer.create(tmp_path / "b", FIELDS, capacity=40) as buf:
        buf.extend(steps(0, 5))
    with dr.ReplayBuffer.open(tmp_path / "b", "r") as reader, pytest.raises(dr.ReadOnlyError):
        reader.clear()


def test_datasets_say_when_the_writer_has_not_flushed(tmp_path):
    url = tmp_path / "b"
    buf = dr.ReplayBuffer.create(url, FIELDS, capacity=100, chunk_rows=8)
    buf.extend(steps(0, 30))
    with pytest.warns(UserWarning, match=r"30 rows are staged but not committed; a dataset reads committed "
                                         r"rows only: call buf.flush\(\) before making it"):
        ds = dr.make_dataset(buf, 8, "epoch")
    assert list(ds) == [] and len(ds) == 0
    with pytest.warns(UserWarning, match=r"holds no committed rows: this epoch yields no batches"):
        dr.make_dataset(str(url), 8, "epoch")
    with pytest.raises(dr.EmptyBufferError, match=r"holds 0 readable rows; a writer's rows become readable "
                                                  r"when it calls flush\(\)"):
        dr.ReplayBuffer.open(url, "r", retry=dr.RetryPolicy(budget_s=0.01)).sample(4)
    buf.flush()
    ds = dr.make_dataset(buf, 8, "epoch", shuffle=False)
    assert [len(b["index"]) for b in ds] == [8, 8, 8, 6] and len(ds) == 4
    buf.close()


def test_dataloader_left_at_batch_size_one_passes_batches_through(tmp_path):
    url = tmp_path / "b"
    with dr.ReplayBuffer.create(url, FIELDS, capacity=100, chunk_rows=8) as buf:
        buf.extend(steps(0, 64))
    ds = dr.make_dataset(url, 16, "sample", seed=1)
    with pytest.warns(UserWarning, match=r"default batch_size=1: diskreplay datasets yield whole batches, passed "
                                         r"on as they are; use DataLoader\(dataset, batch_size=None\)"):
        batch = next(iter(DataLoader(ds)))
    assert batch["obs"].shape == (16, 3)
    fresh = dr.make_dataset(url, 16, "sample", seed=1)
    np.testing.assert_array_equal(batch["index"], next(iter(DataLoader(fresh, batch_size=None)))["index"])
    with pytest.raises(TypeError, match=r"batch_size=4\): diskreplay datasets yield whole batches"):
        next(iter(DataLoader(ds, batch_size=4)))


@pytest.mark.parametrize("worker_ring", [True, False])
def test_dataloader_workers_left_at_batch_size_one_pass_batches_through(tmp_path, worker_ring):
    url = tmp_path / "b"
    with dr.ReplayBuffer.create(url, FIELDS, capacity=100, chunk_rows=8) as buf:
        buf.extend(steps(0, 64))
    ds = dr.make_dataset(url, 16, "epoch", shuffle=False, worker_ring=worker_ring)
    loader = DataLoader(ds, num_workers=1, multiprocessing_context="fork")
    batches = list(loader)
    assert [tuple(b["obs"].shape) for b in batches] == [(16, 3)] * 4
    np.testing.assert_array_equal(torch.cat([b["index"] for b in batches]), np.arange(64))


def test_epoch_dataset_len_and_reprs(tmp_path):
    url = tmp_path / "b"
    with dr.ReplayBuffer.create(url, FIELDS, capacity=None, chunk_rows=8) as buf:
        buf.extend(steps(0, 50))
    ds = dr.make_dataset(url, 16, "epoch", seed=3)
    assert len(ds) == len(list(ds)) == 4
    assert repr(ds) == (f"EpochDataset({str(url)!r}, batch_size=16, rows=50, epoch=0, shuffle='block', seed=3, "
                        f"rank=0/1)")
    sample = dr.make_dataset(url, 16, "sample", seed=3, sample_options={"recent_rows": 20})
    assert repr(sample) == (f"SampleDataset({str(url)!r}, batch_size=16, batch=0, seed=3, rank=0/1, "
                            f"sample_options={{'recent_rows': 20}})")


@pytest.mark.slow
def test_the_package_ships_py_typed_and_user_code_type_checks(tmp_path):
    assert importlib.resources.files("diskreplay").joinpath("py.typed").is_file()
    pytest.importorskip("mypy")
    user = tmp_path / "user.py"
    user.write_text(textwrap.dedent("""
        import numpy as np
        import diskreplay as dr
        from diskreplay.sampling import PrioritySampler

        samplers: list[dr.Sampler] = [dr.Uniform(), dr.Prioritized(), dr.WithoutReplacement()]
        prioritized: PrioritySampler = dr.Prioritized()
        fields = {"obs": dr.Field((4,), "float32"), "done": dr.Field((), "bool")}
        buf = dr.ReplayBuffer.create("b", fields, 1000, sampler=dr.Prioritized(alpha=0.6))
        reader = dr.ReplayBuffer.open("b", "r", sampler=dr.WithoutReplacement())
        buf.add(obs=np.zeros(4, np.float32), done=False)
        batch: dict[str, np.ndarray] = buf.sample(32, beta=0.4)
        buf.update_priorities(batch["index"], np.ones(32))
        rows: int = len(buf)
        capacity: int | None = buf.capacity
        newest: dict[str, np.ndarray] = buf.latest(8)
        ds = dr.make_dataset(buf, 32, "epoch")
        batches: int = len(ds)
        wrong: str = buf.capacity
    """))
    import diskreplay
    root = str(importlib.resources.files(diskreplay).parent)
    result = subprocess.run([sys.executable, "-m", "mypy", "--no-error-summary", "--follow-imports=silent",
                             "--cache-dir", str(tmp_path / "cache"), str(user)],
                            capture_output=True, text=True, cwd=root)
    errors = result.stdout.strip().splitlines()
    assert len(errors) == 1 and 'Incompatible types in assignment (expression has type "int | None", variable ' \
                                'has type "str")' in errors[0], result.stdout + result.stderr  # only the planted one


def public_names() -> list[tuple[str, object]]:
    """Every public name, and each public method and property of the public classes
    (constructors are documented by their class)."""
    out = []
    for name in dr.__all__:
        obj = getattr(dr, name)
        out.append((name, obj))
        if inspect.isclass(obj):
            out += [(f"{name}.{attr}", value) for attr, value in vars(obj).items()
                    if not attr.startswith("_") or attr in ("__len__", "__getitem__", "__iter__")]
    return out


def test_help_of_every_public_name_shows_a_docstring_of_its_own():
    missing = []
    for name, obj in public_names():
        if isinstance(obj, property):
            doc = obj.__doc__
        elif inspect.isclass(obj) or inspect.isfunction(obj) or inspect.ismethod(obj) or isinstance(obj, classmethod):
            doc = inspect.getdoc(getattr(obj, "__func__", obj))  # what help() shows, inherited from Sampler too
        else:
            continue
        if not doc or len(doc) < 10 or doc.startswith("Base class for protocol classes"):
            missing.append(name)
    assert missing == []


def test_the_library_prints_nothing_and_logs_under_its_name(tmp_path, capsys, caplog):
    with caplog.at_level(logging.DEBUG, logger="diskreplay"):
        with dr.ReplayBuffer.create(tmp_path / "b", FIELDS, capacity=100, chunk_rows=8) as buf:
            buf.extend(steps(0, 64))
            buf.flush()
            buf.sample(8)
            list(dr.make_dataset(buf, 16, "epoch"))
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO] == []  # a quiet run says nothing


def test_a_sampling_option_the_sampler_does_not_take_is_named(tmp_path):
    with dr.ReplayBuffer.create(tmp_path / "b", FIELDS, capacity=100, sampler=dr.Prioritized()) as buf:
        buf.extend(steps(0, 20))
        with pytest.raises(ValueError,
                           match=r"Prioritized takes no sampling option 'recent_rows' \(its options: beta\)"):
            buf.sample(8, recent_rows=5)
        assert len(buf.sample(8, beta=0.5)["weight"]) == 8
