"""Petastorm's dataset format, read without Petastorm: the Unischema and the codecs.

A Petastorm dataset is Parquet plus a Unischema, pickled into the `_common_metadata` file at its
root. Petastorm itself unpickles it with a "restricted" unpickler that still admits whole packages
(builtins among them), so a crafted metadata file runs code on whoever opens the dataset. dtf
never unpickles a real class: every global the pickle names must be one of Petastorm's schema
classes (or a numpy scalar type, a Spark SQL type, OrderedDict, Decimal), each by its exact name,
and what it gets back is an inert stand-in that only records its state. Anything else refuses
the file in one line, before anything in it is called.

Values are decoded as Petastorm's codecs decode them (petastorm/codecs.py, utils.decode_row), a
column at a time: scalars cast to the field's numpy type, NdarrayCodec's .npy bytes, the .npz of
CompressedNdarrayCodec, and CompressedImageCodec's png/jpeg through OpenCV, in RGB order.
"""

from __future__ import annotations

import ast
import decimal
import io
import pickle
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

import numpy as np

UNISCHEMA_KEY = b"dataset-toolkit.unischema.v1"

# The packages Petastorm's schema classes once lived in (petastorm.etl.legacy): old datasets name them.
_LEGACY_PACKAGES = ("av.experimental.deepdrive.dataset_toolkit", "av.ml.dataset_toolkit")


class SchemaRefused(Exception):
    """The pickled Unischema names something dtf does not unpickle (or is not a pickle at all)."""


class _Record:
    """An inert stand-in for one of Petastorm's (or Spark's) classes: it keeps the arguments and
    the state the pickle gives it, and runs nothing."""

    qualname = ""
    args: tuple[Any, ...]
    state: dict[str, Any]

    def __new__(cls, *args: Any) -> _Record:  # pickle's NEWOBJ calls __new__ alone, never __init__
        self = super().__new__(cls)
        self.args, self.state = args, {}
        return self

    def __setstate__(self, state: Any) -> None:
        # (dict, slots) from protocol 2 objects with __slots__; a plain dict otherwise
        if isinstance(state, tuple) and len(state) == 2:
            state = {**(state[0] or {}), **(state[1] or {})}
        self.state = dict(state) if isinstance(state, Mapping) else {"_state": state}


def _record_class(qualname: str) -> type[_Record]:
    return type(qualname.rsplit(".", 1)[-1], (_Record,), {"qualname": qualname})


_CODECS = ("ScalarCodec", "NdarrayCodec", "CompressedNdarrayCodec", "CompressedImageCodec")
_SPARK_TYPES = (
    "BooleanType",
    "ByteType",
    "ShortType",
    "IntegerType",
    "LongType",
    "FloatType",
    "DoubleType",
    "StringType",
    "BinaryType",
    "DecimalType",
    "DateType",
    "TimestampType",
    "TimestampNTZType",
    "NullType",
)
# The numpy scalar types a UnischemaField's numpy_dtype is, by the names pickle gives them.
_NUMPY_TYPES = (
    "bool_",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "float32",
    "float64",
    "longlong",
    "ulonglong",
    "str_",
    "unicode_",
    "bytes_",
    "string_",
    "object_",
    "datetime64",
    "timedelta64",
)

_RECORDS: dict[tuple[str, str], type[_Record]] = {
    ("petastorm.unischema", "Unischema"): _record_class("petastorm.unischema.Unischema"),
    **{("petastorm.codecs", name): _record_class(f"petastorm.codecs.{name}") for name in _CODECS},
    **{("pyspark.sql.types", name): _record_class(f"pyspark.sql.types.{name}") for name in _SPARK_TYPES},
}


class _Field(tuple[Any, ...]):
    """UnischemaField, a NamedTuple: (name, numpy_dtype, shape, codec, nullable)."""

    def __new__(cls, *args: Any) -> _Field:
        return super().__new__(cls, args)


def _numpy_type(name: str) -> Any:
    aliases = {"unicode_": "str_", "string_": "bytes_", "longlong": "int64", "ulonglong": "uint64"}
    return getattr(np, aliases.get(name, name))


