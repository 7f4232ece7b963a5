"""One contender of tests/e2e/test_claims.py's race: start a cell together with the others, say whether it trains.

    python -m tests.claim_race <store uri> <folder> <name> <contenders> lock|nolock

Waits until every contender is ready, then calls `src.runs.resume.choose_start` for the same cell and
writes `TRAINS <run id>` or `SKIPS <message>` to <folder>/<name>.out. A winner stays alive (as a
training job would, its claim's heartbeat process running) until every contender has answered.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from hydra import compose, initialize_config_dir

from src.settings import RunSettings
import src.command.config  # noqa: F401  (registers the ${root:} resolver)
from src.runs import claim
from src.paths import CONFIG_DIR
from src.runs.resume import RunAlive, choose_start
from src.study.labels import cell_of
from src.study.sweep import cell_identity


def wait_for(paths: list[Path], timeout_s: float = 120) -> None:
    deadline = time.time() + timeout_s
    while not all(path.exists() for path in paths) and time.time() < deadline:
        time.sleep(0.005)


def main(uri: str, folder: Path, name: str, contenders: int, mode: str) -> None:
    if mode == "nolock":  # what a tracking server gives: no file lock around lookup and claim
        claim.store_has_lock = lambda _: False
        claim.CLAIM_SETTLE_S = 1.0
    with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("config", overrides=[f"tracking.uri={uri}", f"tracking.artifact_location={folder}/artifacts",
                                            "trainer.steps=3"])
    names = [f"c{index}" for index in range(contenders)]
    (folder / f"{name}.ready").touch()
    wait_for([folder / f"{other}.ready" for other in names])
    try:
        answer = f"TRAINS {choose_start(RunSettings(cfg), cell_of(cfg, cell_identity(cfg)), folder / name).run_id}"
    except RunAlive as busy:
        answer = f"SKIPS {busy}"
    (folder / f"{name}.tmp").write_text(answer)
    (folder / f"{name}.tmp").rename(folder / f"{name}.out")
    wait_for([folder / f"{other}.out" for other in names])


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5])
