"""Field specs and the validation / safe casting of incoming rows (diskreplay.schema)."""

from __future__ import annotations

import numpy as np
import pytest

import diskreplay as dr
from diskreplay.format.layout import check_schema_compatible
from diskreplay.format.schema import ALLOWED_DTYPES, RESERVED_NAMES, Schema

pytestmark = pytest.mark.usefixtures("no_fsync")

ALL = ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
       "float16", "float32", "float64"]


# ---- Field --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ALL)
def test_field_accepts_every_allowed_dtype(dtype):
    field = dr.Field([2, np.int64(3)], dtype)
    assert field.shape == (2, 3) and all(type(s) is int for s in field.shape)
    assert field.dtype == np.dtype(dtype)
    assert field.dtype.byteorder in "<|="
    assert field.row_bytes == 6 * np.dtype(dtype).itemsize
    assert dr.Field.from_json(field.to_json()) == field


def test_field_normalises_byte_order():
    assert dr.Field((), ">f4").dtype.str == "<f4"
    assert dr.Field((), np.float64).dtype.str == "<f8"
    assert dr.Field((), ">i2") == dr.Field((), "int16")


@pytest.mark.parametrize("dtype", ["complex64", "object", "<U3", "datetime64[s]", "V4", "S2"])
def test_field_rejects_other_dtypes(dtype):
    with pytest.raises(dr.SchemaError, match="dtype must be one of"):
        dr.Field((), dtype)


def test_field_rejects_negative_shape():
    with pytest.raises(dr.SchemaError, match="non-negative"):
        dr.Field((3, -1), "float32")


def test_allowed_dtypes_list():
    assert sorted(d.name for d in ALLOWED_DTYPES) == sorted(ALL)


# ---- Schema -------------------------------------------------------------------------------------


FIELDS = {"obs": dr.Field((3,), "float32"), "act": dr.Field((), "int16"), "done": dr.Field((), "bool"),
          "img": dr.Field((2, 2), "uint8")}


def test_schema_mapping_and_json():
    schema = Schema(FIELDS)
    assert list(schema) == list(FIELDS) and len(schema) == 4
    assert schema["act"] == FIELDS["act"]
    assert dict(schema.items()) == FIELDS
    assert schema.row_bytes == 12 + 2 + 1 + 4
    again = Schema.from_json(schema.to_json())
    assert again.fields == schema.fields and list(again) == list(schema)


@pytest.mark.parametrize("fields,match", [
    ({}, "at least one field"),
    ({"not valid": dr.Field((), "bool")}, "identifiers"),
    ({"1x": dr.Field((), "bool")}, "identifiers"),
    ({"index": dr.Field((), "int64")}, "reserved"),
    ({"weight": dr.Field((), "float32")}, "reserved"),
    ({"obs": ((3,), "float32")}, r"'obs'.*dr.Field.*tuple"),
])
def test_schema_rejects_bad_fields(fields, match):
    with pytest.raises(dr.SchemaError, match=match):
        Schema(fields)


def test_reserved_names_include_batch_keys():
    assert {"index", "weight", "mask", "start"} <= RESERVED_NAMES


def test_buffer_create_rejects_bad_schema(tmp_path):
    with pytest.raises(dr.SchemaError, match="reserved"):
        dr.ReplayBuffer.create(tmp_path / "b", {"index": dr.Field((), "int64")})
    with pytest.raises(dr.SchemaError, match="zero-sized"):
        dr.ReplayBuffer.create(tmp_path / "c", {"x": dr.Field((0,), "float32")})


def test_zero_sized_fields_are_not_storable():
    with pytest.raises(dr.SchemaError, match=r"'x'.*zero-sized.*\(2, 0\)"):
        check_schema_compatible(Schema({"x": dr.Field((2, 0), "int8")}))


# ---- Schema.rows: shape checks ------------------------------------------------------------------


def one_row(**changes):
    row = {"obs": np.zeros(3, np.float32), "act": np.int16(1), "done": False,
           "img": np.zeros((2, 2), np.uint8)}
    row.update(changes)
    return row


def test_rows_accepts_a_good_step_and_casts():
    out = Schema(FIELDS).rows(one_row(obs=[1, 2, 3], act=5, done=True), lead=())
    assert out["obs"].dtype == np.float32 and out["obs"].tolist() == [1, 2, 3]
    assert out["act"].dtype == np.int16 and out["act"] == 5
    assert out["done"].dtype == np.bool_ and out["done"]


def test_rows_with_leading_axes():
    schema = Schema(FIELDS)
    batch = {k: np.zeros((4, 2, *f.shape), f.dtype) for k, f in FIELDS.items()}
    out = schema.rows(batch, lead=(4, 2))
    assert out["img"].shape == (4, 2, 2, 2)
    with pytest.raises(dr.SchemaError, match=r"'obs'.*\(4, 3, 3\).*\(4, 2, 3\)"):
        schema.rows(batch, lead=(4, 3))


