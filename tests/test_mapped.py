"""Memory-mapped reads of raw local chunk files (`diskreplay.mapped`)."""

import ctypes
import errno
import mmap
import os
import threading
import time

import numpy as np
import pytest

import diskreplay as dr
from diskreplay import storage
from diskreplay.format.schema import Schema
from diskreplay.io import mmap as mapped
from diskreplay.storage import mapped as mapped_chunks
from diskreplay.storage import warm
from diskreplay.storage.chunk_io import ChunkIO

FIELDS = {"obs": dr.Field((3,), "float32"), "flag": dr.Field((), "bool"), "img": dr.Field((2, 5), "uint8")}


def rows(first, n):
    i = np.arange(first, first + n)
    return {"obs": np.stack([i, -i, i * 0.5], axis=1).astype(np.float32), "flag": i % 3 == 0,
            "img": (i[:, None, None] + np.arange(10).reshape(2, 5)).astype(np.uint8)}


def check(buf, ids):
    got = buf[ids]
    want = rows(0, int(ids.max()) + 1)
    for name in FIELDS:
        np.testing.assert_array_equal(got[name], want[name][ids])


def test_mapping_is_chosen_only_where_it_is_faster(tmp_path):
    url = str(tmp_path / "b")
    with dr.ReplayBuffer.create(url, FIELDS, capacity=4096, chunk_rows=64, compression=None) as buf:
        buf.extend(rows(0, 4096))
    assert not dr.ReplayBuffer.open(url).stats().mapped  # fits the default cache
    assert dr.ReplayBuffer.open(url, cache_bytes=1024).stats().mapped
    assert dr.ReplayBuffer.open(url, memory_map=True).stats().mapped
    zstd = str(tmp_path / "z")
    dr.ReplayBuffer.create(zstd, FIELDS, capacity=64, compression="zstd").close()
    assert not dr.ReplayBuffer.open(zstd, memory_map=True).stats().mapped


def test_first_read_of_rows_that_fit_the_cache_loads_every_chunk(tmp_path):
    url = str(tmp_path / "b")
    with dr.ReplayBuffer.create(url, FIELDS, capacity=4000, chunk_rows=64, compression="zstd") as buf:
        buf.extend(rows(0, 4000))
    reader = dr.ReplayBuffer.open(url)
    check(reader, np.array([7]))  # its chunk loaded into its home slot; the fill of the others started behind it
    reader.warm()
    stats = reader.stats()
    assert stats.cached_chunks == 63 and stats.resident  # every chunk, in its home slot
    check(reader, reader.row_ids())
    assert reader.stats().chunks_loaded == 63  # every chunk, read once
    small = dr.ReplayBuffer.open(url, cache_bytes=16 * 64 * 23)  # 16 of the 63 chunks: loaded as read
    check(small, np.array([7]))
    assert small.stats().cached_chunks == 1


@pytest.mark.parametrize("capacity", [None, 1000])
def test_mapped_reads_equal_what_was_written(tmp_path, capacity):
    url = str(tmp_path / "b")
    buf = dr.ReplayBuffer.create(url, FIELDS, capacity=capacity, chunk_rows=48, compression=None,
                                 memory_map=True, seed=0)
    added = 0
    for n in (7, 300, 1, 1200, 333):
        buf.extend(rows(added, n))
        added += n
        check(buf, buf.row_ids())  # staged tail from the cache, written chunks from the maps
        buf.flush()
        check(buf, buf.row_ids())
    batch = buf.sample(500, seed=1)
    np.testing.assert_array_equal(batch["obs"], rows(0, added)["obs"][batch["index"]])
    buf.close()
    reader = dr.ReplayBuffer.open(url, memory_map=True)
    check(reader, reader.row_ids())


