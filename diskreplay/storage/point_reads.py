"""`PointReads`: rows read straight from their chunk objects, never whole chunks.

A raw chunk object holds its rows' values one row after another (then a checksum); a sharded one
(compressed images, `Codec.inner_rows`) an index of its inner chunks, then each inner chunk
compressed and checksummed alone. A reader that misses rows its cache does not hold (a cold read
from an object store, or from local disk while the first-read fill runs behind it, `Warmer`),
few in their chunks (`PointReads.sparse`; denser reads load the chunks whole), reads just their
bytes: a byte range per run of nearby raw rows of one object, an inner chunk per
sharded row (its shard's index read once and kept, until the chunk is rewritten: `forget`), every
range of a read at once (`ChunkStore.get_ranges`: ranged GETs in flight on an object store,
``pread`` locally, each range asked of the OS first). Nothing else is cached.

What is read is checked before use: each object must have its chunk's size where the store says
it, each range must come back whole, an index and each inner chunk must match their checksums,
and a raw run over half its chunk or more reads the chunk whole and checks its checksum. The
checksum of a raw chunk read in part is checked where the chunk is read whole (the fill, an
epoch, `verify`), as with memory-mapped reads.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..errors import CorruptBufferError
from ..format.codecs import CHECKSUM_BYTES, EMPTY_INNER, INNER_CHUNK_BYTES, SMALL_ROWS_INNER, Codec, checksum
from ..io.store import Range, Ranged
from .chunk_io import ChunkIO
from .outputs import Rows
from .shard_tables import TabledIndexes, Tables

SMALL_CHUNK_BYTES = SMALL_ROWS_INNER * INNER_CHUNK_BYTES
"""A compressed field whose chunks hold at most this many bytes is not sharded (`inner_rows_for`):
a point read fetches its chunk whole, as cheap as a shard's index."""
DENSE_SHARE = 64
"""Rows missed in a chunk, on average, from which a read loads its chunks whole instead (into
the cache): one ``1 / DENSE_SHARE`` of a chunk's rows, at least `DENSE_ROWS`, touch most of its
inner chunks (64-row inner chunks: about 63%), and a chunk's one request costs less than theirs."""
DENSE_ROWS = 4
FRESH_TRIES = 3
"""Reads of a live buffer's inner chunks through shard indexes read anew each time (`PointReads._fresh`)
before damage they find is reported."""
GAP_BYTES = 4096
"""Ranges of one object at most this many bytes apart are read as one range (at least; see
`gap_bytes`): a request costs more than that many bytes (a page locally, a round trip remotely)."""
GAP_SHARE = 8
"""On an object store, ranges at most ``1 / GAP_SHARE`` of a request's cost in bytes apart
(`ChunkStore.request_bytes`) are read as one: each join saves a request for a fraction of what
it costs, and the bytes fetched stay a small multiple of those asked."""

InnerPlan = tuple[np.ndarray, list[Range], np.ndarray]
"""A sharded field's reads for rows sorted by (lane, chunk, offset): each row's inner chunk
among those read, their ranges, and which of them are stored (not empty)."""
Plan = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]
"""A field's ranges for rows sorted by (lane, chunk, offset): each row's range, each range's
first row, and its bytes ``[start, stop)`` in its chunk object."""


