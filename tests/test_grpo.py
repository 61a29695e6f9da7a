"""The GRPO loop of examples/grpo.py on the embedded model: the engine samples, the trainer's `model.forward`
logprobs match the engine's, weight updates compile nothing, and the reward rises."""

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))

import grpo  # noqa: E402
from serving import LLM  # noqa: E402
from serving.core.model_runner import compilation_count  # noqa: E402
from serving.llm import default_checkpoint_dir  # noqa: E402

pytestmark = pytest.mark.skipif(not os.path.isdir(default_checkpoint_dir()), reason="needs the embedded model")


def test_group_advantages_are_z_scores_within_each_group():
    adv = grpo.group_advantages(np.array([[1.0, 3.0], [2.0, 2.0]]))
    np.testing.assert_allclose(adv, [[-1.0, 1.0], [0.0, 0.0]])


def test_grpo_raises_the_reward_with_the_engines_own_logprobs_and_no_compiles():
    # warmup=False: each step program compiles on first use, in the first GRPO step, so a compile in a later
    # step could only come from the weight updates (every step schedules the same batches).
    llm = LLM(**grpo.ENGINE, warmup=False, seed=0)
    trainer = grpo.GRPOTrainer(llm, grpo.GRPOConfig())
    first = trainer.step()
    # The same function over the same weights: float32 rounding only (the engine sums attention one decode
    # step at a time over its pages, the trainer in one pass).
    assert first["max_logprob_difference"] < 5e-5
    compiled = compilation_count()
    rows = [first] + [trainer.step() for _ in range(19)]
    assert compilation_count() == compiled, "a weight update (or a later step) compiled a step program"
    assert llm.weight_version == 20
    rewards = [r["mean_reward"] for r in rows]
    assert np.mean(rewards[-5:]) > np.mean(rewards[:5]) + 0.2, rewards
    assert max(r["max_logprob_difference"] for r in rows) < 5e-5
