"""The X-LlamaSwap-Priority header: parsing, aliases and bands."""

from __future__ import annotations


import pytest

from llamaswap.core import Band, Priority, PrioritySource, band_of, parse_priority

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1

NUMBER = PrioritySource.NUMBER
ALIAS = PrioritySource.ALIAS
ABSENT = PrioritySource.ABSENT
UNPARSEABLE = PrioritySource.UNPARSEABLE


@pytest.mark.parametrize(
    ("raw", "value"),
    [
        ("interactive", 100),
        ("normal", 0),
        ("batch", -100),
        ("Interactive", 100),
        ("INTERACTIVE", 100),
        ("BaTcH", -100),
        ("NORMAL", 0),
        ("  batch  ", -100),
        ("\tinteractive\t", 100),
        (" Normal\r\n", 0),
        (b"batch", -100),
        (b" INTERACTIVE ", 100),
    ],
)
def test_aliases_are_case_insensitive_and_whitespace_stripped(raw, value):
    assert parse_priority(raw) == Priority(value, ALIAS)


@pytest.mark.parametrize(
    ("raw", "value"),
    [
        ("0", 0),
        ("100", 100),
        ("-100", -100),
        ("-98", -98),
        ("+5", 5),
        (" 7 ", 7),
        ("\t-3\t", -3),
        ("-0", 0),
        ("+0", 0),
        ("007", 7),
        ("-007", -7),
        ("12345678901", 12345678901),
        (str(INT64_MAX), INT64_MAX),
        (str(INT64_MIN), INT64_MIN),
        ("0" * 30 + "9", 9),  # leading zeros still fit
        (b"42", 42),
        (b"-100", -100),
        (b" +1 ", 1),
    ],
)
def test_signed_integers(raw, value):
    parsed = parse_priority(raw)
    assert parsed == Priority(value, NUMBER)
    assert not parsed.unparseable
    assert type(parsed.value) is int


@pytest.mark.parametrize("raw", [None, "", "   ", "\t", b"", b"  "])
def test_absent_or_empty_is_zero_marked_absent(raw):
    parsed = parse_priority(raw)
    assert parsed.value == 0
    assert parsed.source is ABSENT
    assert not parsed.unparseable


@pytest.mark.parametrize(
    "raw",
    [
        "1e3",
        "1E3",
        "1_000",
        "1.5",
        "1.0",
        "0x10",
        "0b1",
        "0o7",
        "abc",
        "high",
        "interactive1",
        "batch-1",
        "- 5",
        "+-5",
        "--5",
        "++5",
        "5 5",
        "5,000",
        "inf",
        "nan",
        "-",
        "+",
        "１２",  # full-width digits: int() would take them, the header must not
        "١٢",  # Arabic-Indic digits
        "߁",  # NKo digit one
        "½",
        "ínteractive",
        "interactivé",
        "5\x00",
        str(2**63),  # one past INT64_MAX
        str(-(2**63) - 1),  # one below INT64_MIN
        str(2**64),
        "9" * 25,
        "-" + "9" * 25,
        "9" * 1_000_000,  # huge
        "x" * 1_000_000,
        b"\xff\xfe",
        b"10\xff",
        "١٠٠".encode(),  # non-ASCII digits as bytes
        "batch".encode("utf-16"),
    ],
)
def test_unparseable_is_zero_marked_unparseable(raw):
    parsed = parse_priority(raw)
    assert parsed == Priority(0, UNPARSEABLE)
    assert parsed.unparseable
    assert parsed.band is Band.NORMAL


def test_int64_bounds_are_exact():
    assert parse_priority(str(INT64_MAX)).value == INT64_MAX
    assert parse_priority(str(INT64_MAX + 1)).source is UNPARSEABLE
    assert parse_priority(str(INT64_MIN)).value == INT64_MIN
    assert parse_priority(str(INT64_MIN - 1)).source is UNPARSEABLE
    assert parse_priority("+" + str(INT64_MAX)).value == INT64_MAX


def test_values_are_not_clamped():
    assert parse_priority("1000000").value == 1_000_000
    assert parse_priority("-1000000").value == -1_000_000
    assert parse_priority("101").value == 101


def test_huge_inputs_never_reach_int(monkeypatch):
    # Python's int() of a megabyte of digits is slow (and refused above 4300 digits): the parser
    # must refuse such input by its length, before converting anything. A module global shadows
    # the builtin, so the spy sees every int() the parser makes.
    import llamaswap.core.priority as priority_module

    converted = []

    def spy(text, *args):
        converted.append(len(text))
        return int(text, *args)

    monkeypatch.setattr(priority_module, "int", spy, raising=False)
    huge = [
        "9" * 5_000_000,
        "-" + "1" * 5_000_000,
        " " * 1_000_000 + "1" * 1_000_000 + " " * 1_000_000,
    ]
    for raw in huge:
        assert parse_priority(raw) == Priority(0, UNPARSEABLE)
    assert converted == []
    assert parse_priority("12345") == Priority(12345, NUMBER) and converted == [5]  # the spy does see int()


def test_whitespace_padding_of_any_length_is_stripped():
    assert parse_priority(" " * 100_000 + "-42" + " " * 100_000) == Priority(-42, NUMBER)


@pytest.mark.parametrize(
    ("priority", "band"),
    [
        (100, Band.INTERACTIVE),
        (50, Band.INTERACTIVE),
        (49, Band.NORMAL),
        (1, Band.NORMAL),
        (0, Band.NORMAL),
        (-1, Band.NORMAL),
        (-49, Band.NORMAL),
        (-50, Band.BATCH),
        (-98, Band.BATCH),
        (-100, Band.BATCH),
        (-101, Band.BATCH),
        (102, Band.INTERACTIVE),
        (INT64_MAX, Band.INTERACTIVE),
        (INT64_MIN, Band.BATCH),
    ],
)
def test_bands_by_nearest_anchor(priority, band):
    assert band_of(priority) is band
    assert Priority(priority, NUMBER).band is band


@pytest.mark.parametrize(("raw", "band"), [("interactive", Band.INTERACTIVE), ("normal", Band.NORMAL),
                                           ("batch", Band.BATCH), ("50", Band.INTERACTIVE), ("-50", Band.BATCH),
                                           ("-49", Band.NORMAL), ("49", Band.NORMAL), (None, Band.NORMAL)])
def test_parsed_priority_band(raw, band):
    assert parse_priority(raw).band is band


def test_band_labels():
    assert [str(b) for b in Band] == ["interactive", "normal", "batch"]
    assert f"{Band.BATCH}" == "batch"
    assert str(PrioritySource.UNPARSEABLE) == "unparseable"
