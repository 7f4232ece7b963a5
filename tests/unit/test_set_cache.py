"""The generated task sets kept on disk (src/task/set_cache.py): the same sets as generated, read back only when
whole, regenerated on any doubt, off when REPLAY_RLOO_CACHE is empty."""

from __future__ import annotations

import json

import pytest

from src.paths import CACHE_ENV, cache_folder
from src.task import countdown, set_cache

SIZES = {"train_size": 40, "heldout_size": 6, "seed": 3, "heldout_seed": 4}


def splits():
    return countdown.train_and_heldout(SIZES)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


def no_generator(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("generated again")

    monkeypatch.setattr(countdown, "generate_instances", refuse)


def test_the_second_run_reads_the_sets_the_first_generated(cache, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, "")
    uncached = splits()
    monkeypatch.setenv(CACHE_ENV, str(cache))
    assert splits() == uncached
    (written,) = cache.iterdir()
    assert written.name.startswith("countdown-") and written.suffix == ".json"
    no_generator(monkeypatch)
    assert splits() == uncached
    assert [inst.target for inst in uncached[0][:3]] == [row[0] for row in json.loads(written.read_text())["train"][:3]]


@pytest.mark.parametrize("damage", [
    lambda text: text[: len(text) // 2],                                    # cut short
    lambda text: json.dumps({**json.loads(text), "train": json.loads(text)["train"][:-1]}),  # one row missing
    lambda text: text.replace("[", '["__import__(\'os\')",', 1),            # a string where a number was
    lambda text: json.dumps({"train": [], "heldout": [], "more": 1}),       # other keys
], ids=["cut", "short", "string", "keys"])
def test_a_damaged_file_is_generated_again_and_replaced(cache, monkeypatch, damage):
    expected = splits()
    (written,) = cache.iterdir()
    written.write_text(damage(written.read_text()))
    assert splits() == expected
    assert set_cache.read_sets(written, {"train": 40, "heldout": 6}, lambda row: True) is not None  # whole again


def test_other_settings_or_other_generator_code_name_another_file(cache, tmp_path):
    source = tmp_path / "generator.py"
    source.write_text("one")
    first = set_cache.cache_file("countdown", SIZES, source)
    assert set_cache.cache_file("countdown", {**SIZES, "seed": 4}, source) != first
    source.write_text("two")
    assert set_cache.cache_file("countdown", SIZES, source) != first
    assert first.parent == cache


def test_an_empty_variable_turns_the_cache_off_and_an_unwritable_folder_is_skipped(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, "")
    assert cache_folder() is None
    expected = splits()
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv(CACHE_ENV, str(blocker / "cache"))  # a folder under a file cannot be made
    assert splits() == expected and blocker.read_text() == ""


def test_the_default_folder_is_the_users_cache(monkeypatch, tmp_path):
    monkeypatch.delenv(CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_folder() == tmp_path / "replay-rloo"
