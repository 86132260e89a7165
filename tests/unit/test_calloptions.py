"""The call options record (pure): checks, defaults, and the refusal of an option keyword
that is also the method's."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from phalanx.world.calloptions import (
    DEFAULT,
    FORM_OPTIONS,
    OPTION_NAMES,
    CallOptions,
    refuse_clash,
)

names = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=12)


def test_the_default_record_is_the_forms_defaults():
    assert DEFAULT == CallOptions()
    assert (DEFAULT.workers, DEFAULT.timeout, DEFAULT.keep) == ("all", None, False)
    assert {f.name for f in dataclasses.fields(CallOptions)} == set(OPTION_NAMES)
    assert set().union(*FORM_OPTIONS.values()) == set(OPTION_NAMES)


def test_the_record_is_frozen_and_changes_make_a_new_one():
    changed = DEFAULT.with_options({"timeout": 3, "keep": True})
    assert (changed.timeout, changed.keep) == (3.0, True)
    assert DEFAULT.timeout is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        changed.keep = False  # type: ignore[misc]
    assert DEFAULT.with_options({}) is DEFAULT


@given(st.lists(st.integers(min_value=0, max_value=64), max_size=8),
       st.floats(min_value=0, max_value=1e6, allow_nan=False),
       st.booleans(), st.lists(names, max_size=3))
def test_good_values_are_kept(ranks, timeout, keep, axes):
    options = DEFAULT.with_options({"workers": ranks, "timeout": timeout, "keep": keep,
                                    "rank0_only_axes": axes})
    assert options.workers == tuple(ranks)
    assert options.timeout == timeout and options.keep is keep
    assert options.rank0_only_axes == tuple(axes)


@given(st.one_of(st.text(max_size=5), st.integers(), st.none(), st.floats(allow_nan=True)))
def test_keep_is_a_bool_and_nothing_else(value):
    with pytest.raises(TypeError, match="keep must be True or False"):
        DEFAULT.with_options({"keep": value})


@given(st.one_of(st.text(min_size=1, max_size=5), st.booleans(),
                 st.floats(max_value=-1e-9), st.just(float("nan"))))
def test_a_timeout_is_a_number_of_seconds(value):
    with pytest.raises((TypeError, ValueError), match="timeout"):
        DEFAULT.with_options({"timeout": value})


def test_common_kwargs_are_copied_and_read_only():
    given_kwargs = {"a": 1}
    options = DEFAULT.with_options({"common_kwargs": given_kwargs})
    given_kwargs["a"] = 2
    assert options.common_kwargs == {"a": 1}
    with pytest.raises(TypeError):
        options.common_kwargs["b"] = 1  # type: ignore[index]


@given(st.lists(names, min_size=1, max_size=4, unique=True),
       st.lists(names, max_size=6, unique=True))
def test_a_clash_is_refused_exactly_when_a_given_option_is_a_parameter(given_, parameters):
    clash = set(given_) & set(parameters)
    if clash:
        with pytest.raises(TypeError, match="has a parameter of that name") as info:
            refuse_clash("call", "f", given_, parameters)
        assert all(f"{name}=" in str(info.value) for name in clash)
    else:
        refuse_clash("call", "f", given_, parameters)
    refuse_clash("call", "f", given_, None)  # parameters not known: nothing to refuse


def test_each_call_form_takes_its_option_keywords_in_its_signature():
    """The forms declare their option keywords (typed, shown by help()), and they are the
    ones FORM_OPTIONS lists, in the order the forms hand them on."""
    import inspect

    from phalanx.controller.callforms import CallForms

    for form, names in FORM_OPTIONS.items():
        keyword_only = [p.name for p in inspect.signature(getattr(CallForms, form))
                        .parameters.values() if p.kind is inspect.Parameter.KEYWORD_ONLY]
        assert tuple(keyword_only) == names, form