def test_reader_remaps_chunks_the_writer_rewrote(tmp_path):
    url = str(tmp_path / "b")
    writer = dr.ReplayBuffer.create(url, FIELDS, capacity=200, chunk_rows=32, compression=None)
    writer.extend(rows(0, 150))
    writer.flush()
    reader = dr.ReplayBuffer.open(url, memory_map=True)
    check(reader, reader.row_ids())  # maps every chunk, the partial tail included
    writer.extend(rows(150, 230))  # rewrites the tail chunk and wraps the ring
    writer.flush()
    assert reader.refresh()
    ids = reader.row_ids()
    assert ids.min() == 180 and ids.max() == 379
    check(reader, ids)


def test_dataset_mode_grows_past_the_reservation(tmp_path, monkeypatch):
    monkeypatch.setattr(mapped_chunks, "DATASET_CHUNKS", 4)
    url = str(tmp_path / "b")
    buf = dr.ReplayBuffer.create(url, FIELDS, chunk_rows=8, compression=None, memory_map=True)
    reader = dr.ReplayBuffer.open(url, memory_map=True)
    for start in range(0, 200, 25):
        buf.extend(rows(start, 25))
        buf.flush()
        check(buf, buf.row_ids())
        reader.refresh()
        check(reader, reader.row_ids())
    assert reader.storage.mapped.chunks >= 25


def maps_of_this_process():
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def test_reads_stay_correct_within_a_small_map_budget(tmp_path):
    url = str(tmp_path / "b")
    with dr.ReplayBuffer.create(url, FIELDS, capacity=6400, chunk_rows=64, compression=None) as buf:
        buf.extend(rows(0, 6400))  # 100 chunks of 3 fields
    reader = dr.ReplayBuffer.open(url, memory_map=True)
    reader.storage._reader.warmer.pending = False  # no first-read fill: chunks are mapped as read
    chunks = reader.storage.mapped
    chunks.budget = 40
    unmap_all, drops = chunks.unmap_all, []
    chunks.unmap_all = lambda: (drops.append(chunks.maps), unmap_all())
    before = maps_of_this_process()
    for seed in range(20):
        batch = reader.sample(16, seed=seed)  # 16 rows touch at most 16 chunks: mapped
        np.testing.assert_array_equal(batch["img"], rows(0, 6400)["img"][batch["index"]])
        assert chunks.maps <= 40
    assert drops and max(drops) <= 40  # the budget was reached, and every map dropped then
    assert maps_of_this_process() - before <= 2 * 3 * 40 + 3  # each chunk: its file's map + a split
    batch = reader.sample(256, seed=99)  # touches more chunks than the budget: read through the cache
    np.testing.assert_array_equal(batch["obs"], rows(0, 6400)["obs"][batch["index"]])
    assert reader.stats().cached_chunks > 40


