"""Golden numbers (torchtune style): three training steps of a few cells pinned to hard-coded values.

The values were produced by the training step before its refactor into components (issue 16) and
must never move unless the method itself changes on purpose: a flipped sign of the entropy term, a
different KL normalisation, another advantage or weight rule, a changed draw or budget count all
show here. Run on one thread, so reductions happen in the same order on every machine.
"""

from __future__ import annotations

import pytest
import torch

from src.task import countdown
from src.build import build_components
from src.state import TrainState
from src.train import train_step

# Metrics pinned per step; rewards, weights and budgets are exact, losses to 1e-5 relative.
PINNED = ("train/loss", "train/policy_loss", "train/kl", "train/entropy", "train/reward",
          "weights/raw_mean", "weights/clipped_mean", "budget/fresh_evaluations", "budget/gradient_steps",
          "batch/fresh_groups", "batch/replay_groups")

CELLS = {
    "fresh-only": [],
    "age1": ["buffer=age1"],
    "age2-rho2-c1": ["buffer=age2", "buffer.ratio=2", "clip=tight"],
    "fifo-positive-bias": ["buffer=fifo", "buffer.positive_bias=0.5", "buffer.capacity=6"],
    "fifo-R2-at-least-once": ["buffer=fifo", "buffer.extra_updates=1", "buffer.mode=at_least_once"],
    "grpo-popo": ["loss=grpo", "buffer=popo"],
    "popo-ineff": ["buffer=popo", "buffer.variant=popo-ineff"],
    "stale": ["behaviour=stale", "behaviour.lag=1"],
    "diverse-token-is": ["behaviour=diverse", "behaviour.is_level=token"],
    "dapo": ["sampling=dynamic"],
    "frontier": ["curriculum=frontier", "curriculum.min_memory=2", "curriculum.fraction=0.5"],
    "ipo": ["loss=ipo"],
}

