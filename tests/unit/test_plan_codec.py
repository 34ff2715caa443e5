"""The StepPlan codec (ranks/plan.py): one msgpack map whose last entry is a bin holding every
array's bytes. Round trips of plans with empty, odd-sized and 2-D arrays, written into a
reused buffer full of old bytes; decoded arrays are aligned, writable and independent of the
buffer they came from."""

from __future__ import annotations

import msgpack
import numpy as np

from tapserve.ranks.plan import (
    _ARRAY_FIELDS,
    EncodedPlan,
    PlanDecoder,
    StepKind,
    StepPlan,
    decode_plan,
    encode_plan,
)

FIELDS = (
    "input_ids",
    "positions",
    "slot_mapping",
    "query_start_loc",
    "context_lens",
    "block_tables",
    "logit_rows",
    "custom_rows",
    "block_copies",
)


def _plan(
    rng: np.random.Generator, rows: int, width: int, ids_from_rank0: bool = False
) -> StepPlan:
    return StepPlan(
        kind=StepKind.MIXED,
        graph_bucket=3,
        ids_from_rank0=ids_from_rank0,
        input_ids=rng.integers(0, 1 << 40, rows * 2),
        positions=np.arange(rows * 2),
        slot_mapping=rng.integers(-1, 1000, rows * 2),
        query_start_loc=np.arange(0, rows * 2 + 1, 2, dtype=np.int32),
        context_lens=rng.integers(1, 99, rows).astype(np.int32),  # 4 x rows bytes: padded
        block_tables=rng.integers(0, 500, (rows, width)).astype(np.int32),
        logit_rows=np.arange(rows, dtype=np.int64),
        custom_rows=np.zeros(0, np.int64),
        block_copies=rng.integers(0, 9, (rows % 3, 2)),
    )


def _same(a: StepPlan, b: StepPlan) -> bool:
    return (
        a.kind is b.kind
        and a.graph_bucket == b.graph_bucket
        and a.ids_from_rank0 is b.ids_from_rank0
        and all(
            np.array_equal(getattr(a, f), getattr(b, f))
            and getattr(a, f).dtype == getattr(b, f).dtype
            for f in FIELDS
        )
    )


def test_round_trips_through_a_reused_buffer() -> None:
    rng = np.random.default_rng(0)
    buffer = rng.integers(0, 256, 1 << 16, dtype=np.uint8)  # stale bytes everywhere
    for rows, width, ids_from_rank0 in [
        (0, 0, False),
        (1, 1, True),
        (3, 5, False),
        (7, 3, True),
        (33, 17, False),
    ]:
        plan = _plan(rng, rows, width, ids_from_rank0)
        encoded = EncodedPlan(plan)
        encoded.write_into(buffer)
        got = decode_plan(memoryview(buffer[: encoded.nbytes]))
        assert _same(got, plan), (rows, width)
        assert _same(decode_plan(encode_plan(plan)), plan)
        for f in FIELDS:
            arr = getattr(got, f)
            assert arr.flags.writeable and arr.ctypes.data % 8 == 0, f
        buffer[: encoded.nbytes] = 0  # the decoded plan owns its bytes
        assert _same(got, plan)


def test_the_message_is_one_msgpack_map_with_the_data_last() -> None:
    plan = _plan(np.random.default_rng(1), 4, 6)
    body = msgpack.unpackb(encode_plan(plan), raw=False)
    assert list(body) == ["kind", "graph_bucket", "ids_from_rank0", "arrays", "data"]
    assert body["arrays"][-1] == ["<i4", [4, 6]]  # block_tables, last on the wire
    assert len(body["data"]) % 8 == 0


def test_malformed_messages_are_value_errors() -> None:
    """A broken plan message is refused with a ValueError naming what is wrong, never
    mis-read: a negative dimension, a byte-swapped dtype, data of the wrong length, a missing
    key, a body that is not a map."""
    import pytest

    good = msgpack.unpackb(encode_plan(_plan(np.random.default_rng(2), 4, 6)), raw=False)

    def broken(**change) -> bytes:
        return msgpack.packb({**good, **change}, use_bin_type=True)

    arrays = [list(a) for a in good["arrays"]]
    negative = [a[:] for a in arrays]
    copies = _ARRAY_FIELDS.index("block_copies")
    negative[copies] = [negative[copies][0], [-1, 2]]
    swapped = [a[:] for a in arrays]
    swapped[0] = [">i8", swapped[0][1]]
    for message, why in [
        (broken(arrays=negative), "bad shape"),
        (broken(arrays=swapped), "native"),
        (broken(data=good["data"] + b"\0" * 8), "bytes"),
        (broken(data=good["data"][:-16]), "past the data"),
        (msgpack.packb({k: v for k, v in good.items() if k != "kind"}), "KeyError"),
        (broken(ids_from_rank0=1), "not a bool"),
        (msgpack.packb([1, 2, 3]), "malformed"),
    ]:
        with pytest.raises(ValueError, match=why):
            decode_plan(message)


