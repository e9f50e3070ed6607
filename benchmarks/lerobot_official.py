"""Our loader against LeRobot's own `LeRobotDataset`, on a folder LeRobot itself wrote.

    # in a venv with lerobot (not one of our requirements), our repo on sys.path:
    python benchmarks/lerobot_official.py write DIR [--episodes 8 --length 300 --cameras 2 --height 480 --width 640]
    python benchmarks/dataloader.py --lerobot-dir DIR [geometry flags]     # the race (`race_official`)

`write` records a dataset with LeRobot's recording API (`LeRobotDataset.create`, `add_frame`,
`save_episode`, `finalize`): LeRobot's own encoder settings (AV1 by libsvtav1, a keyframe every
2 frames, crf 30, yuv420p). The frames are synthetic but textured (gradients that drift, a
moving square, mild noise), so AV1 has more to decode than flat colours.

The race reads the same windows (episode, condition frame) both ways: ours through
`EpisodeDataset.load` (decode, tile, fit to video_height x video_width), LeRobot's through
`LeRobotDataset[index]` with `delta_timestamps` for the window's video frames, actions and
state (its default video backend: torchcodec where it loads, else PyAV). First it checks, on
every window, that the decoded frames (ours at full size), actions and state are equal;
then it times both, interleaved in rounds, in the main process and with DataLoader workers,
and reports samples/s and ours / official as the median over rounds.
"""
import argparse
import os
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from data.dataset import EpisodeDataset, FixedWindows  # noqa: E402
from data.episodes import WindowSpec  # noqa: E402
from data.lerobot_format import LeRobotSource  # noqa: E402
from data.normalize import NormStats  # noqa: E402
from data.stream import collate_reporting  # noqa: E402
from data import video  # noqa: E402
from benchmarks.results import write_json  # noqa: E402


STATE, ACTION = "observation.state", "action"


def add_race_arguments(parser):
    parser.add_argument("--lerobot-dir", default=None,
                        help="race our loader against LeRobotDataset on this LeRobot folder (no generation)")
    parser.add_argument("--num-video-frames", type=int, default=8)
    parser.add_argument("--global-downsample-rate", type=int, default=3)
    parser.add_argument("--video-action-freq-ratio", type=int, default=2)
    parser.add_argument("--video-height", type=int, default=384)
    parser.add_argument("--video-width", type=int, default=320)
    parser.add_argument("--windows", type=int, default=48, help="windows read per round and side")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=2, help="DataLoader batch size with workers")