def _allowed(module: str, name: str) -> Any:
    """What a global of the pickle stands for, or None where dtf does not unpickle it."""
    for legacy in _LEGACY_PACKAGES:
        if module.startswith(legacy + "."):
            module = "petastorm" + module[len(legacy) :]
    if (module, name) in _RECORDS:
        return _RECORDS[(module, name)]
    if (module, name) == ("petastorm.unischema", "UnischemaField"):
        return _Field
    if module == "numpy" and name in _NUMPY_TYPES:
        return _numpy_type(name)
    if (module, name) == ("collections", "OrderedDict"):
        return OrderedDict
    if (module, name) == ("decimal", "Decimal"):
        return decimal.Decimal  # a field's numpy_dtype may be Decimal itself
    if (module, name) in (("copyreg", "_reconstructor"), ("copy_reg", "_reconstructor")):
        return _reconstructor  # how protocols 0 and 1 (Python 2's default) rebuild objects
    if (module, name) in (("builtins", "object"), ("__builtin__", "object")):
        return _Base.OBJECT
    if (module, name) in (("builtins", "tuple"), ("__builtin__", "tuple")):
        return _Base.TUPLE
    if name.endswith("Codec") and module.split(".")[0] not in ("builtins", "__builtin__"):
        # Someone's own codec class: inert like the others, and named when its column is read.
        return _record_class(f"{module}.{name}")
    return None


class _Base(Enum):
    """copyreg._reconstructor's second argument, as inert markers (never the real object or tuple)."""

    OBJECT = "object"
    TUPLE = "tuple"


def _reconstructor(cls: Any, base: Any, state: Any) -> Any:
    if cls is _Field and base is _Base.TUPLE and isinstance(state, tuple):
        return _Field(*state)
    if isinstance(cls, type) and issubclass(cls, _Record) and base is _Base.OBJECT:
        return cls()
    raise SchemaRefused("it rebuilds something other than Petastorm's schema classes")


class _AllowListUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        found = _allowed(module, name)
        if found is None:
            raise SchemaRefused(f"it names {module}.{name}, which is not one of Petastorm's schema classes")
        return found


@dataclass(frozen=True)
class Codec:
    """A UnischemaField's codec: kind is scalar, ndarray, compressed_ndarray, image, or the
    qualified name of a codec dtf does not know."""

    kind: str
    image_format: str | None = None  # png, jpeg (CompressedImageCodec)
    spark_type: str | None = None  # ScalarCodec's storage type, e.g. IntegerType


KNOWN_CODECS = {"scalar", "ndarray", "compressed_ndarray", "image"}


@dataclass(frozen=True)
class PetastormField:
    """One UnischemaField as dtf describes it."""

    name: str
    numpy_type: Any  # a numpy scalar type, decimal.Decimal, or None
    shape: tuple[int | None, ...]
    codec: Codec | None
    nullable: bool

    @property
    def problem(self) -> str | None:
        """Why dtf cannot read this field's values, or None."""
        if self.codec is not None and self.codec.kind not in KNOWN_CODECS:
            return (
                f"is encoded by {self.codec.kind}, a codec dtf does not know (it decodes Petastorm's "
                f"{', '.join(_CODECS)}): rewrite the column with one of those, or read another column"
            )
        return None

    @property
    def fixed_shape(self) -> tuple[int, ...] | None:
        return tuple(int(d) for d in self.shape) if self.shape and None not in self.shape else None  # type: ignore[arg-type]


@dataclass(frozen=True)
class Unischema:
    name: str
    fields: dict[str, PetastormField]


def read_unischema(raw: bytes) -> Unischema:
    """The Unischema pickled in a Petastorm dataset's metadata. Raises SchemaRefused with the reason."""
    try:
        loaded = _AllowListUnpickler(io.BytesIO(raw)).load()
    except SchemaRefused:
        raise
    except Exception as e:  # truncated, not a pickle, a stand-in given arguments it cannot take, ...
        raise SchemaRefused(f"it is not a pickled Unischema ({type(e).__name__}: {e})") from None
    if not (isinstance(loaded, _Record) and loaded.qualname == "petastorm.unischema.Unischema"):
        raise SchemaRefused(f"it holds a {type(loaded).__name__}, not a Unischema")
    fields = loaded.state.get("_fields")
    if not isinstance(fields, Mapping) or not all(isinstance(f, _Field) and len(f) == 5 for f in fields.values()):
        raise SchemaRefused("its Unischema has no fields as Petastorm writes them")
    out = {}
    for field in fields.values():
        name, numpy_type, shape, codec, nullable = field
        if not isinstance(name, str) or not isinstance(shape, tuple):
            raise SchemaRefused(f"its field {name!r} is not (name, numpy_dtype, shape, codec, nullable)")
        out[name] = PetastormField(name, numpy_type, shape, _codec(codec, name), bool(nullable))
    return Unischema(str(loaded.state.get("_name", "")), out)


