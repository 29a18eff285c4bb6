"""The margin families a config can name (``margin_family``), and what the configuration learns from them.

Each family is a ``losses.Family`` declaration: its margin's builder, its own config keys and their ranges, its
sub-centres, its buffers in the memory plan. A new family is one file (its margin class and its declaration) and
one line in ``FAMILIES``; the config checks, the memory plan, the start-up log and eval.compare read the
declaration from here, so none of them names a family.
"""
from __future__ import annotations

import difflib
from types import SimpleNamespace

from losses import ADAFACE, COMBINED, CURRICULAR, ELASTIC_ARC, ELASTIC_COS, SUBCENTER, Family, MarginFamily
from utils.config import Declared, check_rules
from utils.errors import ConfigError

FAMILIES: dict[str, Family] = {family.name: family for family in (
    COMBINED,
    SUBCENTER,
    ADAFACE,
    CURRICULAR,
    ELASTIC_ARC,
    ELASTIC_COS,
)}


def family_named(name: str) -> Family:
    """The family `name` declares, or a ConfigError suggesting the closest name."""
    if name in FAMILIES:
        return FAMILIES[name]
    close = difflib.get_close_matches(name, list(FAMILIES), n=1, cutoff=0.0)
    raise ConfigError(f"config key 'margin_family' names no margin family {name!r}; did you mean {close[0]!r}? "
                      f"(the families: {', '.join(map(repr, FAMILIES))})")


def check_family(values: dict) -> None:
    """The chosen family's keys must make a margin that favours the target (another family's keys are not read)."""
    family = family_named(values["margin_family"])
    owner = f"margin_family={family.name!r}"
    check_rules(values, family.keys, owner)
    if values["interclass_filtering_threshold"] > 0 and not family.filters_negatives:
        raise ConfigError(f"config key 'interclass_filtering_threshold' filters the combined margin's negatives only, "
                          f"not those of {owner}; set it to 0")


def declared() -> Declared:
    """Every family's keys, and the check of the chosen one, for utils.config.load_config."""
    return Declared(keys=tuple(rule for family in FAMILIES.values() for rule in family.keys), check=check_family)


def build_margin(cfg: SimpleNamespace) -> MarginFamily:
    """The margin of the family `margin_family` names, from its keys."""
    return family_named(cfg.margin_family).build(cfg)


def centres_per_class(cfg: SimpleNamespace) -> int:
    """Centres per class: the sub-centres the family asks for, else one."""
    return family_named(cfg.margin_family).centres_per_class(cfg)
