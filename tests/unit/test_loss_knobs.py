"""Every knob a loss declares, or its YAML sets, is one its constructor accepts (`loss=asymre loss.is_max_token=2`
was declared by AsymRE yet refused with a TypeError)."""

from __future__ import annotations

import pytest
import yaml

from src.settings import RunSettings
from src.build import check_settings
from src.paths import CONFIG_DIR
from src.variant import described

LOSSES = sorted(path.stem for path in (CONFIG_DIR / "loss").glob("*.yaml"))


def _settable(loss: str, compose_config) -> dict[str, str]:
    """The loss's settings a user can override: its YAML's keys and its class's declared knobs, each with a value."""
    node = compose_config(f"loss={loss}").loss
    page = yaml.safe_load((CONFIG_DIR / "loss" / f"{loss}.yaml").read_text())
    values = {key: str(value) for key, value in page.items()
              if key not in ("_target_", "name", "defaults") and not isinstance(value, (dict, list))}
    # an example may carry a note after its value ("0.28 (clip-higher)")
    values.update({key: knob.example.split()[0] for key, knob in described(node).knobs.items() if knob.example})
    return values


@pytest.mark.parametrize("loss", LOSSES)
def test_each_loss_accepts_every_knob_it_declares(loss, compose_config):
    settable = _settable(loss, compose_config)
    cfg = compose_config(f"loss={loss}", *(f"loss.{key}={value}" for key, value in settable.items()))
    check_settings(RunSettings(cfg))  # builds the objective from the composed group, as a run does


def test_asymre_declares_no_truncation_knob(compose_config):
    assert "is_max_token" not in described(compose_config("loss=asymre").loss).knobs
