"""Sort keys and rank numbers read from data file names."""

from __future__ import annotations

from dcpctl.format.file_names import natural_order


def test_natural_order_compares_the_numbers_in_names_as_numbers():
    names = ["__10_0.distcp", "model.safetensors", "__2_0.distcp", "__2_10.distcp",
             "__2_9.distcp"]
    assert sorted(names, key=natural_order) == [
        "__2_0.distcp", "__2_9.distcp", "__2_10.distcp", "__10_0.distcp", "model.safetensors"]


def test_natural_order_takes_only_decimal_digits_for_numbers():
    """`²` passes str.isdigit() but is no number int() reads: a name holding it sorts as
    text, where it made inspect fail; `٣` (Arabic-Indic three) is a decimal digit, read as 3."""
    names = ["__1_0²", "__1_0.distcp", "1²", "٣_0.distcp"]
    assert sorted(names, key=natural_order) == ["1²", "٣_0.distcp", "__1_0.distcp", "__1_0²"]
