"""The search settings (decode/options.py), checked as they are made: each range named as the
command line and the server name it."""

from __future__ import annotations

import math

import pytest

from attn_cli.decode.options import DecodeOptions, OutOfRange
from attn_cli.errors import AttnError


def test_decode_options_refuse_sampling_options_without_sample():
    for options in ({"topk": 5}, {"topp": 0.9}, {"temperature": 0.5}):
        with pytest.raises(AttnError, match="--sample"):
            DecodeOptions(**options)
        assert DecodeOptions(**options, sample=True).sample  # with --sample: what they are for
    with pytest.raises(AttnError, match="--nbest"):
        DecodeOptions(sample=True, nbest=2)


@pytest.mark.parametrize("changes, message", [
    ({"beam": 0}, "beam must be at least 1"),
    ({"nbest": 0}, "nbest must be at least 1"),
    ({"alpha": -0.1}, "alpha must be at least 0.0"),
    ({"alpha": math.nan}, "alpha must be a finite number"),
    ({"max_len_a": math.inf}, "max_len_a must be a finite number"),
    ({"max_len_b": -1}, "max_len_b must be at least 0"),
    ({"topk": -1, "sample": True}, "topk must be at least 0"),
    ({"topp": 0.0, "sample": True}, "topp must be above 0"),
    ({"topp": 1.5, "sample": True}, "topp must be at most 1"),
    ({"temperature": 0.0, "sample": True}, "temperature must be at least 0.001"),
    ({"temperature": 5e-324, "sample": True}, "temperature must be at least 0.001"),
    ({"temperature": 1e308, "sample": True}, "temperature must be at most 1000.0"),
    ({"alpha": 1e308}, "alpha must be at most 10.0"),
    ({"max_len_a": 1e20}, "max_len_a must be at most 10.0"),
    ({"batch_tokens": 0}, "batch_tokens must be at least 1"),
    ({"workers": 0}, "workers must be at least 1"),
])
def test_decode_options_check_each_range_naming_the_field(changes, message):
    """The one place the search settings' ranges are checked: for the library, for `attn
    serve`'s requests (answered 422 with the field's name) and for the commands (one line
    with the option's), behind Typer's bounds."""
    with pytest.raises(OutOfRange) as error:
        DecodeOptions(**changes)
    assert f"{error.value.field} {error.value.rule}" == message
    assert str(error.value) == "--" + message.replace("_", "-")
    assert DecodeOptions(topp=1.0, temperature=1.0, max_len_a=0.0, max_len_b=0, seed=-5)
    assert DecodeOptions(alpha=10.0, max_len_a=10.0, sample=True, temperature=1e-3)  # inclusive
