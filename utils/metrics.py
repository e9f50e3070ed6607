"""Training metrics: metrics.jsonl, TensorBoard, wandb and a progress bar, on rank 0 only."""
import json
import os

from tqdm import tqdm

REPORT_TO = ("tensorboard", "wandb", "all", "none")
WANDB_MODES = ("online", "offline", "disabled")


def rewind_metrics(path, step):
    """On resume at `step`, keep records up to it; move later ones aside (never delete them)."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        lines = [(json.loads(line)["step"], line) for line in f if line.strip()]
    keep = [line for s, line in lines if s <= step]
    later = [line for s, line in lines if s > step]
    if not later:
        return
    aside = f"{os.path.splitext(path)[0]}.rewound_from_step_{step}.jsonl"
    with open(aside, "a") as f:
        f.writelines(later)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(keep)
    os.replace(tmp, path)


class Metrics:
    """Writes one JSON object per logged step; mirrors scalars to TensorBoard and wandb."""

    def __init__(self, cfg, run_dir, enabled, start_step, report_to):
        self.enabled = enabled
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.tb = self.wandb = self.bar = None
        if not enabled:
            return
        rewind_metrics(self.path, start_step)
        if report_to in ("tensorboard", "all"):
            from torch.utils.tensorboard import SummaryWriter
            self.tb = SummaryWriter(os.path.join(run_dir, cfg.logging.tensorboard_log_dir))
        if report_to in ("wandb", "all"):
            import wandb
            from omegaconf import OmegaConf
            self.wandb = wandb.init(project=cfg.logging.wandb_project, name=os.path.basename(run_dir),
                                    dir=run_dir, mode=cfg.logging.wandb_mode, resume="allow",
                                    id=os.path.basename(run_dir), config=OmegaConf.to_container(cfg))
        self.bar = tqdm(total=cfg.training.max_steps, initial=start_step, desc="train", dynamic_ncols=True)

    def log(self, record):
        """`record` holds step and scalars; `lr` is a dict of group name -> lr."""
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        step = record["step"]
        flat = {k: v for k, v in record.items() if k != "step" and isinstance(v, (int, float))}
        flat.update({f"lr/{name}": lr for name, lr in record.get("lr", {}).items()})
        if self.tb:
            for k, v in flat.items():
                self.tb.add_scalar(k, v, step)
        if self.wandb:
            self.wandb.log(flat, step=step)

    def progress(self, step, record):
        if self.bar is None:
            return
        self.bar.n = step
        lr = next(iter(record.get("lr", {}).values()), 0.0)
        self.bar.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{lr:.2e}",
                             samples_s=f"{record['samples_per_sec']:.1f}", refresh=False)
        self.bar.refresh()

    def add_figures(self, step, images=None, figures=None):
        """Validation pictures: `images` name -> CHW tensor in [0, 1]; `figures` name -> matplotlib figure."""
        if not self.enabled or self.tb is None:
            return
        for name, img in (images or {}).items():
            self.tb.add_image(name, img, step)
        for name, fig in (figures or {}).items():
            self.tb.add_figure(name, fig, step)

    def close(self):
        if self.bar is not None:
            self.bar.close()
        if self.tb:
            self.tb.close()
        if self.wandb:
            self.wandb.finish()