class PointReads:
    """Targeted reads of the raw, sharded and small compressed fields (`read`; sharded ones also
    `decode`) of one buffer; counts what they read."""

    def __init__(self, io: ChunkIO, chunk_rows: int, tables: Tables | None = None):
        """``tables``: read before the first shard index would be (None: no table)."""
        self.io, self.chunk_rows = io, chunk_rows
        self.gap = gap_bytes(io.store.request_bytes)
        """Ranges of one object at most this many bytes apart are read as one."""
        self.raw = frozenset(name for name, codec in io.codecs.items() if codec.raw and codec.inner_rows is None)
        self.sharded = frozenset(name for name, codec in io.codecs.items() if codec.inner_rows is not None)
        self.tabled = TabledIndexes(tables, tuple(self.sharded))
        self.small = frozenset(name for name, codec in io.codecs.items() if not codec.raw and codec.inner_rows is None
                               and chunk_rows * io.schema[name].row_bytes <= SMALL_CHUNK_BYTES)
        self.indexes: dict[tuple[str, int, int], np.ndarray] = {}
        """Each read shard's inner chunks: ``(offset, nbytes)`` rows, -1 where stored empty."""
        self.rows_read = 0
        """Rows (of every field asked) read this way so far."""
        self.ranges_read = 0
        """Byte ranges read so far (one request each on an object store), indexes included."""

    def covers(self, names: tuple[str, ...]) -> bool:
        """Whether `read` reads the rows of ``names``: every field raw, sharded or small, and not
        all small (their chunks are loaded whole into the cache as cheaply)."""
        return (self.raw | self.sharded | self.small).issuperset(names) and not self.small.issuperset(names)

    def sparse(self, names: tuple[str, ...], lane: np.ndarray, chunk: np.ndarray) -> bool:
        """Whether the rows of ``names`` at (lane, chunk) are few enough in their chunks to read
        one by one: fewer per chunk than one `DENSE_SHARE` of its rows (`DENSE_ROWS` at least), and
        than make a range per row and field cost as much as the chunk whole and a request per
        field, a request costing the store's ``request_bytes`` (through obstore: from 8 rows of a
        chunk of 8 MiB of five fields; from 2 rows of a chunk smaller than a request)."""
        touched = len(np.unique(lane * (int(chunk.max(initial=0)) + 1) + chunk))
        whole = self.chunk_rows * sum(self.io.schema[name].row_bytes for name in names)
        requests = len(names) * self.io.store.request_bytes
        return (len(chunk) < touched * max(self.chunk_rows // DENSE_SHARE, DENSE_ROWS)
                and len(chunk) * requests < touched * (requests + whole))

    def forget(self, lane: int, chunks: np.ndarray) -> None:
        """These chunks were rewritten: read their shard indexes again."""
        gone = set(chunks.tolist())
        for key in [key for key in self.indexes if key[1] == lane and key[2] in gone]:
            del self.indexes[key]
        self.tabled.forget(lane, chunks)

    def read(self, lane: np.ndarray, chunk: np.ndarray, offset: np.ndarray, out: Rows) -> None:
        """The rows at (lane, chunk, offset) of every field of ``out`` (raw, sharded or small:
        `covers`) into it: the raw fields' ranges, the shard indexes not kept yet and the small
        chunks whole in one round of requests, then the inner chunks of the sharded fields' rows
        in another (in the first, where every index they need is kept).

        Raises CorruptBufferError naming a chunk object that is missing, has the wrong size,
        ends before the rows or fails its checksum, or a shard whose index or inner chunk is bad."""
        order = np.lexsort((offset, chunk, lane))
        lane, chunk, offset = lane[order], chunk[order], offset[order]
        plans = {name: self._plan(name, lane, chunk, offset) for name in out if name in self.raw}
        asked = {name: self._ranges(name, lane, chunk, plan) for name, plan in plans.items()}
        heads = {name: self._index_ranges(name, lane, chunk) for name in out if name in self.sharded}
        wholes = {name: self._whole_ranges(name, lane, chunk) for name in out if name in self.small}
        names = tuple(heads)
        inner = self._inner_plan(names, lane, chunk, offset) if names and not any(heads.values()) else {}
        early = [one for _, ranges, _ in inner.values() for one in ranges]
        found = iter(self._get([one for ranges in (*asked.values(), *(h.values() for h in heads.values()),
                                                   *wholes.values(), early) for one in ranges]))
        self.rows_read += len(order)
        for name, plan in plans.items():
            got = [next(found) for _ in asked[name]]
            out[name].reshape(len(order), -1).view(np.uint8)[order] = self._take_raw(name, plan, offset, asked[name],
                                                                                     got)
        for name, ranges in heads.items():
            self._keep_indexes(name, ranges, [next(found) for _ in ranges])
        for name, whole in wholes.items():
            out[name][order] = self._take_whole(name, whole, [next(found) for _ in whole], lane, chunk, offset)
        read_early: list[list[Ranged | None]] = [[next(found) for _ in early]] if inner else []

        def read_inner() -> None:  # the first try takes the inner chunks read with the rest, if any
            plan = inner if read_early else self._inner_plan(names, lane, chunk, offset)
            data = read_early.pop() if read_early else self._get([one for _, ranges, _ in plan.values()
                                                                  for one in ranges])
            self._take_inner(plan, data, offset, order, out)
        if names and len(order):
            self._fresh(names, lane, chunk, read_inner)

    def _get(self, ranges: list[Range]) -> list[Ranged | None]:
        """Each range's bytes: ranges of one object at most ``gap`` bytes apart read as one
        (a contiguous read's inner chunks, one request for a shard's run of them)."""
        joined, parts = _joined(ranges, self.gap)
        self.ranges_read += len(joined)
        got = self.io.store.get_ranges(joined)
        return [None if (one := got[i]) is None else (one[0][at:at + stop - start], one[1])
                for (_, start, stop), (i, at) in zip(ranges, parts)]

    def _plan(self, name: str, lane: np.ndarray, chunk: np.ndarray, offset: np.ndarray) -> Plan:
        """A raw field's ranges: runs of nearby rows (`_runs`); a run over half its chunk or more
        reads the chunk whole, its checksum with it."""
        run_of, firsts, starts, stops = _runs(lane, chunk, offset, self.io.schema[name].row_bytes, self.gap)
        values = self.chunk_rows * self.io.schema[name].row_bytes
        whole = 2 * (stops - starts) >= values
        starts[whole], stops[whole] = 0, values + self.io.codecs[name].trailer
        return run_of, firsts, starts, stops

    def _ranges(self, name: str, lane: np.ndarray, chunk: np.ndarray, plan: Plan) -> list[Range]:
        _, firsts, starts, stops = plan
        return [(self.io.key(name, ln, ch), start, stop) for ln, ch, start, stop
                in zip(lane[firsts].tolist(), chunk[firsts].tolist(), starts.tolist(), stops.tolist())]

    def _checked(self, asked: Range, ranged: Ranged | None, size: int | None = None) -> bytes:
        """A range's bytes, once the object exists, has ``size`` bytes (where both are known)
        and gave them all."""
        key, start, stop = asked
        if ranged is None:
            raise CorruptBufferError(
                f"{self.io.url!r}: chunk {key!r} is missing, but the last commit says it holds rows")
        data, stored = ranged
        if size is not None and stored not in (size, -1):
            raise CorruptBufferError(f"{self.io.url!r}: chunk {key!r} has {stored} bytes, expected {size}")
        if len(data) != stop - start:
            raise CorruptBufferError(f"{self.io.url!r}: chunk {key!r} ends at byte {start + len(data)}, "
                                     f"before the rows read from it (bytes {start} to {stop})")
        return data

    def _undecodable(self, key: str, exc: ValueError) -> CorruptBufferError:
        return CorruptBufferError(f"{self.io.url!r}: chunk {key!r} does not decode ({exc})")

    # ---- raw fields -----------------------------------------------------------------------

    def _take_raw(self, name: str, plan: Plan, offset: np.ndarray, asked: list[Range],
                  got: list[Ranged | None]) -> np.ndarray:
        """Each row of a raw field (a uint8 row) from its ranges."""
        run_of, _, starts, stops = plan
        row_bytes, trailer = self.io.schema[name].row_bytes, self.io.codecs[name].trailer
        values = self.chunk_rows * row_bytes
        data = np.frombuffer(b"".join(self._raw_range(one, ranged, values, trailer)
                                      for one, ranged in zip(asked, got)), np.uint8)
        base = np.concatenate([[0], np.cumsum(stops - starts)[:-1]])
        at = base[run_of] + offset * row_bytes - starts[run_of]
        rows: np.ndarray = data[at[:, None] + np.arange(row_bytes)]
        return rows

    def _raw_range(self, asked: Range, ranged: Ranged | None, values: int, trailer: int) -> bytes:
        """A raw range's bytes, checked (and a whole chunk against its checksum)."""
        data = self._checked(asked, ranged, values + trailer)
        if trailer and asked[2] == values + trailer and checksum(data[:values]) != data[values:]:
            raise CorruptBufferError(f"{self.io.url!r}: chunk {asked[0]!r} fails its checksum (the file is damaged)")
        return data

    # ---- small compressed fields ----------------------------------------------------------

    def _whole_ranges(self, name: str, lane: np.ndarray, chunk: np.ndarray) -> list[Range]:
        """One range per chunk of these rows (sorted by lane, chunk), past any size its chunk can have."""
        bound = 2 * self.chunk_rows * self.io.schema[name].row_bytes + 4096
        first = np.flatnonzero(_run_starts(lane, chunk))
        return [(self.io.key(name, ln, ch), 0, bound) for ln, ch in zip(lane[first].tolist(), chunk[first].tolist())]

    def _take_whole(self, name: str, asked: list[Range], got: list[Ranged | None], lane: np.ndarray,
                    chunk: np.ndarray, offset: np.ndarray) -> np.ndarray:
        """The rows (sorted by lane, chunk, offset) of a small compressed field from its whole
        chunks: checked and decoded in one batch where each came back whole, else (or where that
        finds damage) one by one, naming what is wrong."""
        f = self.io.schema[name]
        chunks = np.empty((len(asked), self.chunk_rows, *f.shape), f.dtype)
        whole = all(ranged is not None and ranged[1] in (len(ranged[0]), -1) for ranged in got)
        if not (whole and _decoded_together(self.io.codecs[name], got, chunks, np.arange(len(chunks)))):
            self._decode_each(name, asked, got, chunks)
        rows: np.ndarray = chunks[np.cumsum(_run_starts(lane, chunk)) - 1, offset]
        return rows

    def _decode_each(self, name: str, asked: list[Range], got: list[Ranged | None], chunks: np.ndarray) -> None:
        """The whole chunks ``got`` into ``chunks[i]``, one at a time. Raises CorruptBufferError
        naming a chunk that is missing, too long or does not decode."""
        for i, (one, ranged) in enumerate(zip(asked, got)):
            if ranged is None:
                raise CorruptBufferError(f"{self.io.url!r}: chunk {one[0]!r} is missing, but the last commit says "
                                         f"it holds rows")
            data, size = ranged
            if size not in (len(data), -1):
                raise CorruptBufferError(f"{self.io.url!r}: chunk {one[0]!r} has {size} bytes, more than a chunk "
                                         f"of its field can have ({one[2]})")
            try:
                self.io.codecs[name].decode_into(data, chunks[i])
            except ValueError as exc:
                raise self._undecodable(one[0], exc) from None

    # ---- sharded fields -------------------------------------------------------------------

    def ask(self, name: str, lanes: np.ndarray, chunks: np.ndarray, inners: np.ndarray) -> None:
        """Nothing: `decode` reads each field's inner chunks in one round of requests."""

    def decode(self, name: str, lanes: np.ndarray, chunks: np.ndarray, inners: np.ndarray, out: np.ndarray,
               rows: np.ndarray) -> None:
        """Decode inner chunks ``inners[i]`` of chunks ``(lanes[i], chunks[i])`` of the sharded
        field ``name`` into ``out[rows[i]]`` (C-contiguous; one inner chunk's rows each; stored
        empty: zeros), as `ShardMaps.decode` does from mapped files.

        Raises CorruptBufferError: a shard is missing, its index or a span is bad, or an inner
        chunk fails its checksum or does not decode; the message names the chunk."""
        def read() -> None:
            asked, stored = self._inner_ranges(name, lanes, chunks, inners)
            self._decode_inner(name, asked, stored, self._get(asked), out, rows)

        self._keep_all_indexes((name,), lanes, chunks)
        self._fresh((name,), lanes, chunks, read)
        self.rows_read += len(lanes) * (self.io.codecs[name].inner_rows or 1)

    def _fresh(self, names: tuple[str, ...], lanes: np.ndarray, chunks: np.ndarray, read: Callable[[], None]) -> None:
        """``read()`` of inner chunks of ``names`` through the kept shard indexes of these chunks;
        where it finds damage, again (`FRESH_TRIES` in all) with the indexes read anew: a writer
        may have rewritten a chunk (a ring's tail) since, moving its inner chunks. Raises the
        damage found on the last try."""
        for tries_left in range(FRESH_TRIES - 1, -1, -1):
            try:
                return read()
            except CorruptBufferError:
                if not tries_left:
                    raise
                for lane in np.unique(lanes).tolist():
                    self.forget(lane, chunks[lanes == lane])
                self._keep_all_indexes(names, lanes, chunks)

    def _keep_all_indexes(self, names: tuple[str, ...], lanes: np.ndarray, chunks: np.ndarray) -> None:
        """Read and keep, in one round of requests, the shard indexes of these chunks not kept yet."""
        heads = {name: self._index_ranges(name, lanes, chunks) for name in names}
        if not any(heads.values()):
            return
        found = iter(self._get([one for ranges in heads.values() for one in ranges.values()]))
        for name, ranges in heads.items():
            self._keep_indexes(name, ranges, [next(found) for _ in ranges])

    def _inner_plan(self, names: tuple[str, ...], lane: np.ndarray, chunk: np.ndarray,
                    offset: np.ndarray) -> dict[str, InnerPlan]:
        """For rows sorted by (lane, chunk, offset) of the sharded fields ``names``: each inner
        chunk they touch once (their shard indexes kept)."""
        plan = {}
        for name in names:
            inner = offset // int(self.io.codecs[name].inner_rows or 1)
            first = _run_starts(lane, chunk, inner)
            block = np.flatnonzero(first)
            plan[name] = (np.cumsum(first) - 1, *self._inner_ranges(name, lane[block], chunk[block], inner[block]))
        return plan

    def _take_inner(self, plan: dict[str, InnerPlan], got: list[Ranged | None], offset: np.ndarray,
                    order: np.ndarray, out: Rows) -> None:
        """The rows of ``plan``'s fields into ``out`` at ``order``, from the inner chunks read for it."""
        found = iter(got)
        for name, (which, asked, stored) in plan.items():
            inner_rows, f = int(self.io.codecs[name].inner_rows or 1), self.io.schema[name]
            blocks = np.empty((int(which[-1]) + 1, inner_rows, *f.shape), f.dtype)
            self._decode_inner(name, asked, stored, [next(found) for _ in asked], blocks, np.arange(len(blocks)))
            out[name][order] = blocks[which, offset % inner_rows]

    def _index_ranges(self, name: str, lanes: np.ndarray, chunks: np.ndarray) -> dict[tuple[int, int], Range]:
        """The index of every shard of these chunks no read kept yet: ``{(lane, chunk): its range}``."""
        shards = sorted(set(zip(lanes.tolist(), chunks.tolist())))
        self._from_table(name, [(ln, ch) for ln, ch in shards if (name, ln, ch) not in self.indexes])
        head = self.io.codecs[name].index_bytes(self.chunk_rows)
        return {(ln, ch): (self.io.key(name, ln, ch), 0, head) for ln, ch in shards
                if (name, ln, ch) not in self.indexes}

    def _from_table(self, name: str, shards: list[tuple[int, int]]) -> None:
        """Keep the indexes of these shards that ``name``'s table holds, checked (the tables are
        read first, once: `Tables`). Raises CorruptBufferError naming a shard whose index is bad."""
        if not shards:
            return
        lanes, chunks = np.array(shards, np.int64).T
        held, pairs = self.tabled.lookup(name, lanes, chunks)
        lanes, chunks = lanes[held], chunks[held]
        head = self.io.codecs[name].index_bytes(self.chunk_rows)
        try:
            spans = _spans(pairs.reshape(-1, 2), head, -1).reshape(pairs.shape)
        except ValueError:
            for ln, ch, one in zip(lanes.tolist(), chunks.tolist(), pairs):  # name the first bad shard
                try:
                    _spans(one, head, -1)
                except ValueError as exc:
                    raise CorruptBufferError(f"{self.io.url!r}: the shard index table of {name!r} is damaged: "
                                             f"lane {ln}, chunk {ch}: {exc}") from None
            raise
        self.indexes.update(zip(((name, ln, ch) for ln, ch in zip(lanes.tolist(), chunks.tolist())), spans))

    def _keep_indexes(self, name: str, asked: dict[tuple[int, int], Range], got: list[Ranged | None]) -> None:
        """Check and keep the shard indexes read for ``asked``."""
        head = self.io.codecs[name].index_bytes(self.chunk_rows)
        for ((ln, ch), one), ranged in zip(asked.items(), got):
            data = self._checked(one, ranged)
            try:
                entries = self.io.codecs[name].verified_body(data)
                pairs = np.frombuffer(entries, "<u8").reshape(-1, 2)
                self.indexes[name, ln, ch] = _spans(pairs, head, -1 if ranged is None else ranged[1])
            except ValueError as exc:
                raise self._undecodable(one[0], exc) from None

    def _inner_ranges(self, name: str, lanes: np.ndarray, chunks: np.ndarray,
                      inners: np.ndarray) -> tuple[list[Range], np.ndarray]:
        """The ranges of these inner chunks (kept indexes), and which of them are stored (not empty)."""
        spans = np.array([self.indexes[name, ln, ch][i] for ln, ch, i in
                          zip(lanes.tolist(), chunks.tolist(), inners.tolist())], np.int64).reshape(-1, 2)
        stored = np.flatnonzero(spans[:, 0] >= 0)
        asked = [(self.io.key(name, int(lanes[i]), int(chunks[i])), int(spans[i, 0]), int(spans[i, :].sum()))
                 for i in stored.tolist()]
        return asked, stored

    def _decode_inner(self, name: str, asked: list[Range], stored: np.ndarray, got: list[Ranged | None],
                      out: np.ndarray, rows: np.ndarray) -> None:
        """Decode the inner chunks read (``stored`` of ``rows``; the others stored empty: zeros):
        when every range came back whole, joined and checked in one batch; else (or where that
        finds damage) one by one, naming what is wrong."""
        codec = self.io.codecs[name]
        if all(ranged is not None and len(ranged[0]) == stop - start for ranged, (_, start, stop) in zip(got, asked)):
            out.reshape(len(out), -1)[rows[np.setdiff1d(np.arange(len(rows)), stored)]] = 0
            if _decoded_together(codec, got, out, rows[stored]):
                return
        bodies: list[bytes | memoryview | None] = [None] * len(rows)
        for i, one, ranged in zip(stored.tolist(), asked, got):
            bodies[i] = self._body(codec, one, ranged)
        try:
            codec.decode_bodies(bodies, out, rows)
        except ValueError as exc:
            raise self._undecodable(asked[0][0] if asked else name, exc) from None

    def _body(self, codec: Codec, asked: Range, ranged: Ranged | None) -> bytes | memoryview:
        try:
            return codec.verified_body(self._checked(asked, ranged))
        except ValueError as exc:
            raise self._undecodable(asked[0], exc) from None

    def close(self) -> None:
        """Nothing to release (`RowReads` closes its maps)."""


def _decoded_together(codec: Codec, got: list[Ranged | None], out: np.ndarray, rows: np.ndarray) -> bool:
    """Whether the bodies ``got`` (each present and longer than a checksum; whole chunks or
    inner chunks, as the caller checked) were checked and decoded into ``out[rows[i]]`` in one
    batch; False, and ``out`` partly written, where one is not or does not decode (the caller
    then decodes them one by one, naming what is wrong)."""
    bodies = [ranged[0] for ranged in got if ranged is not None]
    if not bodies or len(bodies) < len(got) or min(len(body) for body in bodies) <= CHECKSUM_BYTES:
        return False
    lengths = np.array([len(body) for body in bodies], np.int64)
    try:
        codec.decode_stored(b"".join(bodies), np.concatenate([[0], np.cumsum(lengths)[:-1]]), lengths, out, rows)
    except ValueError:
        return False
    return True


def _spans(pairs: np.ndarray, index_bytes: int, size: int) -> np.ndarray:
    """A shard index's ``(offset, nbytes)`` uint64 pairs as int64 rows, -1 for stored-empty inner
    chunks, each checked to lie in the object's data (``size`` bytes, -1: unknown). Raises ValueError."""
    empty = (pairs == EMPTY_INNER).all(axis=1)
    big = (pairs[~empty] >= 1 << 62).any(axis=1)
    spans = np.where(empty[:, None], -1, np.minimum(pairs, 1 << 62).astype(np.int64))
    offset, nbytes = spans[~empty, 0], spans[~empty, 1]
    bad = big | (offset < index_bytes) | (nbytes <= 4) | ((size >= 0) & (offset + nbytes > size))
    if bad.any():
        i = int(np.flatnonzero(~empty)[np.argmax(bad)])
        raise ValueError(f"inner chunk {i}: span {tuple(pairs[i].tolist())} outside the shard's data")
    return spans


def gap_bytes(request_bytes: int) -> int:
    """How far apart ranges of one object may lie to be read as one, on a store where a request
    costs ``request_bytes`` (`ChunkStore.request_bytes`): 4 KiB locally, 32 KiB through obstore,
    64 KiB through s3fs."""
    return max(GAP_BYTES, request_bytes // GAP_SHARE)


def _joined(ranges: list[Range], gap: int) -> tuple[list[Range], list[tuple[int, int]]]:
    """``ranges`` joined where they lie in one object at most ``gap`` bytes apart (or overlap),
    and where each lies in the joined ones: ``(joined range, offset in it)``."""
    joined: list[Range] = []
    parts: list[tuple[int, int]] = [(0, 0)] * len(ranges)
    for i in sorted(range(len(ranges)), key=lambda i: ranges[i]):
        key, start, stop = ranges[i]
        if joined and joined[-1][0] == key and start - joined[-1][2] <= gap:
            head = joined[-1]
            joined[-1] = (key, head[1], max(head[2], stop))
        else:
            joined.append((key, start, stop))
        parts[i] = (len(joined) - 1, start - joined[-1][1])
    return joined, parts


def _run_starts(*keys: np.ndarray) -> np.ndarray:
    """Of rows sorted by ``keys``, those whose keys differ from the row's before (the first: True)."""
    new = np.ones(len(keys[0]), bool)
    if len(new) > 1:
        new[1:] = np.logical_or.reduce([key[1:] != key[:-1] for key in keys])
    return new


def _runs(lane: np.ndarray, chunk: np.ndarray, offset: np.ndarray, row_bytes: int, gap: int) -> Plan:
    """Raw rows sorted by (lane, chunk, offset) cut into runs of rows at most ``gap`` bytes apart."""
    apart = (offset[1:] - offset[:-1] - 1) * row_bytes
    new = np.ones(len(offset), bool)
    new[1:] = (lane[1:] != lane[:-1]) | (chunk[1:] != chunk[:-1]) | (apart > gap)
    firsts = np.flatnonzero(new)
    lasts = np.append(firsts[1:], len(offset)) - 1
    return np.cumsum(new) - 1, firsts, offset[firsts] * row_bytes, (offset[lasts] + 1) * row_bytes