def test_a_message_is_read_in_place_when_asked() -> None:
    """copy=False: the arrays are views of the (writable) message buffer itself; copy=True
    (the default) and read-only buffers: a private copy. A map whose data is not its last
    entry is read by msgpack whole, and decodes the same."""
    plan = _plan(np.random.default_rng(3), 5, 4)
    buffer = np.frombuffer(bytearray(encode_plan(plan)), np.uint8)
    in_place = decode_plan(buffer, copy=False)
    assert _same(in_place, plan)
    assert all(
        np.shares_memory(getattr(in_place, f), buffer) for f in FIELDS if getattr(plan, f).size
    )
    copied = decode_plan(buffer)
    assert _same(copied, plan) and not any(
        np.shares_memory(getattr(copied, f), buffer) for f in FIELDS
    )
    read_only = decode_plan(bytes(buffer), copy=False)
    assert _same(read_only, plan) and read_only.block_tables.flags.writeable
    body = msgpack.unpackb(encode_plan(plan), raw=False)
    data_first = msgpack.packb({"data": body.pop("data"), **body}, use_bin_type=True)
    assert _same(decode_plan(data_first), plan)


def test_the_quick_head_reader_accepts_nothing_msgpack_refuses() -> None:
    """A map that says it has more entries than it holds, an int key: refused (ValueError);
    a "data" entry that is not last: read by msgpack whole, as before the quick reader; bad
    dtype strings and infinite numbers: ValueError."""
    import pytest

    plan = _plan(np.random.default_rng(4), 3, 2)
    body = msgpack.unpackb(encode_plan(plan), raw=False)
    entries = b"".join(
        msgpack.packb(k) + msgpack.packb(v, use_bin_type=True) for k, v in body.items()
    )
    for message in (
        b"\x86" + entries,  # six entries declared, five there
        b"\x86\x01\x01" + entries,
    ):  # an int key
        with pytest.raises(ValueError):
            decode_plan(message)
    # "data" twice, the first not last: read as msgpack reads it (the last value wins)
    data_twice = b"\x86" + msgpack.packb("data") + msgpack.packb(b"", use_bin_type=True) + entries
    assert _same(decode_plan(data_twice), plan)
    for bad in ([",", [1]], ["<i8", [float("inf")]]):
        broken = dict(body, arrays=[bad] + body["arrays"][1:])
        with pytest.raises(ValueError):
            decode_plan(msgpack.packb(broken, use_bin_type=True))
    with pytest.raises(ValueError):
        decode_plan(msgpack.packb(dict(body, graph_bucket=float("inf")), use_bin_type=True))


def test_a_decoder_reuses_a_repeated_head_and_nothing_else() -> None:
    """PlanDecoder (the receiving channel's): a message whose head repeats the last one byte
    for byte (new data, same kinds and shapes) is read with the last parse; any other head is
    parsed afresh; every plan equals decode_plan's, as views of the buffer it came in; a
    malformed message after good ones is still refused."""
    import pytest

    rng = np.random.default_rng(5)
    decoder, parses = PlanDecoder(), []
    from tapserve.ranks import plan as plan_module

    real_read_head = plan_module._read_head
    plan_module._read_head = lambda view: parses.append(1) or real_read_head(view)
    try:
        shapes = [
            (4, 6, False),
            (4, 6, False),
            (4, 6, True),
            (5, 6, True),
            (5, 6, True),
            (4, 6, False),
        ]
        for i, (rows, width, ids) in enumerate(shapes):
            plan = _plan(rng, rows, width, ids)  # new values each time
            buffer = np.frombuffer(bytearray(encode_plan(plan)), np.uint8)
            got = decoder.decode(buffer)
            assert _same(got, plan) and _same(got, decode_plan(buffer)), i
            assert np.shares_memory(got.block_tables, buffer)
        # parsed: the first, then each head change (ids_from_rank0, rows, back); decode_plan's
        # own calls above add one each
        assert len(parses) == len(shapes) + 4
        read_only = decoder.decode(np.frombuffer(encode_plan(plan), np.uint8))
        assert _same(read_only, plan) and read_only.block_tables.flags.writeable
        good = msgpack.unpackb(encode_plan(plan), raw=False)
        short = msgpack.packb({**good, "data": good["data"][:-8]}, use_bin_type=True)
        with pytest.raises(ValueError, match="past the data"):
            decoder.decode(np.frombuffer(bytearray(short), np.uint8))
    finally:
        plan_module._read_head = real_read_head
