"""RoboTwin 2.0's policy interface (script/eval_policy.py) for a checkpoint of this recipe.

RoboTwin calls get_model(usr_args) once (usr_args: deploy_policy.yml plus eval.sh's overrides),
reset_model(model) before every episode, and eval(TASK_ENV, model, observation) until
TASK_ENV.take_action_cnt reaches the step limit or the task succeeds. Each eval asks the policy
once and executes `steps_per_query` actions of the chunk (all of it by default, as Motus does)
with TASK_ENV.take_action(action, action_type='qpos'). A user error (no server, a camera
missing, a checkpoint that is not a RoboTwin one) ends the evaluation with one line naming it.
"""
from collections.abc import Mapping
from typing import Any, NoReturn

from .client import PolicyError, RoboTwinPolicy, make_policy


def _fail(error: PolicyError) -> NoReturn:
    raise SystemExit(f"RoboTwin policy: {error}")


def get_model(usr_args: Mapping[str, Any]) -> RoboTwinPolicy:
    try:
        return make_policy(usr_args)
    except PolicyError as e:
        _fail(e)


def reset_model(model: RoboTwinPolicy) -> None:
    """The policy keeps no history between queries: nothing to clear."""


def eval(TASK_ENV: Any, model: RoboTwinPolicy,  # noqa: A001 (RoboTwin looks the function up by this name)
         observation: dict[str, Any]) -> None:
    try:
        actions = model.actions(observation, TASK_ENV.get_instruction())
    except PolicyError as e:
        _fail(e)
    for action in actions:
        TASK_ENV.take_action(action, action_type="qpos")