def test_map_budget_is_a_share_of_the_maps_left():
    with open("/proc/sys/vm/max_map_count") as f:
        limit = int(f.read())
    left = limit - maps_of_this_process()
    assert abs(mapped.map_budget(5) - left // 2 // 5) <= 1  # a map per chunk per field
    assert abs(mapped.map_budget(1) - left // 2) <= 1


def test_missing_or_short_chunk_file_is_an_error_not_a_crash(tmp_path):
    url = str(tmp_path / "b")
    with dr.ReplayBuffer.create(url, FIELDS, capacity=256, chunk_rows=32, compression=None) as buf:
        buf.extend(rows(0, 256))
    os.remove(os.path.join(url, "obs", "c.0.2.0"))
    with open(os.path.join(url, "flag", "c.0.5"), "r+b") as f:
        f.truncate(10)
    reader = dr.ReplayBuffer.open(url, memory_map=True)
    with pytest.raises(dr.CorruptBufferError, match=r"chunk 'obs/c.0.2.0' is missing"):
        reader[[70]]
    with pytest.raises(dr.CorruptBufferError, match=r"chunk 'flag/c.0.5' has 10 bytes, expected 36"):
        reader[[5 * 32 + 1]]
    check(reader, np.arange(0, 64))  # other chunks still read


def test_a_refused_map_drops_every_map_and_reads_on(tmp_path, monkeypatch):
    url = str(tmp_path / "b")
    with dr.ReplayBuffer.create(url, FIELDS, capacity=6400, chunk_rows=64, compression=None) as buf:
        buf.extend(rows(0, 6400))
    reader = dr.ReplayBuffer.open(url, memory_map=True)
    reader.storage._reader.warmer.pending = False
    calls = []
    map_file = mapped.Reservation.map_file

    def refuse_the_tenth(region, slot, fd, random):
        calls.append(slot)
        if len(calls) == 10:
            raise OSError(errno.ENOMEM, "Cannot allocate memory")
        map_file(region, slot, fd, random)
    monkeypatch.setattr(mapped.Reservation, "map_file", refuse_the_tenth)
    drops = []
    unmap_all = reader.storage.mapped.unmap_all
    monkeypatch.setattr(reader.storage.mapped, "unmap_all", lambda: (drops.append(1), unmap_all()))
    batch = reader.sample(64, seed=3)
    np.testing.assert_array_equal(batch["obs"], rows(0, 6400)["obs"][batch["index"]])
    assert drops == [1] and reader.storage.mapped.maps == len(np.unique(batch["index"] // 64))


SMALL = {"obs": dr.Field((17,), "float32"), "action": dr.Field((6,), "float32"), "reward": dr.Field((), "float32"),
         "next_obs": dr.Field((17,), "float32"), "done": dr.Field((), "bool")}


@pytest.mark.parametrize("capacity, num_envs, cache_bytes, expected", [
    (1_000_000, 1, 512 << 20, 4096),  # 245 chunks x 5 fields
    (50_000_000, 1, 512 << 20, 16384),  # 12,208 chunks at 4,096 rows: 15,260 files at 16,384
    (200_000_000, 1, 512 << 20, 65536),
    (200_000_000, 1, 40 << 20, 32768),  # a writer's staging (4 chunks) must fit the cache
    (50_000_000, 10, 512 << 20, 16384),
    (None, 1, 512 << 20, 4096),  # dataset mode: the size is unknown
])
def test_default_chunk_rows_keep_big_buffers_mappable(capacity, num_envs, cache_bytes, expected):
    schema = Schema(SMALL)
    assert storage.default_chunk_rows(schema, num_envs, capacity, cache_bytes) == expected


@pytest.mark.parametrize("fields, num_envs, cache_bytes, expected", [
    (SMALL, 1, 512 << 20, 32768),  # 8 x 4,096 rows of 165 B: 5.4 MB chunks
    (SMALL, 64, 512 << 20, 8192),  # a writer's 130 staged chunks in half the cache
    (SMALL, 1, 40 << 20, 16384),
    (SMALL, 1, 2 << 20, 4096),  # never shorter than on local disk
    ({"frame": dr.Field((84, 84), "uint8")}, 1, 512 << 20, 1024),  # 128 locally
])
def test_default_chunk_rows_on_object_stores_are_longer(fields, num_envs, cache_bytes, expected):
    schema = Schema(fields)
    local = storage.default_chunk_rows(schema, num_envs, None, cache_bytes)
    assert storage.default_chunk_rows(schema, num_envs, None, cache_bytes, remote=True) == expected
    assert storage.default_chunk_rows(schema, num_envs, 10**6, cache_bytes, False, remote=True) == expected
    assert local == (4096 if fields is SMALL else 128)


def test_create_picks_the_default_chunk_rows(tmp_path):
    buf = dr.ReplayBuffer.create(str(tmp_path / "b"), FIELDS, capacity=40_000_000, compression=None)
    assert buf.storage.layout.chunk_rows == 8192  # 4,883 chunks x 3 fields
    assert dr.ReplayBuffer.create(str(tmp_path / "c"), FIELDS, capacity=100).storage.layout.chunk_rows == 100


def test_first_read_maps_its_own_chunks_and_the_files_are_read_behind_it(tmp_path):
    url = str(tmp_path / "b")
    with dr.ReplayBuffer.create(url, FIELDS, capacity=1000, chunk_rows=64, compression=None) as buf:
        buf.extend(rows(0, 1000))
    reader = dr.ReplayBuffer.open(url, memory_map=True)
    assert reader.storage.mapped.maps == 0
    check(reader, np.array([5, 70]))
    assert reader.storage.mapped.maps == 2 and reader.storage.mapped.prefetch_pages  # its pages asked for first
    reader.warm()  # the page cache holds every file (below); a read asks for its pages no more
    assert reader.storage.mapped.maps == 2 and not reader.storage.mapped.prefetch_pages
    check(reader, reader.row_ids())
    assert reader.storage.mapped.maps == 16 and not reader.storage.mapped.unmapped


@pytest.mark.parametrize("memory_map", [True, False])
def test_a_ring_reader_whose_writer_moved_on_before_its_first_read_reads_its_own_rows(tmp_path, memory_map):
    url = str(tmp_path / "b")
    writer = dr.ReplayBuffer.create(url, FIELDS, capacity=256, chunk_rows=32, compression=None)
    writer.extend(rows(0, 256))
    writer.flush()
    reader = dr.ReplayBuffer.open(url, memory_map=memory_map)  # False: rows read straight from the files
    writer.extend(rows(256, 100))  # rewrites chunks 0-3 of the ring
    writer.flush()
    batch = reader.sample(200, seed=0)  # stale rows are found, the reader adopts the newest commit
    np.testing.assert_array_equal(batch["obs"], rows(0, 356)["obs"][batch["index"]])
    assert reader.stats().commit_sequence == writer.stats().commit_sequence


@pytest.mark.parametrize("capacity", [600, None])
def test_a_reader_whose_window_fits_the_cache_reads_it_in_lane_major_order(tmp_path, capacity):
    url = str(tmp_path / "b")
    writer = dr.ReplayBuffer.create(url, FIELDS, capacity=capacity, num_envs=3, chunk_rows=32, compression="lz4")
    data = rows(0, 3 * 700)
    lane_major = {k: v.reshape(700, 3, *v.shape[1:]) for k, v in data.items()}
    writer.extend({k: v[:400] for k, v in lane_major.items()})
    writer.flush()
    reader = dr.ReplayBuffer.open(url)
    ids = reader.row_ids()
    got = reader[ids]
    assert reader.storage._reader.warmer.resident_span is None  # the fill runs behind the first read
    reader.warm()
    width = 7 if capacity else 16  # a ring's 7 chunks per lane; 13 in dataset mode, room for 16
    assert reader.storage._reader.warmer.resident_span == width * 32
    np.testing.assert_array_equal(got["img"], data["img"][ids])
    end = 700 if capacity else 500  # the ring wraps; the dataset grows within its room
    writer.extend({k: v[400:end] for k, v in lane_major.items()})
    writer.flush()
    assert reader.refresh() and not reader.stats().resident
    ids = reader.row_ids()
    batch = reader.sample(500, seed=1)
    np.testing.assert_array_equal(reader[ids]["obs"], data["obs"][ids])
    np.testing.assert_array_equal(batch["flag"], data["flag"][batch["index"]])
    reader.warm()
    assert reader.storage._reader.warmer.resident_span == width * 32


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


def chunk_files(url):
    return sorted(os.path.join(root, n) for root, _, names in os.walk(url) for n in names if n.startswith("c."))


def cached_pages(path):
    """(pages of the file in the OS page cache, pages of the file), from mincore(2)."""
    size = os.path.getsize(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        address = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        pages = -(-size // mmap.PAGESIZE)
        vector = ctypes.create_string_buffer(pages)
        assert _libc.mincore(address, size, vector) == 0
        _libc.munmap(address, size)
    finally:
        os.close(fd)
    return sum(b & 1 for b in vector.raw), pages


def evict(url):
    os.sync()
    for path in chunk_files(url):
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


@pytest.mark.parametrize("memory_map", [None, True])
def test_the_first_read_of_an_evicted_buffer_reads_its_rows_and_brings_every_file_close_behind_it(tmp_path,
                                                                                                   memory_map):
    url = str(tmp_path / "b")
    with dr.ReplayBuffer.create(url, FIELDS, capacity=64 * 40, chunk_rows=64, compression=None) as buf:
        buf.extend(rows(0, 64 * 40))
    evict(url)
    files = chunk_files(url)
    assert len(files) == 3 * 40 and sum(cached_pages(f)[0] for f in files) < len(files)
    reader = dr.ReplayBuffer.open(url, memory_map=memory_map)
    check(reader, np.array([3, 4, 700]))  # rows of two chunks
    stats = reader.stats()
    if memory_map:
        assert stats.maps == 2 and stats.rows_read_directly == 0
    else:  # read straight from the chunk files: a range per chunk and field
        assert (stats.rows_read_directly, stats.ranges_read, stats.chunks_loaded, stats.cached_chunks) == (3, 6, 40, 0)
    reader.warm()
    assert [cached_pages(f)[0] for f in files] == [cached_pages(f)[1] for f in files]
    assert reader.stats().cached_chunks == (0 if memory_map else 40)
    check(reader, reader.row_ids())
    assert reader.stats().rows_read_directly == (0 if memory_map else 3)


def test_the_first_read_of_a_row_shards_buffer_decodes_inner_chunks(tmp_path):
    """By default (``row_shards=True``) the compressed fields of small rows are shards of 512-row inner chunks
    (a chunk holds four); a fresh reader's first read decodes the inner chunks of its rows (the
    shard indexes from the tables the writer's close left) and small chunks whole, then the fill
    brings every chunk; the arrays stay standard Zarr and verify."""
    import zarr

    from diskreplay.audit import verify

    url = str(tmp_path / "b")
    with dr.ReplayBuffer.create(url, FIELDS, capacity=None, chunk_rows=2048, compression="zstd") as buf:
        buf.extend(rows(0, 3 * 2048))
    reader = dr.ReplayBuffer.open(url)
    assert {name: codec.inner_rows for name, codec in reader.storage.codecs.items()} == {
        "obs": 512, "flag": None, "img": 512}
    check(reader, np.array([3, 4, 5000]))  # rows of chunks 0 and 2
    stats = reader.stats()
    assert (stats.rows_read_directly, stats.ranges_read) == (3, 2 * 2 + 2)  # obs, img: 2 inner chunks each
    reader.warm()
    assert reader.stats().cached_chunks == 3
    check(reader, reader.row_ids())
    assert reader.stats().rows_read_directly == 3
    np.testing.assert_array_equal(zarr.open_array(f"{url}/obs", mode="r")[0], rows(0, 3 * 2048)["obs"])
    assert verify(url).ok


def test_a_buffer_larger_than_half_the_ram_is_read_page_by_page(tmp_path, monkeypatch):
    url = str(tmp_path / "b")
    n = 4096 * 10  # chunk files of 12, 1 and 10 pages
    with dr.ReplayBuffer.create(url, FIELDS, capacity=n, chunk_rows=4096, compression=None) as buf:
        buf.extend(rows(0, n))
    monkeypatch.setattr(warm, "physical_memory", lambda: 1 << 16)  # "RAM" of 64 KiB
    evict(url)
    reader = dr.ReplayBuffer.open(url, memory_map=True)
    advised = []
    prefetch = mapped.Reservation.prefetch
    monkeypatch.setattr(mapped.Reservation, "prefetch",
                        lambda region, at: (advised.append(len(at)), prefetch(region, at)))
    batch = reader.sample(8, seed=0)
    np.testing.assert_array_equal(batch["img"], rows(0, n)["img"][batch["index"]])
    assert advised == [8, 8, 8]  # each field's pages asked for before the batch is read
    cached = sum(cached_pages(f)[0] for f in chunk_files(url))
    assert 0 < cached <= 3 * 8 * 2  # the pages of 8 rows (a row may straddle two), not whole files


def test_a_forked_child_fills_its_own_cache_when_the_parents_fill_is_still_running(tmp_path, monkeypatch):
    """A child forked while its parent's fill runs inherits the fill but not its thread: it
    forgets it and fills again itself (else it would wait for it forever)."""
    url = str(tmp_path / "b")
    with dr.ReplayBuffer.create(url, FIELDS, capacity=1000, chunk_rows=64, compression="zstd") as buf:
        buf.extend(rows(0, 1000))
    reader = dr.ReplayBuffer.open(url)
    parent, release = os.getpid(), threading.Event()
    read_here = ChunkIO.read_here

    def held_in_the_parent(io, work):
        if os.getpid() == parent:
            release.wait()
        return read_here(io, work)

    monkeypatch.setattr(ChunkIO, "read_here", held_in_the_parent)
    check(reader, np.array([5]))  # the fill starts behind this read, and waits
    child = os.fork()
    if child == 0:
        try:
            reader.warm()
            check(reader, reader.row_ids())
            os._exit(0 if reader.stats().resident else 1)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(child, 0)
    release.set()
    assert os.waitstatus_to_exitcode(status) == 0
    reader.warm()
    assert reader.stats().resident
    check(reader, reader.row_ids())


def test_a_refresh_does_not_wait_for_a_running_fill(tmp_path, monkeypatch):
    """A reader whose fill job is still reading (a remote one takes seconds) refreshes onto a new
    commit at once: the fill goes on, its copy of the chunk the writer rewrote is forgotten when
    it lands, and the next fill brings the new one; reads are right throughout."""
    import threading

    from diskreplay.storage.chunk_io import ChunkIO

    url = str(tmp_path / "b")
    writer = dr.ReplayBuffer.create(url, FIELDS, capacity=None, chunk_rows=64, compression="zstd")
    writer.extend(rows(0, 64 * 10 + 5))
    writer.flush()
    reader = dr.ReplayBuffer.open(url)
    release, entered, ended = threading.Event(), threading.Event(), threading.Event()
    read_here = ChunkIO.read_here

    def held(self, work):
        entered.set()
        release.wait(60)  # a safety bound: the test sets it first
        try:
            return read_here(self, work)
        finally:
            ended.set()
    monkeypatch.setattr(ChunkIO, "read_here", held)
    check(reader, np.array([3]))  # the fill starts behind this read, and its job is held
    assert entered.wait(60)
    writer.extend(rows(64 * 10 + 5, 30))  # rewrites the tail chunk the reader holds
    writer.flush()
    reader.refresh()
    assert not ended.is_set()  # the refresh did not wait for the job
    check(reader, np.array([3, 64 * 10 + 20]))
    release.set()
    monkeypatch.setattr(ChunkIO, "read_here", read_here)
    reader.warm()
    assert reader.stats().cached_chunks == 11
    check(reader, reader.row_ids())
    assert reader.stats().resident
    reader.close()
    writer.close()


class FakeClock:
    """`time` for the page-in: sleeping moves the clock, nothing waits."""

    def __init__(self):
        self.now = 0.0

    def monotonic(self):
        return self.now

    def sleep(self, seconds):
        self.now += seconds


class RecordingStore:
    """Records when each piece is asked for; reading a file takes a second of the clock."""

    def __init__(self, clock):
        self.clock, self.calls = clock, []

    def prefetch(self, keys):
        self.calls.append((round(self.clock.now, 2), list(keys)))

    def get(self, key):
        self.clock.now += 1.0

    def path(self, key):
        return key


@pytest.mark.parametrize("reading", [False, True])
def test_a_page_in_gives_way_to_reads_for_as_long_as_its_last_piece_took(monkeypatch, reading):
    """A piece of files being read into the page cache delays the reads queued behind it on the disk."""
    clock = FakeClock()
    monkeypatch.setattr(warm, "time", clock)
    monkeypatch.setattr(warm, "in_page_cache", lambda path: path == "in")
    store, reads = RecordingStore(clock), warm.ReadActivity()
    if reading:
        reads.start()  # a read runs throughout
    warm.page_in(store, [["a", "b"], ["in"], ["c"], ["d"]], reads)  # "in": in the page cache already
    # before: every file asked for at once, whatever the reads
    assert store.calls == ([(0.0, ["a", "b"]), (4.0, ["c"]), (6.0, ["d"])] if reading else
                           [(0.0, ["a", "b"]), (2.0, ["c"]), (3.0, ["d"])])

    store, reads = RecordingStore(clock), warm.ReadActivity()
    reads.start(waits=False)  # an epoch's read: in file order, as the page-in reads
    warm.page_in(store, [["a"], ["b"]], reads)
    assert [keys for _, keys in store.calls] == ([["a"], ["b"]])
    store = RecordingStore(clock)
    reads.closed = True
    warm.page_in(store, [["a"]], reads)
    assert store.calls == []


def test_a_mapped_reader_pages_its_files_in_by_pieces(tmp_path, monkeypatch):
    url = str(tmp_path / "b")
    with dr.ReplayBuffer.create(url, FIELDS, capacity=None, chunk_rows=64, compression=None) as buf:
        buf.extend(rows(0, 64 * 40))
    evict(url)
    reader = dr.ReplayBuffer.open(url, memory_map=True)
    monkeypatch.setattr(warm, "PAGE_IN_BYTES", 4 * 64 * reader.storage.schema.row_bytes)
    pieces, prefetch = [], reader.storage.store.prefetch

    def recorded(keys):
        if threading.current_thread().name.startswith("diskreplay-fill"):
            pieces.append(list(keys))
        prefetch(keys)
    monkeypatch.setattr(reader.storage.store, "prefetch", recorded)
    check(reader, np.array([3, 700]))
    reader.warm()
    assert [len(piece) for piece in pieces] == [4 * 3] * 10  # 4 chunks of 3 fields each
    assert sorted(key for piece in pieces for key in piece) == sorted(
        os.path.relpath(f, url) for f in chunk_files(url))
    # before: one piece of every file, asked of the OS at once


def test_prefetch_asks_for_each_run_of_consecutive_pages_at_once(monkeypatch):
    region = mapped.Reservation(np.dtype(np.float32), (256,), 64, 4)  # rows of 1 KiB, 4 to a page
    calls = []
    monkeypatch.setattr(mapped, "_libc", type("Libc", (), {"madvise": lambda self, *a: calls.append(a[:2])})())
    page = mmap.PAGESIZE
    region.prefetch(np.array([0, 1, 2, 3, 4, 5, 6, 7, 8, 40, 41, 200]))  # pages 0-2, then 10, then 50
    assert calls == [(region.base, 3 * page), (region.base + 10 * page, page), (region.base + 50 * page, page)]
    monkeypatch.undo()
    region.close()


def test_whether_a_file_is_in_the_page_cache(tmp_path):
    path = tmp_path / "a"
    path.write_bytes(os.urandom(5 * mmap.PAGESIZE + 7))
    (tmp_path / "empty").write_bytes(b"")
    path.read_bytes()
    assert mapped.cached(str(path)) and mapped.cached(str(tmp_path / "empty"))
    assert not mapped.cached(str(tmp_path / "missing"))
    os.sync()
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    assert not mapped.cached(str(path))