GOLDEN: dict[str, list[dict[str, float]]] = {
    'fresh-only': [
        {'train/loss': -0.8136656582355499, 'train/policy_loss': -0.8078253120183945, 'train/kl': 0.0, 'train/entropy': 0.5840363502502441, 'train/reward': 0.13750001788139343, 'weights/raw_mean': 1.0, 'weights/clipped_mean': 1.0, 'budget/fresh_evaluations': 16, 'budget/gradient_steps': 1, 'batch/fresh_groups': 4, 'batch/replay_groups': 0},
        {'train/loss': -0.07487309584394097, 'train/policy_loss': -0.09025236684828997, 'train/kl': 0.45394791662693024, 'train/entropy': 0.7318115383386612, 'train/reward': 0.05000000447034836, 'weights/raw_mean': 1.0, 'weights/clipped_mean': 1.0, 'budget/fresh_evaluations': 32, 'budget/gradient_steps': 2, 'batch/fresh_groups': 4, 'batch/replay_groups': 0},
        {'train/loss': -0.017246718518435955, 'train/policy_loss': -0.05116763710975647, 'train/kl': 0.8312588334083557, 'train/entropy': 0.7642033398151398, 'train/reward': 0.08750000596046448, 'weights/raw_mean': 1.0, 'weights/clipped_mean': 1.0, 'budget/fresh_evaluations': 48, 'budget/gradient_steps': 3, 'batch/fresh_groups': 4, 'batch/replay_groups': 0},
    ],
    'age1': [
        {'train/loss': -0.8136656582355499, 'train/policy_loss': -0.8078253120183945, 'train/kl': 0.0, 'train/entropy': 0.5840363502502441, 'train/reward': 0.13750001788139343, 'weights/raw_mean': 1.0, 'weights/clipped_mean': 1.0, 'budget/fresh_evaluations': 16, 'budget/gradient_steps': 1, 'batch/fresh_groups': 4, 'batch/replay_groups': 0},
        {'train/loss': -0.07232255674898624, 'train/policy_loss': -0.16115778591483831, 'train/kl': 1.916526049375534, 'train/entropy': 0.6991066187620163, 'train/reward': 0.08125000447034836, 'weights/raw_mean': 0.506119966506958, 'weights/clipped_mean': 0.506119966506958, 'budget/fresh_evaluations': 24, 'budget/gradient_steps': 2, 'batch/fresh_groups': 2, 'batch/replay_groups': 2},
        {'train/loss': 0.491950448602438, 'train/policy_loss': 0.24433422833681107, 'train/kl': 5.122698321938515, 'train/entropy': 0.8518719673156738, 'train/reward': 0.05624999850988388, 'weights/raw_mean': 0.8210728764533997, 'weights/clipped_mean': 0.8210728764533997, 'budget/fresh_evaluations': 32, 'budget/gradient_steps': 3, 'batch/fresh_groups': 2, 'batch/replay_groups': 2},
    ],
    'age2-rho2-c1': [
        {'train/loss': -0.8136656582355499, 'train/policy_loss': -0.8078253120183945, 'train/kl': 0.0, 'train/entropy': 0.5840363502502441, 'train/reward': 0.13750001788139343, 'weights/raw_mean': 1.0, 'weights/clipped_mean': 1.0, 'budget/fresh_evaluations': 16, 'budget/gradient_steps': 1, 'batch/fresh_groups': 4, 'batch/replay_groups': 0},
        {'train/loss': 0.7986225853674114, 'train/policy_loss': -0.11011956259608269, 'train/kl': 18.31616324186325, 'train/entropy': 0.7066055983304977, 'train/reward': 0.13750000298023224, 'weights/raw_mean': 0.25612035393714905, 'weights/clipped_mean': 0.25612035393714905, 'budget/fresh_evaluations': 20, 'budget/gradient_steps': 2, 'batch/fresh_groups': 1, 'batch/replay_groups': 3},
        {'train/loss': 0.5418686978518963, 'train/policy_loss': 0.11115936560783067, 'train/kl': 8.778550885617733, 'train/entropy': 0.8218236267566681, 'train/reward': 0.06875000149011612, 'weights/raw_mean': 0.4366017282009125, 'weights/clipped_mean': 0.33590632677078247, 'budget/fresh_evaluations': 24, 'budget/gradient_steps': 3, 'batch/fresh_groups': 1, 'batch/replay_groups': 3},
    ],
    'fifo-positive-bias': [
        {'train/loss': -0.8136656582355499, 'train/policy_loss': -0.8078253120183945, 'train/kl': 0.0, 'train/entropy': 0.5840363502502441, 'train/reward': 0.13750001788139343, 'weights/raw_mean': 1.0, 'weights/clipped_mean': 1.0, 'budget/fresh_evaluations': 16, 'budget/gradient_steps': 1, 'batch/fresh_groups': 4, 'batch/replay_groups': 0.0},
        {'train/loss': -0.06273631937801838, 'train/policy_loss': -0.16113397002047236, 'train/kl': 2.101301372051239, 'train/entropy': 0.6667422503232956, 'train/reward': 0.06875000149011612, 'weights/raw_mean': 0.500541090965271, 'weights/clipped_mean': 0.500541090965271, 'budget/fresh_evaluations': 24, 'budget/gradient_steps': 2, 'batch/fresh_groups': 2, 'batch/replay_groups': 2.0},
        {'train/loss': 0.35765964072197676, 'train/policy_loss': -0.023498063907027245, 'train/kl': 7.794408276677132, 'train/entropy': 0.8562704771757126, 'train/reward': 0.03750000149011612, 'weights/raw_mean': 0.5580973625183105, 'weights/clipped_mean': 0.5580973625183105, 'budget/fresh_evaluations': 32, 'budget/gradient_steps': 3, 'batch/fresh_groups': 2, 'batch/replay_groups': 2.0},
    ],
    'fifo-R2-at-least-once': [
        {'train/loss': -0.8136656582355499, 'train/policy_loss': -0.8078253120183945, 'train/kl': 0.0, 'train/entropy': 0.5840363502502441, 'train/reward': 0.13750001788139343, 'weights/raw_mean': 1.0, 'weights/clipped_mean': 1.0, 'budget/fresh_evaluations': 16, 'budget/gradient_steps': 1, 'batch/fresh_groups': 4, 'batch/replay_groups': 0},
        {'train/loss': -0.07232255674898624, 'train/policy_loss': -0.16115778591483831, 'train/kl': 1.916526049375534, 'train/entropy': 0.6991066187620163, 'train/reward': 0.08125000447034836, 'weights/raw_mean': 0.506119966506958, 'weights/clipped_mean': 0.506119966506958, 'budget/fresh_evaluations': 24, 'budget/gradient_steps': 3, 'batch/fresh_groups': 2, 'batch/replay_groups': 2},
        {'train/loss': 0.04413696378469467, 'train/policy_loss': -0.09443723410367966, 'train/kl': 2.954514726996422, 'train/entropy': 0.9151537418365479, 'train/reward': 0.05624999850988388, 'weights/raw_mean': 0.511539101600647, 'weights/clipped_mean': 0.511539101600647, 'budget/fresh_evaluations': 32, 'budget/gradient_steps': 5, 'batch/fresh_groups': 2, 'batch/replay_groups': 2},
    ],
    'grpo-popo': [
        {'train/loss': 0.5150742456316948, 'train/policy_loss': 0.1461208132095635, 'train/kl': 7.53875207901001, 'train/entropy': 0.7984167784452438, 'train/reward': 0.17500001192092896, 'weights/raw_mean': 1.0, 'weights/clipped_mean': 1.0, 'budget/fresh_evaluations': 16, 'budget/gradient_steps': 4, 'batch/fresh_groups': 4, 'batch/replay_groups': 0},
        {'train/loss': 0.5024658218026161, 'train/policy_loss': 0.0467439666390419, 'train/kl': 9.368804603815079, 'train/entropy': 1.2718398571014404, 'train/reward': 0.06875000149011612, 'weights/raw_mean': 3.5522148609161377, 'weights/clipped_mean': 0.9039714932441711, 'budget/fresh_evaluations': 32, 'budget/gradient_steps': 8, 'batch/fresh_groups': 4, 'batch/replay_groups': 1},
        {'train/loss': 0.1910109743475914, 'train/policy_loss': -0.01406867802143097, 'train/kl': 4.399817943572998, 'train/entropy': 1.4911235868930817, 'train/reward': 0.06875000149011612, 'weights/raw_mean': 3.3908891677856445, 'weights/clipped_mean': 0.7103264927864075, 'budget/fresh_evaluations': 48, 'budget/gradient_steps': 12, 'batch/fresh_groups': 4, 'batch/replay_groups': 4},
    ],
    'popo-ineff': [
        {'train/loss': -1.6217396557331085, 'train/policy_loss': -1.615650624036789, 'train/kl': 0.0, 'train/entropy': 0.608899787068367, 'train/reward': 0.17500001192092896, 'weights/raw_mean': 1.0, 'weights/clipped_mean': 1.0, 'budget/fresh_evaluations': 16, 'budget/gradient_steps': 1, 'batch/fresh_groups': 4, 'batch/replay_groups': 0},
        {'train/loss': -0.07542686816304922, 'train/policy_loss': -0.09082156978547573, 'train/kl': 0.4542385935783386, 'train/entropy': 0.7317225337028503, 'train/reward': 0.05000000447034836, 'weights/raw_mean': 1.0, 'weights/clipped_mean': 1.0, 'budget/fresh_evaluations': 32, 'budget/gradient_steps': 2, 'batch/fresh_groups': 4, 'batch/replay_groups': 0},
        {'train/loss': 0.1166201252490282, 'train/policy_loss': 0.07023575156927109, 'train/kl': 1.078959733247757, 'train/entropy': 0.7563619166612625, 'train/reward': 0.0625000074505806, 'weights/raw_mean': 1.0813277959823608, 'weights/clipped_mean': 1.0813277959823608, 'budget/fresh_evaluations': 48, 'budget/gradient_steps': 3, 'batch/fresh_groups': 4, 'batch/replay_groups': 1},
    ],
    'stale': [
        {'train/loss': -0.8136656582355499, 'train/policy_loss': -0.8078253120183945, 'train/kl': 0.0, 'train/entropy': 0.5840363502502441, 'train/reward': 0.13750001788139343, 'weights/raw_mean': 1.0, 'weights/clipped_mean': 1.0, 'budget/fresh_evaluations': 16, 'budget/gradient_steps': 1, 'batch/fresh_groups': 4, 'batch/replay_groups': 0},
        {'train/loss': 0.32206035777926445, 'train/policy_loss': 0.0008470069908526057, 'train/kl': 6.562299430370331, 'train/entropy': 0.6901629269123077, 'train/reward': 0.07500000298023224, 'weights/raw_mean': 0.0015607257373631, 'weights/clipped_mean': 0.0015607257373631, 'budget/fresh_evaluations': 32, 'budget/gradient_steps': 2, 'batch/fresh_groups': 4, 'batch/replay_groups': 0},
        {'train/loss': 0.1676109917461872, 'train/policy_loss': 0.0906651756959036, 'train/kl': 1.6986225545406342, 'train/entropy': 0.7985315173864365, 'train/reward': 0.0625, 'weights/raw_mean': 0.06078324466943741, 'weights/clipped_mean': 0.06078324466943741, 'budget/fresh_evaluations': 48, 'budget/gradient_steps': 3, 'batch/fresh_groups': 4, 'batch/replay_groups': 0},
    ],
    'diverse-token-is': [
        {'train/loss': -0.233035147190094, 'train/policy_loss': -0.2265169769525528, 'train/kl': 0.0, 'train/entropy': 0.6518160700798035, 'train/reward': 0.05625000223517418, 'weights/raw_mean': 1.0089970827102661, 'weights/clipped_mean': 1.0089970827102661, 'budget/fresh_evaluations': 16, 'budget/gradient_steps': 1, 'batch/fresh_groups': 4, 'batch/replay_groups': 0},
        {'train/loss': -0.04803479043766856, 'train/policy_loss': -0.06492963153868914, 'train/kl': 0.4640800580382347, 'train/entropy': 0.6309157013893127, 'train/reward': 0.04375000298023224, 'weights/raw_mean': 0.9986598491668701, 'weights/clipped_mean': 0.9986598491668701, 'budget/fresh_evaluations': 32, 'budget/gradient_steps': 2, 'batch/fresh_groups': 4, 'batch/replay_groups': 0},
        {'train/loss': -0.03336990997195244, 'train/policy_loss': -0.05531788617372513, 'train/kl': 0.5890356749296188, 'train/entropy': 0.7503796964883804, 'train/reward': 0.03750000149011612, 'weights/raw_mean': 1.0118300914764404, 'weights/clipped_mean': 1.0118300914764404, 'budget/fresh_evaluations': 48, 'budget/gradient_steps': 3, 'batch/fresh_groups': 4, 'batch/replay_groups': 0},
    ],
    'dapo': [
        {'train/loss': -1.511752501130104, 'train/policy_loss': -1.5055660009384155, 'train/kl': 0.0, 'train/entropy': 0.618648037314415, 'train/reward': 0.125, 'weights/raw_mean': 1.0, 'weights/clipped_mean': 1.0, 'budget/fresh_evaluations': 24, 'budget/gradient_steps': 1, 'batch/fresh_groups': 4, 'batch/replay_groups': 0},
        {'train/loss': -0.2953274289611727, 'train/policy_loss': -0.3029363169334829, 'train/kl': 0.26216722279787064, 'train/entropy': 0.5499466508626938, 'train/reward': 0.07500000298023224, 'weights/raw_mean': 1.0, 'weights/clipped_mean': 1.0, 'budget/fresh_evaluations': 60, 'budget/gradient_steps': 2, 'batch/fresh_groups': 4, 'batch/replay_groups': 0},
        {'train/loss': -0.010913655161857605, 'train/policy_loss': -0.02911992371082306, 'train/kl': 0.501555472612381, 'train/entropy': 0.6871500462293625, 'train/reward': 0.05000000074505806, 'weights/raw_mean': 1.0, 'weights/clipped_mean': 1.0, 'budget/fresh_evaluations': 92, 'budget/gradient_steps': 3, 'batch/fresh_groups': 4, 'batch/replay_groups': 0},
    ],
    'frontier': [
        {'train/loss': -1.5292887538671494, 'train/policy_loss': -1.5231144428253174, 'train/kl': 0.0, 'train/entropy': 0.6174294799566269, 'train/reward': 0.2562499940395355, 'weights/raw_mean': 1.0, 'weights/clipped_mean': 1.0, 'budget/fresh_evaluations': 16, 'budget/gradient_steps': 1, 'batch/fresh_groups': 4, 'batch/replay_groups': 0},
        {'train/loss': -0.2635287754237652, 'train/policy_loss': -0.26825121231377125, 'train/kl': 0.20812490582466125, 'train/entropy': 0.5683804601430893, 'train/reward': 0.07500000298023224, 'weights/raw_mean': 1.0, 'weights/clipped_mean': 1.0, 'budget/fresh_evaluations': 32, 'budget/gradient_steps': 2, 'batch/fresh_groups': 4, 'batch/replay_groups': 0},
        {'train/loss': -0.16144391149282455, 'train/policy_loss': -0.18815501034259796, 'train/kl': 0.6871059238910675, 'train/entropy': 0.7644199430942535, 'train/reward': 0.06875000149011612, 'weights/raw_mean': 1.0, 'weights/clipped_mean': 1.0, 'budget/fresh_evaluations': 48, 'budget/gradient_steps': 3, 'batch/fresh_groups': 4, 'batch/replay_groups': 0},
    ],
    'ipo': [
        {'train/loss': 25.0, 'train/policy_loss': 25.0, 'train/kl': 0.0, 'train/entropy': 0.5840363427606553, 'train/reward': 0.13750001788139343, 'weights/raw_mean': 1.0, 'weights/clipped_mean': 1.0, 'budget/fresh_evaluations': 16, 'budget/gradient_steps': 1, 'batch/fresh_groups': 4, 'batch/replay_groups': 0},
        {'train/loss': 96.08660888671875, 'train/policy_loss': 96.08660888671875, 'train/kl': 0.5225733739538251, 'train/entropy': 0.6299565581343082, 'train/reward': 0.08750000596046448, 'weights/raw_mean': 1.0, 'weights/clipped_mean': 1.0, 'budget/fresh_evaluations': 32, 'budget/gradient_steps': 2, 'batch/fresh_groups': 4, 'batch/replay_groups': 0},
        {'train/loss': 146.90052795410156, 'train/policy_loss': 146.90052795410156, 'train/kl': 0.7447173174689797, 'train/entropy': 0.824139721253339, 'train/reward': 0.06875000149011612, 'weights/raw_mean': 1.0, 'weights/clipped_mean': 1.0, 'budget/fresh_evaluations': 48, 'budget/gradient_steps': 3, 'batch/fresh_groups': 4, 'batch/replay_groups': 0},
    ],
}


