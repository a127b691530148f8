"""Ray rollout workers (`rollout.backend=ray`) against the in-process runner, on a local Ray runtime with 2 workers:
the same trajectories for the same seeds, weights that follow the learner by version, and a worker killed in the
middle of a step whose episodes are re-run: none lost, none stored twice."""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from test_train_tiny import FAST

from agentgrad.backends.base import SamplingParams
from agentgrad.backends.keyed import KeyedSessionPolicy
from agentgrad.config import build_config
from agentgrad.data.store import TrajectoryStore
from agentgrad.pipelines import rl
from agentgrad.pipelines.components import build_components
from agentgrad.pipelines.rollout_backend import make_rollout_env, run_rollout
from agentgrad.rewards.base import score
from agentgrad.rollout.loop import run_episodes

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.slow
TASKS, G, STEP = 4, 4, 3  # 16 episodes a step: groups 0, 2 on worker 0, groups 1, 3 on worker 1
# batch_invariant: an episode's floats depend less on its neighbours (kv length fixed); see the logprob tolerance.
SHAPE = [*FAST, f"algo.tasks_per_step={TASKS}", f"algo.group_size={G}", "rollout.batch_invariant=true"]


@pytest.fixture(scope="module")
def ray_runtime():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def components(ray_runtime, tmp_path_factory):
    config = build_config(overrides=[*SHAPE, "rollout.backend=ray", "rollout.workers=2"])
    c = build_components(config, tmp_path_factory.mktemp("ray"))
    local = dataclasses.replace(c, config=build_config(overrides=SHAPE), rollout_runner=None)
    yield c, local
    c.rollout_runner.close()


def sampling(c, step=STEP):
    r = c.config.rollout
    return SamplingParams(max_new_tokens=c.limits.max_new_tokens_per_turn, temperature=r.temperature, top_p=r.top_p,
                          seed=c.config.run.seed * 7_919 + step)


def step_tasks(c, step=STEP, n=TASKS):
    return [t for t in rl.rl_tasks(c, step, n=n) for _ in range(G)]


def assert_same_episode(a, b, logprob_atol):
    assert (a.task, a.token_ids, a.loss_mask, a.turns, a.stop_reason, a.messages, a.sample_index,
            a.policy_version) == (b.task, b.token_ids, b.loss_mask, b.turns, b.stop_reason, b.messages,
                                  b.sample_index, b.policy_version)
    assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) <= logprob_atol


def shard_in_process(local, indices, step=STEP):
    """What the in-process runner gives for just these episodes of the step (keyed by their step index)."""
    tasks = step_tasks(local, step)
    return run_episodes(KeyedSessionPolicy(local.policy, indices), local.codec,
                        [make_rollout_env(local.config, local.suite, step, i) for i in indices],
                        [tasks[i] for i in indices], sampling=sampling(local, step), limits=local.limits,
                        sampler=local.sampler, sample_indices=[i % G for i in indices], policy_version=step)


def test_two_workers_give_the_in_process_trajectories(components):
    c, local = components
    remote = run_rollout(c, step_tasks(c), G, sampling=sampling(c), step=STEP, policy_version=STEP)
    in_process = run_rollout(local, step_tasks(local), G, sampling=sampling(local), step=STEP, policy_version=STEP)
    assert len(remote) == len(in_process) == TASKS * G
    assert sum(t.num_generated_tokens for t in remote) > 100  # episodes that generated, not empty ones
    # Same tokens, turns, tool results, stop reasons and versions. The logprobs agree to float rounding: a worker
    # prefills 8 prompts where the whole step prefills 16 (another padded query length and shared prefix), which
    # moves the last bits (measured max 1.4e-6).
    for a, b in zip(remote, in_process):
        assert_same_episode(a, b, logprob_atol=1e-5)
    # Ray itself adds nothing: each worker's shard is bit for bit the in-process run of those same episodes.
    for indices in ([0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15]):
        for i, b in zip(indices, shard_in_process(local, indices)):
            assert_same_episode(remote[i], b, logprob_atol=0.0)