def _codec(codec: Any, field: str) -> Codec | None:
    if codec is None:
        return None
    if not isinstance(codec, _Record):
        raise SchemaRefused(f"the codec of field {field!r} is a {type(codec).__name__}")
    kind = codec.qualname.rsplit(".", 1)[-1]
    if codec.qualname.startswith("petastorm.codecs.") and kind == "ScalarCodec":
        spark = codec.state.get("_spark_type")
        return Codec("scalar", spark_type=spark.qualname.rsplit(".", 1)[-1] if isinstance(spark, _Record) else None)
    if codec.qualname.startswith("petastorm.codecs.") and kind == "NdarrayCodec":
        return Codec("ndarray")
    if codec.qualname.startswith("petastorm.codecs.") and kind == "CompressedNdarrayCodec":
        return Codec("compressed_ndarray")
    if codec.qualname.startswith("petastorm.codecs.") and kind == "CompressedImageCodec":
        image = str(codec.state.get("_image_codec", ".png")).lstrip(".")
        return Codec("image", image_format=image)
    return Codec(codec.qualname)


# --- Decoding, a column of one row group at a time ---


def decode(field: PetastormField, column: Any) -> np.ndarray:
    """The values of an Arrow column (of one row group) as Petastorm's make_reader decodes them,
    stacked into one array: shape (rows, *value shape), or an object array where values differ in
    shape or are not numbers. Nulls stay None (an object array)."""
    import pyarrow as pa

    arr = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    codec = field.codec
    if arr.null_count:
        values = arr.to_pylist()
        decoded = [None if v is None else _decode_one(field, v) for v in values]
        out = np.empty(len(decoded), dtype=object)
        out[:] = decoded
        return out
    if codec is None or codec.kind == "scalar":
        return _scalars(field, arr)
    if codec.kind == "ndarray":
        fast = _npy_block(arr)
        if fast is not None:
            return fast
    if codec.kind == "image":
        return _images(field, _binary_views(arr))
    return _stack([_decode_one(field, v) for v in _binary_views(arr)])


def _scalars(field: PetastormField, arr: Any) -> np.ndarray:
    """Petastorm casts each value to the field's numpy type where that is a numpy scalar type or
    Decimal (utils.decode_row), else keeps it as stored."""
    import pyarrow as pa

    kind = field.numpy_type
    if pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type):  # np.float32([...]) is an array
        return _stack([_decode_one(field, v) for v in arr.to_pylist()])
    if isinstance(kind, type) and issubclass(kind, np.generic) and kind not in (np.object_,):
        if issubclass(kind, np.str_ | np.bytes_):
            return np.asarray([kind(v) for v in arr.to_pylist()])
        values = arr.to_numpy(zero_copy_only=False)
        return values.astype(kind, copy=False) if values.dtype != np.dtype(kind) else values
    if kind is decimal.Decimal:
        return _objects([decimal.Decimal(v) for v in arr.to_pylist()])
    return arr.to_numpy(zero_copy_only=False)


def _decode_one(field: PetastormField, value: Any) -> Any:
    codec = field.codec
    if codec is None or codec.kind == "scalar":
        kind = field.numpy_type
        if isinstance(kind, type) and (issubclass(kind, np.generic) or kind is decimal.Decimal):
            return kind(value)
        return value
    if codec.kind == "ndarray":
        return np.load(io.BytesIO(value))  # allow_pickle is False: object arrays are refused, not run
    if codec.kind == "compressed_ndarray":
        return np.load(io.BytesIO(value))["arr"]
    if codec.kind == "image":
        return _bgr_to_rgb(_decode_one_image(field, np.frombuffer(value, dtype=np.uint8)))
    raise ValueError(f"codec {codec.kind} is not one dtf decodes")


def _binary_views(arr: Any) -> list[np.ndarray]:
    """A binary column's values as uint8 views of its buffer (no copy per value, as to_pylist makes)."""
    import pyarrow as pa

    large = pa.types.is_large_binary(arr.type) or pa.types.is_large_string(arr.type)
    offsets = np.frombuffer(arr.buffers()[1], dtype=np.int64 if large else np.int32)[arr.offset :][: len(arr) + 1]
    data = np.frombuffer(arr.buffers()[2], dtype=np.uint8) if len(arr) else np.empty(0, np.uint8)
    return [data[a:b] for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist(), strict=True)]


