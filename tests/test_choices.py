"""EnumField: a frozen dataclass's enum field, set from a member or its value."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from idml.augment import Mixup, MixupMode
from idml.models.heads import LevelInput, UncertaintyForm, UncertaintyHeadSpec


def test_values_become_members_and_defaults_stay_members() -> None:
    spec = UncertaintyHeadSpec(form="linear", activation="relu")
    assert spec.form is UncertaintyForm.LINEAR
    assert UncertaintyHeadSpec().level_input is LevelInput.STANDARDIZED
    assert spec == UncertaintyHeadSpec(form=UncertaintyForm.LINEAR, activation="relu")
    assert hash(spec) == hash(UncertaintyHeadSpec(form=UncertaintyForm.LINEAR, activation="relu"))
    # dataclasses read the descriptor for the field's default: the member, not the descriptor.
    defaults = {f.name: f.default for f in dataclasses.fields(UncertaintyHeadSpec)}
    assert defaults["form"] is UncertaintyForm.BOUNDED
    assert Mixup(mode="interpolate").mode is MixupMode.INTERPOLATE


def test_replace_pickle_and_frozenness_keep_members() -> None:
    spec = UncertaintyHeadSpec(form="linear")
    replaced = dataclasses.replace(spec, form="bounded")
    assert replaced.form is UncertaintyForm.BOUNDED
    assert pickle.loads(pickle.dumps(spec)) == spec
    assert repr(spec).startswith("UncertaintyHeadSpec(kind=<UncertaintyKind.ISM: 'ism'>")
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.form = UncertaintyForm.BOUNDED  # type: ignore[misc]  # bad input: the spec is frozen


def test_unknown_value_names_the_choices() -> None:
    with pytest.raises(ValueError, match="'round' is not a valid UncertaintyForm; choose one of"):
        UncertaintyHeadSpec(form="round")
