"""`Threads`: worker threads started at the first job, and again in a forked child, where the
parent's threads do not exist (work handed to its pool there would wait forever)."""

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from conftest import exit_code_in_fork

import diskreplay as dr
from diskreplay.io.threads import Threads


def test_jobs_run_on_named_threads_started_at_the_first_job():
    workers = Threads(2, "test-workers")
    assert not [t for t in threading.enumerate() if t.name.startswith("test-workers")]
    assert list(workers.map(lambda x: x * x, range(5))) == [0, 1, 4, 9, 16]
    assert workers.submit(lambda: threading.current_thread().name).result().startswith("test-workers")
    workers.shutdown()
    assert not [t for t in threading.enumerate() if t.name.startswith("test-workers") and t.is_alive()]
    assert workers.submit(sum, [1, 2]).result() == 3  # started again
    workers.shutdown()


def test_a_forked_child_runs_jobs_on_threads_of_its_own():
    workers = Threads(2, "test-fork")
    assert list(workers.map(abs, [-1, -2])) == [1, 2]  # the parent's threads are up, and idle
    assert exit_code_in_fork(lambda: list(workers.map(abs, [-3, -4])) == [3, 4]) == 0
    assert list(workers.map(abs, [-5])) == [5]  # the parent's pool is untouched
    workers.shutdown()


def test_a_plain_pool_leaves_the_child_waiting():
    """Why `Threads` exists: in a forked child, a job given to the parent's idle pool never
    runs (the child gives up after 1 s here)."""
    pool = ThreadPoolExecutor(max_workers=2)
    assert list(pool.map(abs, [-1, -2])) == [1, 2]

    def child() -> bool:
        try:
            pool.submit(abs, -3).result(timeout=1.0)
        except TimeoutError:
            return True
        return False

    assert exit_code_in_fork(child) == 0
    pool.shutdown()


def test_a_forked_reader_of_compressed_chunks_reads_them(tmp_path):
    """Compressed chunks are decoded on the I/O threads: a forked child of a reader that read
    some (its threads up) reads the others, with the right values."""
    url = str(tmp_path / "z")
    fields = {"x": dr.Field((8,), "float32")}
    x = np.arange(4000 * 8, dtype=np.float32).reshape(4000, 8)
    with dr.ReplayBuffer.create(url, fields, chunk_rows=64, compression="zstd") as buf:
        buf.extend({"x": x})
    reader = dr.ReplayBuffer.open(url, "r", cache_bytes=8 * 64 * 32, io_threads=2)  # 8 chunks of 63
    first, rest = np.arange(0, 2000, 3), np.arange(2000, 4000, 3)
    np.testing.assert_array_equal(reader.rows(first)["x"], x[first])
    assert exit_code_in_fork(lambda: np.array_equal(reader.rows(rest)["x"], x[rest])) == 0
    reader.close()