def test_weights_follow_the_learner_by_version(components):
    c, local = components
    run_rollout(c, step_tasks(c), G, sampling=sampling(c), step=STEP, policy_version=STEP)
    syncs = c.rollout_runner.syncs
    run_rollout(c, step_tasks(c), G, sampling=sampling(c), step=STEP, policy_version=STEP)
    assert c.rollout_runner.syncs == syncs  # same version: no broadcast
    model = c.loaded.model
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        with torch.no_grad():  # an "update": the driver's weights move, the workers' must follow at version 4
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.05)
        step = STEP + 1
        remote = run_rollout(c, step_tasks(c, step), G, sampling=sampling(c, step), step=step, policy_version=step)
        assert c.rollout_runner.syncs == syncs + 1
        assert {t.policy_version for t in remote} == {step}
        for i, b in zip([0, 1, 2, 3, 8, 9, 10, 11], shard_in_process(local, [0, 1, 2, 3, 8, 9, 10, 11], step)):
            assert_same_episode(remote[i], b, logprob_atol=0.0)
    finally:
        model.load_state_dict(saved)


KILL_TASKS = 8  # 32 episodes, 16 a worker: a longer window to kill one in


def _cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def test_a_worker_killed_mid_step_has_its_episodes_rerun_none_lost_none_duplicated(components, tmp_path):
    c, local = components
    driver = c.rollout_runner
    driver.sync_weights(STEP, c.loaded.model.state_dict())
    victim = driver.workers[0]
    pid = ray.get(victim.pid.remote())
    before, respawned, reissued = _cpu_ticks(pid), driver.respawned, driver.reissued
    pending = driver.submit(driver.shards(step_tasks(c, n=KILL_TASKS), G, sampling(c), STEP))
    victim_ref = next(ref for ref, (slot, *_) in pending.items() if slot == 0)
    deadline = time.monotonic() + 60
    while _cpu_ticks(pid) < before + 3 and time.monotonic() < deadline:  # 30 ms of CPU: it is running episodes
        time.sleep(0.002)
    ready, _ = ray.wait([victim_ref], timeout=0)
    assert not ready, "the shard finished before the kill: make it longer"
    ray.kill(victim)
    results = driver.gather(pending)
    assert driver.respawned == respawned + 1
    assert driver.reissued == reissued + KILL_TASKS * G // 2  # worker 0's half of the groups
    assert driver.workers[0] is not victim
    # Every episode exactly once, and the re-run ones are the episodes the dead worker had (same seeds).
    assert sorted(results) == list(range(KILL_TASKS * G))
    in_process = run_rollout(local, step_tasks(local, n=KILL_TASKS), G, sampling=sampling(local), step=STEP,
                             policy_version=STEP)
    for i in range(KILL_TASKS * G):
        assert_same_episode(results[i], in_process[i], logprob_atol=1e-5)
    # Into the store as a step stores them: each (group, sample) once.
    store = TrajectoryStore(tmp_path / "trajectories")
    scored = score([results[i] for i in range(KILL_TASKS * G)], c.reward_fn, c.suite)
    store.append(scored, step=STEP, stage="rl", groups=[f"{STEP}:{i // G}" for i in range(KILL_TASKS * G)])
    keys = Counter((r.group, r.sample.trajectory.sample_index) for r in store.records())
    assert len(keys) == KILL_TASKS * G and set(keys.values()) == {1}


def test_an_rl_step_on_ray_workers_logs_their_counters(components, tmp_path):
    c, _ = components
    state = rl.start_rl(c)
    metrics = rl.rl_step(c, STEP + 2, state, TrajectoryStore(tmp_path / "t"))
    assert metrics["ray/workers"] == 2.0 and metrics["ray/weight_syncs"] >= 1
    assert metrics["rollout/generated_tokens"] > 0


def test_a_worker_dead_between_steps_is_replaced_at_the_next_broadcast(components):
    c, local = components
    driver = c.rollout_runner
    victim, respawned = driver.workers[1], driver.respawned
    ray.kill(victim)
    version = STEP + 10  # a new version: the broadcast finds the dead worker
    remote = run_rollout(c, step_tasks(c), G, sampling=sampling(c), step=STEP, policy_version=version)
    assert driver.respawned == respawned + 1 and driver.workers[1] is not victim
    in_process = run_rollout(local, step_tasks(local), G, sampling=sampling(local), step=STEP,
                             policy_version=version)
    for a, b in zip(remote, in_process, strict=True):
        assert_same_episode(a, b, logprob_atol=1e-5)


def test_more_worker_cpus_than_the_runtime_offers_is_one_clear_error(ray_runtime):
    from agentgrad.pipelines.preflight import BadInputError
    from agentgrad.pipelines.ray_rollout import RayRollout

    config = build_config(overrides=[*SHAPE, "rollout.backend=ray", "rollout.workers=3"])  # 3 CPUs of 2
    with pytest.raises(BadInputError, match="needs 3 CPUs; the Ray runtime offers 2"):
        RayRollout(config, "unused")
    assert ray.is_initialized()  # a runtime it joined is left running
