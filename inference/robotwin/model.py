"""XPolicyLab's remote-policy interface (model_template.ModelTemplate) for a checkpoint of this recipe.

XPolicyLab's policy server (client_server/ws/model_server.py) imports XPolicyLab.policy.<name>.model,
builds Model(deploy_cfg) from deploy_policy.yml and answers RoboTwin's scripts/eval_policy_xpolicylab.py:
reset() per episode, update_obs(obs) after every executed action, get_action() once per chunk.
obs is RoboTwin's observation in XPolicyLab's v1.0 format (robotwin_obs_to_xpolicylab: vision/cam_head,
cam_left_wrist, cam_right_wrist -> color; state/{left,right}_arm_joint_state, {left,right}_ee_joint_state);
the answer is XPolicyLab's joint action dicts, one per step.
"""
from collections.abc import Mapping
from typing import Any

import numpy as np

from .client import make_policy

VISION = {"head_camera": "cam_head", "left_camera": "cam_left_wrist", "right_camera": "cam_right_wrist"}
STATE = ("left_arm_joint_state", "left_ee_joint_state", "right_arm_joint_state", "right_ee_joint_state")


def robotwin_observation(obs: Mapping[str, Any]) -> tuple[dict[str, Any], str]:
    """XPolicyLab's v1.0 observation -> (RoboTwin's get_obs() layout, the instruction)."""
    vision, state = obs.get("vision", {}), obs.get("state", {})
    cams = {name: {"rgb": vision[key]["color"]} for name, key in VISION.items()
            if isinstance(vision.get(key), dict) and "color" in vision[key]}
    missing = [k for k in STATE if k not in state]
    vector = None if missing else np.concatenate([np.asarray(state[k], np.float32).reshape(-1) for k in STATE])
    joint = {} if vector is None else {"vector": vector}
    return {"observation": cams, "joint_action": joint}, obs.get("instruction", "")


class Model:
    obs: dict[str, Any] | None  # XPolicyLab's v1.0 observation of the last update_obs

    def __init__(self, model_cfg: Mapping[str, Any]) -> None:
        if str(model_cfg.get("action_type", "joint")).lower() not in ("joint", "qpos"):
            raise ValueError(f"action_type is {model_cfg.get('action_type')}; this policy answers joint (qpos) actions")
        self.policy, self.obs = make_policy(model_cfg), None

    def update_obs(self, obs: dict[str, Any]) -> None:
        self.obs = obs

    def get_action(self) -> list[dict[str, np.ndarray]]:
        if self.obs is None:
            raise ValueError("get_action before update_obs")
        observation, instruction = robotwin_observation(self.obs)
        return [{"left_arm_joint_state": a[:6], "left_ee_joint_state": a[6:7],
                 "right_arm_joint_state": a[7:13], "right_ee_joint_state": a[13:14]}
                for a in self.policy.actions(observation, instruction)]

    def reset(self) -> None:
        self.obs = None