def test_rows_lead_none_takes_any_common_length():
    schema = Schema(FIELDS)
    batch = {k: np.zeros((5, *f.shape), f.dtype) for k, f in FIELDS.items()}
    assert schema.rows(batch)["act"].shape == (5,)
    with pytest.raises(dr.SchemaError, match=r"'act'.*\(5,\).*\(4,\)"):
        schema.rows({**batch, "act": np.zeros(4, np.int16)})
    with pytest.raises(dr.SchemaError, match=r"'obs'.*leading step axis.*\(3,\)"):
        schema.rows({**batch, "obs": np.zeros(3, np.float32)})


@pytest.mark.parametrize("changes,match", [
    ({"obs": np.zeros(4, np.float32)}, r"'obs'.*expected shape \(3,\), got \(4,\)"),
    ({"obs": np.zeros((1, 3), np.float32)}, r"'obs'.*\(3,\).*\(1, 3\)"),
    ({"act": np.zeros(1, np.int16)}, r"'act'.*\(\).*\(1,\)"),
    ({"img": np.zeros(4, np.uint8)}, r"'img'.*\(2, 2\).*\(4,\)"),
])
def test_rows_rejects_wrong_shapes(changes, match):
    with pytest.raises(dr.SchemaError, match=match):
        Schema(FIELDS).rows(one_row(**changes), lead=())


def test_rows_rejects_missing_and_unknown_fields():
    schema = Schema(FIELDS)
    row = one_row()
    del row["done"]
    with pytest.raises(dr.SchemaError, match=r"missing \['done'\], unknown \[\]"):
        schema.rows(row, lead=())
    with pytest.raises(dr.SchemaError, match=r"missing \[\], unknown \['extra'\]"):
        schema.rows(one_row(extra=1), lead=())
    with pytest.raises(dr.SchemaError, match=r"expected exactly \['obs', 'act', 'done', 'img'\]"):
        schema.rows({}, lead=())


# ---- Schema.rows: dtype casting ------------------------------------------------------------------


@pytest.mark.parametrize("stored,value", [
    ("int16", np.int8(-5)),        # safe widening
    ("int64", np.uint32(7)),
    ("int16", np.int64(-32768)),   # same kind, fits
    ("uint8", np.int64(255)),
    ("uint64", np.int64(2**62)),
    ("int64", np.uint64(2**63 - 1)),
    ("int8", np.array([], np.int64).reshape(0)),
    ("int32", True),               # bool into int is safe
    ("float32", np.float64(1.5)),  # floats may narrow
    ("float16", np.float32(3.0)),
    ("float64", np.int64(3)),      # ints and bools into floats
    ("float32", np.uint8(200)),
    ("float16", np.bool_(True)),
    ("bool", np.bool_(False)),
])
def test_safe_casts_are_accepted(stored, value):
    value = np.asarray(value)
    schema = Schema({"x": dr.Field(value.shape, stored)})
    out = schema.rows({"x": value}, lead=())["x"]
    assert out.dtype == np.dtype(stored)
    np.testing.assert_array_equal(out, value.astype(stored))


@pytest.mark.parametrize("stored,value,match", [
    ("int16", np.float64(1.0), r"'x'.*int16.*float64"),
    ("uint8", np.float32(1.0), r"'x'.*uint8.*float32"),
    ("int16", np.int64(40000), r"'x'.*\[40000, 40000\].*int16.*-32768, 32767"),
    ("uint8", np.int64(-1), r"'x'.*\[-1, -1\].*uint8"),
    ("uint8", np.array([3, 256]), r"'x'.*\[3, 256\].*uint8"),
    ("int64", np.uint64(2**63), r"'x'.*9223372036854775808.*int64"),
    ("uint32", np.int64(-2), r"'x'.*uint32"),
    ("bool", np.int64(1), r"'x'.*bool.*int64"),
    ("bool", np.uint8(0), r"'x'.*bool.*uint8"),
    ("bool", np.float32(0.0), r"'x'.*bool.*float32"),
    ("float32", np.complex64(1j), r"'x'.*float32.*complex64"),
    ("float32", np.array("a"), r"'x'.*float32.*str"),
    ("int32", np.array(None, dtype=object), r"'x'.*int32.*object"),
])
def test_unsafe_casts_are_refused(stored, value, match):
    value = np.asarray(value)
    schema = Schema({"x": dr.Field(value.shape, stored)})
    with pytest.raises(dr.SchemaError, match=match):
        schema.rows({"x": value}, lead=())


def test_whole_batch_is_checked_before_anything_is_returned():
    """A bad value late in a batch (or in a later field) refuses the whole batch."""
    schema = Schema({"a": dr.Field((), "int8"), "b": dr.Field((), "bool")})
    with pytest.raises(dr.SchemaError, match="'a'"):
        schema.rows({"a": np.array([1, 2, 300]), "b": np.zeros(3, bool)}, lead=(3,))
    with pytest.raises(dr.SchemaError, match="'b'"):
        schema.rows({"a": np.array([1, 2, 3]), "b": np.zeros(3)}, lead=(3,))


def test_rows_does_not_copy_matching_arrays_or_alias_casts():
    schema = Schema({"a": dr.Field((2,), "float32")})
    same = np.zeros((4, 2), np.float32)
    assert schema.rows({"a": same}, lead=(4,))["a"] is same
    other = np.zeros((4, 2), np.float64)
    out = schema.rows({"a": other}, lead=(4,))["a"]
    out[0, 0] = 1
    assert other[0, 0] == 0