def _decode_one_image(field: PetastormField, value: np.ndarray) -> np.ndarray:
    import cv2

    image = cv2.imdecode(value, cv2.IMREAD_UNCHANGED)
    if image is None:
        raise ValueError(f"OpenCV cannot decode this {field.codec.image_format if field.codec else ''} image")
    if image.ndim == 2 or (image.ndim == 3 and image.shape[2] == 3):
        return image
    raise ValueError(f"an image of shape {image.shape}: Petastorm's codec takes (H, W) or (H, W, 3)")


def _images(field: PetastormField, values: list[np.ndarray]) -> np.ndarray:
    """CompressedImageCodec's values: OpenCV decodes BGR, Petastorm yields RGB (a channel swap that
    OpenCV writes straight into the batch). Images of different shapes: an object array."""
    import cv2

    decoded = [_decode_one_image(field, v) for v in values[:1]]
    if not decoded:
        return np.empty(0, np.uint8)
    first = decoded[0]
    out = np.empty((len(values), *first.shape), dtype=first.dtype)
    for i, value in enumerate(values):
        image = first if i == 0 else _decode_one_image(field, value)
        if image.shape != first.shape or image.dtype != first.dtype:  # ragged: decode each on its own
            return _stack([_bgr_to_rgb(_decode_one_image(field, v)) for v in values])
        if image.ndim == 3:
            cv2.cvtColor(image, cv2.COLOR_BGR2RGB, dst=out[i])
        else:
            out[i] = image
    return out


def _bgr_to_rgb(image: np.ndarray) -> np.ndarray:
    return image[:, :, (2, 1, 0)] if image.ndim == 3 else image


def _stack(values: list[Any]) -> np.ndarray:
    if not values:
        return np.empty(0)
    if all(isinstance(v, np.ndarray) for v in values):
        shape, dtype = values[0].shape, values[0].dtype
        if all(v.shape == shape and v.dtype == dtype for v in values):
            return np.stack(values)
    return _objects(values)


def _objects(values: list[Any]) -> np.ndarray:
    out = np.empty(len(values), dtype=object)
    out[:] = values
    return out


def _npy_block(arr: Any) -> np.ndarray | None:
    """NdarrayCodec values decoded at once where every value has the same .npy header (the same
    dtype, shape and layout: the usual case), as np.load would decode each: None otherwise."""
    import pyarrow as pa

    if not (pa.types.is_binary(arr.type) or pa.types.is_large_binary(arr.type)) or len(arr) == 0:
        return None
    offsets_type = np.int64 if pa.types.is_large_binary(arr.type) else np.int32
    offsets = np.frombuffer(arr.buffers()[1], dtype=offsets_type)[arr.offset : arr.offset + len(arr) + 1]
    data = np.frombuffer(arr.buffers()[2], dtype=np.uint8)
    lengths = np.diff(offsets)
    length = int(lengths[0])
    if length < 10 or np.any(lengths != length):
        return None
    block = data[int(offsets[0]) : int(offsets[-1])].reshape(len(arr), length)
    header = _npy_header(block[0].tobytes())
    if header is None:
        return None
    size, dtype, shape = header
    if size + dtype.itemsize * int(np.prod(shape)) != length or np.any(block[1:, :size] != block[0, :size]):
        return None
    values = np.ascontiguousarray(block[:, size:]).view(dtype)
    return values.reshape(len(arr), *shape)


def _npy_header(first: bytes) -> tuple[int, np.dtype, tuple[int, ...]] | None:
    """(header size, dtype, shape) of a C-order .npy of a plain dtype, else None (np.load decodes it)."""
    if first[:6] != b"\x93NUMPY":
        return None
    major = first[6]
    width = 2 if major == 1 else 4
    if major not in (1, 2, 3) or len(first) < 8 + width:
        return None
    size = 8 + width + int.from_bytes(first[8 : 8 + width], "little")
    try:
        meta = ast.literal_eval(first[8 + width : size].decode("latin1" if major < 3 else "utf8"))
        dtype = np.dtype(meta["descr"])
        shape = tuple(int(d) for d in meta["shape"])
    except (ValueError, SyntaxError, KeyError, TypeError):
        return None
    if meta.get("fortran_order") or dtype.hasobject or dtype.fields is not None:
        return None
    return size, dtype, shape
