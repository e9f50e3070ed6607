"""The model behind the RoboTwin policy folder: a served checkpoint (openpi-client) or one loaded here.

Either way the policy is asked with RoboTwin's three raw cameras, the 14-D joint vector and the
instruction, under the observation keys the policy's metadata names; the policy composes the
picture (data/robotwin_frame.py, via dataset.frame_layout robotwin of the checkpoint) and puts
serving.instruction_prefix before the instruction, exactly as its training data had them.
The remote mode needs only numpy and openpi-client (with its websockets) in RoboTwin's
environment; the in-process mode imports this repository (torch and the rest).
"""
import sys
from collections.abc import Mapping
from typing import Any

import numpy as np

CAMERAS = ("head_camera", "left_camera", "right_camera")
"""RoboTwin's cameras in the order the policy's image_keys take them (data/robotwin_frame.CAMERAS)."""
ACTION_DIM = 14
"""RoboTwin's aloha-agilex qpos action: left arm 6, left gripper 1, right arm 6, right gripper 1."""


class PolicyError(Exception):
    """What the user must fix: the message names the address, key or value."""


def check_metadata(meta: Mapping[str, Any], where: str) -> None:
    """The policy must take RoboTwin's cameras as composed by Motus and answer 14-D qpos chunks."""
    dim, keys, layout = meta.get("action_dim"), meta.get("image_keys") or [], meta.get("frame_layout")
    if dim != ACTION_DIM:
        raise PolicyError(f"{where}: the checkpoint's action_dim is {dim} but RoboTwin's qpos action has "
                          f"{ACTION_DIM} dimensions (left arm 6, gripper 1, right arm 6, gripper 1)")
    if layout != "robotwin" or len(keys) != len(CAMERAS):
        raise PolicyError(f"{where}: the checkpoint was not trained on RoboTwin's camera picture "
                          f"(dataset.frame_layout {layout}, serving.image_keys {keys}); it needs dataset.frame_layout "
                          "robotwin and 3 serving.image_keys (head, left wrist, right wrist), as configs/robotwin.yaml")
    if not meta.get("state_key"):
        raise PolicyError(f"{where}: the checkpoint takes no robot state (pretrain mode); RoboTwin's policy needs "
                          "a finetune-mode checkpoint")


def request(meta: Mapping[str, Any], observation: dict[str, Any], instruction: str | None) -> dict[str, Any]:
    """RoboTwin's observation (TASK_ENV.get_obs()) + instruction -> the policy's observation dict."""
    cams = observation.get("observation", {}) if isinstance(observation, dict) else {}
    images = []
    for name in CAMERAS:
        rgb = cams.get(name, {}).get("rgb") if isinstance(cams.get(name), dict) else None
        if rgb is None:
            raise PolicyError(f"the observation has no observation['{name}']['rgb'] (it has cameras "
                              f"{sorted(cams)}); enable the head and wrist cameras and rgb in the task config")
        images.append(np.ascontiguousarray(rgb, dtype=np.uint8))
    try:
        state = np.asarray(observation["joint_action"]["vector"], dtype=np.float32)
    except (KeyError, TypeError):
        raise PolicyError("the observation has no joint_action['vector'] (set data_type qpos: true)") from None
    out = dict(zip(meta["image_keys"], images))
    out[meta["state_key"]] = state
    out[meta["prompt_key"]] = str(instruction or "")
    return out


