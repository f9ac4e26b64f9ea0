"""CartPole against gymnasium's CartPole-v1, step for step, and the vectorised rollout's bookkeeping."""
import numpy as np
import pytest
import torch

from tasks import EVAL_SEED0, CartPole

gym = pytest.importorskip("gymnasium", reason="gymnasium is a test dependency: pip install -r requirements-dev.txt")


class Scripted:
    """A policy stand-in that plays given action functions (test double for MLPPolicy.act)."""

    def __init__(self, choose):
        self.choose = choose

    def act(self, obs, greedy=False):
        a = self.choose(obs)
        return a, np.full(len(a), -0.5, np.float32)


def balance(obs):  # a controller that keeps the pole up for the whole 500 steps
    return (obs[:, 2] + 0.5 * obs[:, 3] + 0.01 * obs[:, 0] + 0.05 * obs[:, 1] > 0).astype(np.int64)


def gym_episode(seed, choose):
    env = gym.make("CartPole-v1")
    obs, _ = env.reset(seed=seed)
    states, done = [obs], False
    while not done:
        obs, reward, terminated, truncated, _ = env.step(int(choose(obs[None])[0]))
        assert reward == 1.0
        states.append(obs)
        done = terminated or truncated
    return np.stack(states), truncated and not terminated


@pytest.mark.parametrize("choose", [balance, lambda o: (np.sin(1e3 * o[:, 0]) > 0).astype(np.int64)],
                         ids=["balancing-to-truncation", "pseudo-random-until-termination"])
def test_rollout_equals_gymnasium_step_for_step(choose):
    task, seeds = CartPole(), [0, 1, 7, 12345]
    batch = task.rollout(Scripted(choose), seeds, group_size=1)
    for i, seed in enumerate(seeds):
        states, truncated = gym_episode(seed, choose)
        L = len(states) - 1                                                # steps taken
        assert batch.mask.sum(1)[i].item() == L and batch.truncated[i].item() == truncated
        assert np.array_equal(batch.states[i, :L].numpy(), states[:-1])    # bitwise, float32
        assert np.array_equal(batch.final_states[i].numpy(), states[-1])
        assert (batch.mask[i, L:] == 0).all() and (batch.states[i, L:] == 0).all()
    if choose is balance:
        assert batch.truncated.all() and (batch.mask.sum(1) == 500).all()
    else:
        assert not batch.truncated.any() and (batch.mask.sum(1) < 500).all()


def test_groups_share_a_start_and_eval_seeds_are_held_out():
    task = CartPole(eval_episodes=4)
    batch = task.rollout(Scripted(balance), [3, 4], group_size=3)
    assert batch.group_size == 3 and batch.grouped_rewards().shape == (2, 3)            # [n_prompts, G]
    s0 = batch.states[:, 0]                                                # [N, 4] initial states
    assert (s0[:3] == s0[0]).all() and (s0[3:] == s0[3]).all() and not (s0[0] == s0[3]).all()
    train_seeds = task.sample(10_000, np.random.default_rng(0))
    assert max(train_seeds) < EVAL_SEED0                                   # disjoint by construction
    assert task.evaluate(Scripted(balance)) == {"eval_return": 500.0}


def test_sampler_logprobs_match_the_scoring_pass():
    """act() scores one time step [N, O] at a time, logprobs() the stacked [N, T, O]: same numbers."""
    from model import MLPPolicy
    torch.manual_seed(0)
    policy = MLPPolicy(4, 2)
    batch = CartPole().rollout(policy, [1, 2, 3], group_size=2)
    logp, ent = policy.logprobs(batch, entropy=True)
    assert torch.allclose(logp * batch.mask, batch.logp, atol=1e-6)
    assert ((ent > 0) & (ent <= np.log(2) + 1e-6)).all()