# ---- write a dataset with LeRobot's recorder ------------------------------------------------------
def synthetic_frame(k, camera, height, width, rng):
    y, x = np.mgrid[0:height, 0:width]
    frame = np.stack([(x // 2 + 3 * k + 50 * camera) % 256, (y // 2 + 2 * k) % 256,
                      ((x + y) // 4 + k + 90 * camera) % 256], -1).astype(np.int16)
    top, left = (37 * k) % (height - 80), (23 * k + 200 * camera) % (width - 80)
    frame[top:top + 80, left:left + 80] = (230, 60 + 40 * camera, 40)
    frame += rng.integers(-6, 7, frame.shape, dtype=np.int16)
    return frame.clip(0, 255).astype(np.uint8)


def write_with_lerobot(root, episodes, length, cameras, height, width, fps=30, dim=14):
    from lerobot.datasets.lerobot_dataset import LeRobotDataset
    features = {STATE: {"dtype": "float32", "shape": (dim,), "names": None},
                ACTION: {"dtype": "float32", "shape": (dim,), "names": None}}
    keys = [f"observation.images.cam{c}" for c in range(cameras)]
    for key in keys:
        features[key] = {"dtype": "video", "shape": (height, width, 3), "names": ["height", "width", "channels"]}
    dataset = LeRobotDataset.create(repo_id="local/race", fps=fps, features=features, root=root,
                                    robot_type="synthetic", use_videos=True)
    rng = np.random.default_rng(0)
    for e in range(episodes):
        values = np.cumsum(rng.normal(size=(length, dim)), axis=0).astype(np.float32)
        for k in range(length):
            frame = {STATE: values[k], ACTION: values[k] + 0.5, "task": f"task {e % 3}"}
            for c, key in enumerate(keys):
                frame[key] = synthetic_frame(k + 1000 * e, c, height, width, rng)
            dataset.add_frame(frame)
        dataset.save_episode()
        print(f"episode {e + 1}/{episodes} written", flush=True)
    dataset.finalize()


# ---- the race --------------------------------------------------------------------------------------
def our_dataset(args):
    source = LeRobotSource(args.lerobot_dir, 0, STATE, ACTION)

    def on_bad(message):
        raise SystemExit(message)

    spec = WindowSpec(args.num_video_frames, args.global_downsample_rate, args.video_action_freq_ratio)
    return EpisodeDataset(source.load(on_bad), spec, source.image_keys, args.video_height, args.video_width,
                          NormStats({}, mode="none"))


def official_dataset(args, ours):
    """LeRobotDataset over the same folder, asked for the same offsets; None without lerobot."""
    try:
        from lerobot.datasets.lerobot_dataset import LeRobotDataset
    except ImportError:
        return None
    spec, fps = ours.spec, ours.episodes[0].fps
    delta = {key: (spec.video_indices(0) / fps).tolist() for key in ours.image_keys}
    delta[ACTION] = (spec.action_indices(0) / fps).tolist()
    delta[STATE] = [0.0]
    return LeRobotDataset("local/race", root=args.lerobot_dir, delta_timestamps=delta)


def draw_windows(ours, count, seed=0):
    rng = np.random.default_rng(seed)
    return [ours.draw(rng) for _ in range(count)]


def official_index(official, ours, window):
    i, c = window
    return int(official.meta.episodes[ours.episodes[i].index]["dataset_from_index"]) + c


def check_equal(ours, official, windows):
    """Frames (ours decoded at full size), actions and state equal on every window; raises otherwise."""
    for window in windows:
        i, c = window
        ep, sample = ours.episodes[i], ours.load(window)
        item = official[official_index(official, ours, window)]
        np.testing.assert_array_equal(sample["actions"].numpy(), item[ACTION].numpy(), err_msg=f"actions {window}")
        np.testing.assert_array_equal(sample["state"].numpy(), item[STATE][0].numpy(), err_msg=f"state {window}")
        for key in ours.image_keys:
            path, start = ep.videos[key]
            times = (start + ep.timestamps[ours.spec.video_indices(c)]).tolist()
            mine = video.read_frames(path, times, tolerance=0.5 / ep.fps)
            theirs = (item[key] * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
            np.testing.assert_array_equal(mine, theirs, err_msg=f"frames of {key}, window {window}")


def close_official_decoders():
    """LeRobot keeps its torchcodec decoders and their open files in a module-global cache; forked
    workers that inherit open ones share the file offsets and fail ("Could not push packet to
    decoder"), so they are closed before workers start, as in a run that never reads in the main
    process."""
    from lerobot.datasets import video_utils
    video_utils._default_decoder_cache.clear()


class _OfficialWindows(torch.utils.data.Dataset):
    def __init__(self, official, indices):
        self.official, self.indices = official, indices

    def __len__(self):
        return len(self.indices)

    def __getitem__(self, k):
        return self.official[self.indices[k]]


def rate_main(read, items):
    start = time.perf_counter()
    for item in items:
        read(item)
    return len(items) / (time.perf_counter() - start)


def rate_workers(dataset, workers, batch_size, collate_fn=None):
    """Samples/s after the first batch (workers started, files opened)."""
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, num_workers=workers,
                                         collate_fn=collate_fn, prefetch_factor=2)
    batches = iter(loader)
    next(batches)
    start, count = time.perf_counter(), 0
    for batch in batches:
        count += len(batch[ACTION]) if isinstance(batch, dict) else batch[0].batch_size  # ours: (DataBatch, bad)
    return count / (time.perf_counter() - start)


def race_official(args):
    torch.set_num_threads(1)
    ours = our_dataset(args)
    official = official_dataset(args, ours)
    windows = draw_windows(ours, args.windows)
    print(f"{args.lerobot_dir}: {ours.num_episodes()} episodes, cameras {ours.image_keys}, "
          f"{len(ours.spec.video_indices(0))} frames over {ours.spec.span} per camera, "
          f"fitted to {args.video_height}x{args.video_width}; {len(windows)} windows per round")
    result = {"lerobot_dir": os.path.abspath(args.lerobot_dir), "windows": len(windows), "rounds": args.rounds,
              "geometry": {"num_video_frames": args.num_video_frames, "global_downsample_rate":
                           args.global_downsample_rate, "video_action_freq_ratio": args.video_action_freq_ratio,
                           "video_height": args.video_height, "video_width": args.video_width}}
    if official is None:
        print("lerobot is not importable here: timing our loader alone")
    else:
        check_equal(ours, official, windows)
        result["official_backend"] = official.video_backend
        print(f"equal on all {len(windows)} windows: frames, actions, state "
              f"(LeRobotDataset video backend: {official.video_backend})")
    indices = [official_index(official, ours, w) for w in windows] if official is not None else None
    before = sum(v.decoded for v in video._videos.values())
    rows = []
    for workers in (0, args.workers):
        ours_rates, official_rates = [], []
        for r in range(args.rounds):
            sides = ["ours", "official"] if r % 2 == 0 else ["official", "ours"]
            for side in sides:
                if side == "official" and official is None:
                    continue
                if workers == 0:
                    rate = rate_main(ours.load, windows) if side == "ours" else \
                        rate_main(official.__getitem__, indices)
                else:
                    if side == "official":
                        close_official_decoders()
                    rate = rate_workers(FixedWindows(ours, windows, False), workers, args.batch_size, collate_reporting) \
                        if side == "ours" else \
                        rate_workers(_OfficialWindows(official, indices), workers, args.batch_size)
                (ours_rates if side == "ours" else official_rates).append(rate)
        if workers == 0:
            decoded = (sum(v.decoded for v in video._videos.values()) - before) / (args.rounds * len(windows))
            result["frames_decoded_per_sample"] = decoded
        ratios = [a / b for a, b in zip(ours_rates, official_rates)]
        rows.append({"workers": workers, "ours_samples_per_s": statistics.median(ours_rates),
                     "official_samples_per_s": statistics.median(official_rates) if official_rates else None,
                     "ours_over_official": statistics.median(ratios) if ratios else None,
                     "ratio_per_round": ratios})
    print(f"{'workers':>8}{'ours/s':>10}{'official/s':>12}{'ours/official':>15}  per round")
    for row in rows:
        official_rate = f"{row['official_samples_per_s']:.2f}" if row["official_samples_per_s"] else "-"
        ratio = f"{row['ours_over_official']:.2f}x" if row["ours_over_official"] else "-"
        print(f"{row['workers'] or 'main':>8}{row['ours_samples_per_s']:>10.2f}{official_rate:>12}{ratio:>15}  "
              + " ".join(f"{x:.2f}" for x in row["ratio_per_round"]))
    print(f"ours decoded {result['frames_decoded_per_sample']:.1f} frames per sample in the main process "
          f"(every camera; {len(ours.image_keys) * len(ours.spec.video_indices(0))} kept)")
    result["throughput"] = rows
    write_json(args.out, result)


def main():
    parser = argparse.ArgumentParser(description="write a LeRobot dataset with LeRobot's own recorder")
    parser.add_argument("command", choices=["write"])
    parser.add_argument("root")
    parser.add_argument("--episodes", type=int, default=8)
    parser.add_argument("--length", type=int, default=300)
    parser.add_argument("--cameras", type=int, default=2)
    parser.add_argument("--height", type=int, default=480)
    parser.add_argument("--width", type=int, default=640)
    args = parser.parse_args()
    write_with_lerobot(args.root, args.episodes, args.length, args.cameras, args.height, args.width)


if __name__ == "__main__":
    main()
