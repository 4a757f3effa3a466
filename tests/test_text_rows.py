"""Rows of text built as byte arrays (io/text_rows.py) against Python's own formatting, row by row."""

import numpy as np
import pytest

from wsi_pipeline.io.text_rows import choice_column, decimal_column, hex_column, join_rows


def _rows(column: np.ndarray) -> list[str]:
    return join_rows([column, b"\n"]).decode().split("\n")[:-1]


def _values(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.concatenate(
        [
            rng.uniform(0, 2e5, 5000).astype(np.float32).astype(np.float64),  # detection coordinates
            rng.uniform(-50, 50, 2000),
            rng.uniform(0, 1, 2000).astype(np.float32),  # scores
            10.0 ** rng.uniform(-3, 12, 1000),
            [0.0, -0.0, -0.001, 0.004, 0.005, 0.125, 1.0, 99.995, 12345678.9, 0.5, 2.675, -2.675],
        ]
    )


@pytest.mark.parametrize("decimals", [1, 2, 5, 6])
@pytest.mark.parametrize("seed", [0, 1])
def test_shortest_decimals_are_the_repr_of_the_rounded_float(decimals, seed):
    v = _values(seed)
    v = v[(np.abs(np.round(v, decimals)) >= 1e-4) | (np.round(v, decimals) == 0)]  # repr's exponent form below
    assert np.abs(v).max() > 10 ** (15 - decimals) or decimals < 5  # some rows written by Python
    assert _rows(decimal_column(v, decimals, shortest=True)) == [repr(float(x)) for x in np.round(v, decimals)]


@pytest.mark.parametrize("decimals", [2, 5])
def test_fixed_decimals_of_float32_values_are_printf_formatting(decimals):
    v = _values(3).astype(np.float32).astype(np.float64)  # exact products with 10**decimals
    assert _rows(decimal_column(v, decimals, shortest=False)) == [f"{x:.{decimals}f}" for x in v.tolist()]


def test_values_not_finite_or_too_large_for_exact_digits_are_written_as_python_writes_them():
    v = np.array([1.5, np.nan, np.inf, -np.inf, -0.25, 1e300, -3e17])
    assert _rows(decimal_column(v, 2, shortest=False)) == [f"{x:.2f}" for x in v.tolist()]
    assert _rows(decimal_column(v, 2, shortest=True)) == ["1.5", "nan", "inf", "-inf", "-0.25", "1e+300", "-3e+17"]


def test_tiny_values_are_plain_decimals_that_parse_to_the_rounded_float():
    v = np.array([0.00001, 0.000049, 3e-6])
    rows = _rows(decimal_column(v, 6, shortest=True))
    assert rows == ["0.00001", "0.000049", "0.000003"]
    assert [float(r) for r in rows] == np.round(v, 6).tolist()


def test_hex_ids_and_choices():
    idx = np.array([0, 1, 255, 16**12 - 1, 123456789])
    assert _rows(hex_column(idx, 12)) == [f"{i:012x}" for i in idx.tolist()]
    with pytest.raises(ValueError):
        hex_column(np.array([16**12]), 12)
    texts = [b"a", "\u00fcber".encode(), b""]
    assert join_rows([choice_column(np.array([1, 0, 2, 1]), texts), b"|"]).decode() == "\u00fcber|a||\u00fcber|"


def test_rows_join_constant_text_and_columns_in_order():
    a = decimal_column(np.array([1.0, 22.5]), 2, shortest=True)
    b = hex_column(np.array([10, 11]), 2)
    assert join_rows([b"[", a, b",", b, b"]"]) == b"[1.0,0a][22.5,0b]"
    assert join_rows([decimal_column(np.zeros(0), 2, shortest=True), b"x"]) == b""
    with pytest.raises(ValueError, match="NUL"):
        join_rows([a, b"\0"])
    with pytest.raises(ValueError, match="2 x W"):
        join_rows([a, hex_column(np.array([1]), 2)])
