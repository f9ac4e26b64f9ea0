"""The guess game (tasks.Guess) as an external OpenEnv environment, served by openenv-core's own server, for
the openenv task's tests: it imports nothing of NanoRL's and writes the game's rule again, so the two
agreeing token for token is evidence, not a tautology. Run: python tests/openenv_guess.py --port 8000
(needs pip install -r requirements-openenv.txt), then train.py --task openenv --data http://127.0.0.1:8000"""
import argparse
import re
from fractions import Fraction

import numpy as np
import uvicorn
from openenv.core.env_server import Action, Environment, Observation, State, create_app

NUMBER = re.compile(r"-?(?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)(?:\.[0-9]+)?")   # tasks.py's number: "1,234.5"


class GuessAction(Action):
    message: str                                    # the model's turn, as it wrote it


class GuessObservation(Observation):
    text: str                                       # the prompt after reset, the next user message after step


class GuessEnvironment(Environment):
    """One episode: reset(seed) draws lo..lo+9 and the secret; a wrong guess hears the secret's last digit, a
    right one ends the episode with reward 1. No turn limit: the trainer caps the turns."""
    SUPPORTS_CONCURRENT_SESSIONS = True             # its state is all per instance, one instance a session

    def __init__(self):
        super().__init__()
        self._state, self.done = State(), True      # no game until reset

    def reset(self, seed=None, episode_id=None, **kwargs):
        g = np.random.default_rng(seed)             # no seed: fresh entropy, a random game
        self.lo = int(g.integers(1, 491))
        self.secret = int(g.integers(self.lo, self.lo + 10))
        self._state, self.done = State(episode_id=episode_id), False
        return GuessObservation(text=f"Guess my number. It is from {self.lo} to {self.lo + 9}. Write only "
                                     f"your guess, a single number.")

    def step(self, action, timeout_s=None, **kwargs):
        if self.done:                               # a trainer stepping a finished game has a bug: say so
            raise RuntimeError("no game in progress: reset first")
        self._state.step_count += 1
        found = NUMBER.findall(action.message)      # the guess: the last number of the turn
        self.done = bool(found) and Fraction(found[-1].replace(",", "")) == self.secret
        text = "Right!" if self.done else f"Wrong: my number ends in {self.secret % 10}. Guess again."
        return GuessObservation(text=text, done=self.done, reward=float(self.done))

    @property
    def state(self):
        return self._state


# 256 sessions: a rollout opens one per episode at once (64 and more), plus the trainer's drawing session
app = create_app(GuessEnvironment, GuessAction, GuessObservation, env_name="guess", max_concurrent_envs=256)

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="The guess game, an OpenEnv server on 127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    uvicorn.run(app, host="127.0.0.1", port=parser.parse_args().port, log_level="warning")