class RemotePolicy:
    """`inference.serve` at ws://host:port, through openpi-client's WebsocketClientPolicy, with one-line errors
    for an address where no server answers or one that speaks another protocol (robot-agnostic)."""

    def __init__(self, address: str, timeout_s: float = 30.0) -> None:
        from openpi_client import msgpack_numpy
        from openpi_client.websocket_client_policy import WebsocketClientPolicy
        from websockets.sync.client import connect

        self.uri = address if address.startswith("ws") else f"ws://{address}"
        try:  # a first look with a deadline: the client itself would wait or raise deep inside websockets
            with connect(self.uri, compression=None, max_size=None, open_timeout=timeout_s) as probe:
                first = probe.recv(timeout=timeout_s)
        except Exception as e:  # refused, unresolvable, not a websocket, silent: all "no policy server there"
            raise PolicyError(f"no policy server answers at {self.uri} ({type(e).__name__}: {e}); start one with "
                              "python -m inference.serve --checkpoint CKPT --port PORT, or set server in "
                              "deploy_policy.yml") from None
        try:
            meta = msgpack_numpy.unpackb(first) if isinstance(first, bytes) else None
        except Exception:  # msgpack raises several types for foreign bytes
            meta = None
        if not isinstance(meta, dict) or "action_shape" not in meta:
            raise PolicyError(f"{self.uri} speaks another protocol: its first message is not inference.serve's "
                              "metadata (openpi-client msgpack with action_shape)")
        self.meta, self.where = meta, self.uri
        host, _, port = self.uri.rpartition(":")
        self.client = WebsocketClientPolicy(host, int(port)) if port.isdigit() else WebsocketClientPolicy(self.uri)

    def infer(self, obs: dict[str, Any]) -> np.ndarray:
        try:
            return np.asarray(self.client.infer(obs)["actions"], dtype=np.float32)
        except RuntimeError as e:  # the server's text answer: a malformed observation or a failed model call
            raise PolicyError(f"{self.uri}: {e}") from None
        except Exception as e:  # the connection broke
            raise PolicyError(f"{self.uri}: lost the policy server ({type(e).__name__}: {e})") from None


class LocalPolicy:
    """The checkpoint loaded in this process with the repository's inference code (Motus's way)."""

    def __init__(self, checkpoint: str, repo: str | None = None, device: str = "cuda",
                 weights: str | None = None) -> None:
        if repo:
            sys.path.insert(0, repo)
        try:
            from inference.load import CheckpointError, load_checkpoint
            from inference.policy import Policy
            from models.serialization import ModelLoadError
            from utils.config import ConfigError
        except ImportError as e:
            raise PolicyError(f"server: null loads the checkpoint here, which needs this recipe's repository "
                              f"(set repo in deploy_policy.yml) and its packages: {e}") from None
        try:
            loaded = load_checkpoint(checkpoint, None, [], device, weights)
        except (CheckpointError, ConfigError, ModelLoadError) as e:
            raise PolicyError(f"checkpoint {checkpoint}: {e}") from None
        self.policy = Policy(loaded)
        self.meta, self.where = self.policy.metadata(), f"checkpoint {checkpoint}"

    def infer(self, obs: dict[str, Any]) -> np.ndarray:
        from inference.policy import ObservationError
        try:
            return self.policy.infer([obs])[0]
        except ObservationError as e:
            raise PolicyError(str(e)) from None


class RoboTwinPolicy:
    """One policy query per `steps_per_query` actions (null: the whole chunk, as Motus)."""

    def __init__(self, policy: RemotePolicy | LocalPolicy, steps_per_query: int | str | None = None) -> None:
        self.policy, self.meta = policy, policy.meta
        chunk = self.meta["action_shape"][0]
        self.steps = chunk if steps_per_query is None else int(steps_per_query)
        if not 1 <= self.steps <= chunk:
            raise PolicyError(f"steps_per_query is {steps_per_query}; expected null or 1..{chunk} (the action chunk)")

    def actions(self, observation: dict[str, Any], instruction: str | None) -> np.ndarray:
        """float32 [steps, 14]: the next joint targets for TASK_ENV.take_action(..., action_type='qpos')."""
        return self.policy.infer(request(self.meta, observation, instruction))[:self.steps]


def make_policy(args: Mapping[str, Any]) -> RoboTwinPolicy:
    """RoboTwinPolicy from deploy_policy.yml's keys (RoboTwin's usr_args or XPolicyLab's deploy config)."""
    server, steps = args.get("server"), args.get("steps_per_query")
    policy: RemotePolicy | LocalPolicy
    if server and str(server).lower() not in ("null", "none"):  # RoboTwin's overrides keep "null" a string
        policy = RemotePolicy(str(server), float(args.get("connect_timeout_s") or 30))
    elif args.get("checkpoint"):
        policy = LocalPolicy(args["checkpoint"], args.get("repo"), args.get("device") or "cuda", args.get("weights"))
    else:
        raise PolicyError("deploy_policy.yml sets neither server (host:port of inference.serve) nor checkpoint "
                          "(server: null loads it in this process)")
    check_metadata(policy.meta, policy.where)
    return RoboTwinPolicy(policy, steps)