def run_steps(cfg, train_set, steps: int) -> list[dict[str, float]]:
    """`steps` training steps of `cfg` with the components src.build builds; the metrics of each step."""
    parts = build_components(cfg, train_set)
    state = TrainState()
    return [train_step(parts, state) for _ in range(steps)]


def golden_config(compose_config, overrides):
    return compose_config("trainer.groups_per_step=4", "trainer.group_size=4", "policy.max_new_tokens=48",
                          "trainer.micro_batch_size=6", "trainer.learning_rate=1e-3", "trainer.kl_coef=0.05",
                          "trainer.entropy_coef=0.01", "hardware.threads=1", *overrides)


@pytest.mark.parametrize("cell", list(CELLS))
def test_three_steps_reproduce_the_golden_numbers(compose_config, cell):
    cfg = golden_config(compose_config, CELLS[cell])
    torch.set_num_threads(1)
    history = run_steps(cfg, countdown.generate_instances(64, seed=1), steps=3)
    got = [{key: step[key] for key in PINNED if key in step} for step in history]
    assert cell in GOLDEN, f"no golden numbers for {cell}: {got}"
    for step, (expected, actual) in enumerate(zip(GOLDEN[cell], got, strict=True)):
        assert actual.keys() == expected.keys(), f"{cell} step {step}: metrics {sorted(actual)}"
        for key, value in expected.items():
            assert actual[key] == pytest.approx(value, rel=1e-5, abs=1e-7), f"{cell} step {step} {key}"
