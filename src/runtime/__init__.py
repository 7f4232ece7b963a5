"""How the training step is run (`runtime` config group, SPEC 11): `sync` is SPEC 3's loop in one process;
`async` is seed 001's pipeline of W rollout workers, a trainer and a rollout queue between them, on Ray.

Pure pieces (no Ray, no model): `formulas` (eqs. 1-2, footnote 5, AReaL's staleness rule), `schedule` (the
lockstep virtual clock) and `pipeline` (the schedules as drivers over an abstract unit of work); the queues of
rollouts between workers and trainer (FIFO replay and LIFO) are the buffer group's, in `src.buffer.rollouts`. `ray_work` does that work with
Ray actors and the step's own collect/learn halves; `runners` holds the two runtimes `run.py` calls.
"""
