"""``asyncrl`` command-line help: what a user reads before the first run."""
import dataclasses

import pytest

from asyncrl.cli import main
from asyncrl.config import Config


def test_train_help_lists_the_config_groups_and_points_at_print_config(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    assert "asyncrl print-config" in text and "trainer.steps=200" in text
    for group in (f.name for f in dataclasses.fields(Config) if dataclasses.is_dataclass(f.type) or f.name == "model"):
        assert f"\n  {group} " in text, group
